"""The MoE tiered launch with Hopper warpgroup MMA (Gluon): prefill route blocks of 64 or 128 slots.

Same contract as :func:`exl3rt.kernels.moe.tiered_partials` (split-K partials ``z [P, splits, slots, out_p]``
of ``x'[slot]·Q_{e(slot)}`` for every tier in one launch, gate and up as one grid), computed like the dense
:mod:`exl3rt.kernels.wgmma` kernel with one route block as the wgmma's N: program (64 columns, route block
j, K split) reads block j's expert and its descriptor ``(tier << shift) | local``, requests the block's x'
rows (row-major fp16, ``[BR, 64]`` TMA boxes, BR = the route block) and runs the tier's decode-and-wgmma
loop — K is a compile-time constant per tier, so the kernel holds one loop per tier (up to four) and a
program runs the one its block needs. Each warp decodes one n-tile of the expert straight into the wgmma A
registers (the dense kernel's helpers, unchanged), so every decoded tile serves the whole route block.

Used by the fused MoE path (:func:`exl3rt.kernels.moe._fused`) for route blocks of 64/128 on devices
where :func:`exl3rt.kernels.wgmma.available` holds (x'/h' then row-major); ``GlueLaunch.wgmma=False`` or
``EXL3RT_KERNEL_NO_WGMMA=1`` keep the mma launch. Padding slots of a live block are computed like routes
(their z rows are never read). CI builds the kernel for sm_90 (``tests/test_moe_wgmma.py``); the numbers
are checked on the H200 against the mma launch and float64.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from . import wgmma as _wg
from .launch import launch
from .wgmma import HAVE_GLUON, KC, WARPS

#: route blocks the wgmma launch takes (the wgmma's N; TMA boxes of [block, 64] x' rows), and per block (x' buffers,
#: two chunks decoded per wgmma wait — ``WgmmaConfig.pair``): the fastest settings tried against the mma launch
#: (docs/moe.md, "Tuned constants"); blocks of 16 stay on the mma launch
SETTINGS = {32: (2, True), 64: (3, True), 128: (4, True)}
#: the programs the K split aims at (prefill grids are large: no split then)
TARGET_PROGRAMS = 1024

if HAVE_GLUON:
    from .common import tier_count, tier_field
    from .mma import LANE_PTX_KEY, lane_ptx_constraints, lane_ptx_text
    from .wgmma import chunk_words, run_chunks, warp_lanes, refill_x, gl, gluon, mbarrier

    _KC = gl.constexpr(KC)
    _WARPS = gl.constexpr(WARPS)

    @gluon.jit
    def _tier_chunks(acc, xs, bars, x_desc, w_ptr, local, tile0, a0, k_tiles, n_tiles, nchunks, m0, one,
                     KA: gl.constexpr, HALF: gl.constexpr, NWL: gl.constexpr, TEXT: gl.constexpr,
                     CONS: gl.constexpr, DOT: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr):
        """The waiting chunk loop of :mod:`exl3rt.kernels.wgmma` on expert ``local`` of a tier's stack."""
        estride = k_tiles * n_tiles * (8 * KA + 4 * HALF)          # int32 words per expert
        wb, kstride, rsh, xorc, idx = warp_lanes(w_ptr + local.to(gl.int64) * estride, tile0, a0, n_tiles, one,
                                             KA, HALF, NWL)
        wc = chunk_words(wb, 0, kstride, nchunks > 0, idx, NWL)
        return run_chunks(acc, xs, bars, x_desc, wb, wc, kstride, nchunks, m0, a0, idx, rsh, xorc,
                       TEXT, CONS, NWL, DOT, STAGES, False, PAIR)

    # nothing that follows from the row count is a specialization (slots, the second input's first row, the
    # partials' strides, the k-tiles per split): a prewarm at one row count covers the others
    @gluon.jit(do_not_specialize=["slots", "k_per", "stride_zs", "stride_zp", "xrow_p", "one"])
    def _moe_wgmma_kernel(x_desc, z_ptr, blk_ptr, desc_ptr, npad_ptr, w0, w1, w2, w3, v0, v1, v2, v3,
                          slots, k_tiles, n_tiles, k_per, stride_zs, stride_zp, xrow_p, one, n_groups,
                          SHIFT: gl.constexpr, TIERS: gl.constexpr, CB: gl.constexpr, MULT: gl.constexpr,
                          ADD: gl.constexpr, BR: gl.constexpr, STAGES: gl.constexpr, NPROJ: gl.constexpr,
                          PAIR: gl.constexpr):
        """Program (column group, route block j, K split): ``z[slot, 64 columns] = x'[slot]·Q_e`` for the BR
        slots of block j (expert e = blk[j]); blocks past ``npad`` do nothing. NPROJ = 2: column groups from
        ``n_groups`` on run the second projection (tiers ``v*``, x' rows from ``xrow_p``, partials
        ``z + stride_zp``). ``TIERS`` (:func:`~exl3rt.kernels.common.tier_spec`): each tier's K and NWL; tier t's
        stacked trellis is ``w<t>``, its lane decode the PTX of its K and the codebook (``CB``, ``MULT``, ``ADD``)."""
        pid_n = gl.program_id(0)
        j = gl.program_id(1)
        pid_k = gl.program_id(2)
        xrow = 0
        if NPROJ > 1:
            if pid_n >= n_groups:
                pid_n -= n_groups
                z_ptr += stride_zp
                xrow = xrow_p
                w0 = v0
                w1 = v1
                w2 = v2
                w3 = v3
        ws = (w0, w1, w2, w3)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_WARPS, 1],
                                                     instr_shape=[16, BR, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        xs = gl.allocate_shared_memory(gl.float16, [STAGES, BR, _KC * 16], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if j * BR < gl.load(npad_ptr):
            e = gl.load(blk_ptr + j)
            d = gl.load(desc_ptr + e)
            tier = d >> SHIFT
            local = d & ((1 << SHIFT) - 1)
            a0 = pid_k * k_per
            nchunks = (gl.minimum(a0 + k_per, k_tiles) - a0) // _KC
            for s in gl.static_range(STAGES):
                mbarrier.init(bars.index(s), count=1)
            m0 = xrow + j * BR
            for s in gl.static_range(STAGES):
                refill_x(x_desc, xs, bars, s, m0, a0 + s * _KC, s < nchunks)
            acc = gl.zeros([16 * _WARPS, BR], gl.float32, MMA)
            tile0 = pid_n * _WARPS
            NTIERS: gl.constexpr = tier_count(TIERS)
            for t in gl.static_range(NTIERS):
                if tier == t:
                    acc = _tier_chunks(acc, xs, bars, x_desc, ws[t], local, tile0, a0, k_tiles, n_tiles, nchunks, m0,
                                       one, tier_field(TIERS, t, 0), tier_field(TIERS, t, 1), tier_field(TIERS, t, 2),
                                       lane_ptx_text(tier_field(TIERS, t, 0), tier_field(TIERS, t, 1), CB, MULT, ADD,
                                                     LANE_PTX_KEY),
                                       lane_ptx_constraints(tier_field(TIERS, t, 0), tier_field(TIERS, t, 1), CB, MULT,
                                                            ADD),
                                       DOT, STAGES, PAIR)
            for s in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(s))
            nn = gl.arange(0, 16 * _WARPS, layout=gl.SliceLayout(1, MMA))
            mm = j * BR + gl.arange(0, BR, layout=gl.SliceLayout(0, MMA))
            offs = mm[None, :].to(gl.int64) * (n_tiles * 16) + (tile0 * 16 + nn)[:, None]
            gl.store(z_ptr + pid_k.to(gl.int64) * stride_zs + offs, acc, mask=(mm < slots)[None, :])


def applies(device: torch.device, block_m: int) -> bool:
    """The wgmma tiered launch serves route blocks of ``block_m`` on ``device``."""
    return block_m in SETTINGS and _wg.available(device)


def tiered_partials_wgmma(xs: torch.Tensor, tier_trellis: Sequence[torch.Tensor], block_experts: torch.Tensor,
                          num_padded: torch.Tensor, descriptors: torch.Tensor, shift: int, block_m: int,
                          codebook: str, *, second: Optional[Sequence[torch.Tensor]] = None,
                          target_programs: int = TARGET_PROGRAMS, alloc: Optional[Callable] = None) -> torch.Tensor:
    """:func:`exl3rt.kernels.moe.tiered_partials` (``zero=False``) on the wgmma kernel: ``xs`` row-major fp16
    ``[slots, in_p]`` or ``[2, slots, in_p]`` (one input per projection with ``second``); returns fp32
    partials ``[P, splits, slots, out_p]`` (rows of slots outside live blocks unwritten). ``alloc(shape, dtype=,
    device=)`` makes the partials (a launch plan's recording notes them)."""
    from ..format.bits import bits_from_trellis
    from .moe import tier_words
    name = "tiered_partials_wgmma"
    if not applies(xs.device, block_m):
        raise RuntimeError(f"{name}: needs route blocks of {tuple(SETTINGS)} on a device where the wgmma kernel runs "
                           f"(compute capability 9.0, Gluon), got block {block_m} on {xs.device}")
    k_tiles, n_tiles, ws, vs = tier_words(name, tier_trellis, second)
    nproj = 1 if second is None else 2
    in_p, slots = xs.shape[-1], xs.shape[-2]
    if xs.dtype != torch.float16 or in_p != 16 * k_tiles or not xs.is_contiguous():
        raise ValueError(f"{name}: xs must be contiguous fp16 [..., slots, {16 * k_tiles}], got {xs.dtype} "
                         f"{tuple(xs.shape)}")
    if k_tiles % KC or n_tiles % WARPS:
        raise ValueError(f"{name}: widths must be multiples of 64 ({16 * k_tiles} × {16 * n_tiles})")
    xrow_p = slots if xs.dim() == 3 and xs.shape[0] > 1 else 0
    n_groups, max_blocks = n_tiles // WARPS, int(block_experts.shape[0])
    splits, k_per = _wg.wgmma_splits(k_tiles, nproj * n_groups * max(1, max_blocks), target_programs)
    z = (alloc or torch.empty)((nproj, splits, slots, n_tiles * 16), dtype=torch.float32, device=xs.device)
    if max_blocks == 0:
        return z
    desc = _wg.TensorDescriptor.from_tensor(xs.view(-1, in_p), [block_m, KC * 16], _wg.x_layout(block_m))
    launch(_moe_wgmma_kernel, (nproj * n_groups, max_blocks, splits),
           desc, z, block_experts, descriptors, num_padded, *ws, *vs, slots, k_tiles, n_tiles, k_per, z.stride(1),
           z.stride(0), xrow_p, 1, n_groups, SHIFT=shift, num_warps=WARPS,
           **kernel_constants([bits_from_trellis(tr[0]) for tr in tier_trellis], codebook, block_m, nproj))
    return z


def kernel_constants(tier_bits: Sequence, codebook: str, block_m: int, nproj: int) -> dict:
    """The compile-time arguments of ``_moe_wgmma_kernel`` but ``SHIFT``: the tiers' K and NWL
    (:func:`~exl3rt.kernels.common.tier_spec`), the codebook's constants, the route block, its buffers and paired
    chunks (:data:`SETTINGS`) and the projections."""
    from .common import cb_args, tier_spec
    stages, pair = SETTINGS[block_m]
    cb, mult, add = cb_args(codebook)
    return dict(TIERS=tier_spec(tier_bits), CB=cb, MULT=mult, ADD=add, BR=block_m, STAGES=stages, NPROJ=nproj,
                PAIR=pair)


__all__ = ["SETTINGS", "applies", "kernel_constants", "tiered_partials_wgmma"]
