"""Mixed-bitrate EXL3 MoE on the GPU: each projection of every tier in one launch.

An MoE layer's experts are grouped into tiers by bitrate (:mod:`exl3rt.moe.tiers`); routes are
packed into blocks of ``block_m`` routes of one expert (:func:`exl3rt.kernels.routing.pack_routes`,
combined expert ids). Per projection, one launch of :func:`_moe_mma_kernel` covers every block of
every tier: program (n-tiles, block j) reads the block's expert, its descriptor word
``(tier << shift) | local``, and runs the tier's decoder (K is a compile-time constant per tier, so
the kernel holds one decode loop per tier) on ``tier_trellis[local]`` — the warp-level mma GEMV of
:mod:`exl3rt.kernels.mma` (each lane decodes its own mma fragment), 16 routes per pass. Gate and up
run as one launch (``NPROJ = 2``: the grid's first dimension covers both projections).

:func:`exl3_moe` computes, for routes r = (token t, slot s) of expert e::

    x'_r = (x_t ⊙ up_suh_e)·H                       (gather + input rotation; gate likewise)
    g_r  = (x'_r·Q_gate,e)·H ⊙ gate_svh_e          (tiered launch, then rotation)
    u_r  = (x'_r·Q_up,e)·H ⊙ up_svh_e
    h'_r = ((act(g_r) · u_r) ⊙ down_suh_e)·H
    y_t += w[t, s] · ((h'_r·Q_down,e)·H ⊙ down_svh_e)

Fused path (default, activation silu): six Triton launches — route packing in one program
(:func:`pack_routes_fused`), pre-pass, gate+up, mid-pass, down, post-pass (the passes are in
:mod:`exl3rt.kernels.moe_glue`); on Hopper, route blocks of 32/64/128 run gate+up and down on the wgmma
tiered launch instead (:mod:`exl3rt.kernels.moe_wgmma`). ``fused=False`` (and any other activation): the
torch glue around three tiered launches (gate, up, down), the reference the fused passes are tested against.
On the CPU the kernels run in Triton's interpreter (tests); the torch reference of the whole layer is
:class:`exl3rt.moe.reference.ReferenceLaunch`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .. import env
from ..format.bits import bits_from_trellis
from ..format.hadamard import hadamard_blocks
from .routing import ID_DTYPES, RoutePack, pack_routes, route_capacity
from ..util.ints import next_pow2
from . import mma as _mm
from . import moe_wgmma as _mwg
from ._triton import HAVE_TRITON, tl, triton
from .launch import (Recording, Replay, current_stream, direct_launch_ok, launch, plans_epoch, run_plan,
                     scratch_layout)
from .common import cb_args, interpreting, pdl_args, tier_spec, use_asm, use_pdl
from .linear import gemv_splits, stream_workspace, use_halves

MAX_TIERS = 4

#: programs a tiered launch aims at (n-tile groups × route blocks × K splits; the route blocks counted are
#: every block the pack may fill, live or not) and the fewest k-tiles a split should get (docs/moe.md, "Tuned
#: constants")
TARGET_PROGRAMS = 16896
MIN_SPLIT_K_TILES = 24
#: the fewest k-tiles per split where the splits add into one buffer (``atomic``: the decode plan's route blocks of
#: 8), where more splits cost no partials to read
MIN_SPLIT_K_TILES_ATOMIC = 8

#: n-tiles per program of a tiered launch: four at every route block
DEFAULT_NT = 4


if HAVE_TRITON:
    from .common import tier_count, tier_field
    from .mma import mma_pass, unroll_for

    @triton.jit
    def _tier_pass(x_ptr, w_ptr, z_ptr, lim, m0, local, a0, a1, k_tiles, n_tiles, pid_n, stride_x, one,
                   KA: tl.constexpr, HALF: tl.constexpr, CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr,
                   NT: tl.constexpr, WARPS: tl.constexpr, NWL: tl.constexpr, ASM: tl.constexpr,
                   SWAP: tl.constexpr, XFRAG: tl.constexpr, MB: tl.constexpr, HALVES: tl.constexpr = False,
                   ATOMIC: tl.constexpr = False, PDL: tl.constexpr = False):
        """One pass of 16·MB routes (8 with SWAP; MB 16-row blocks share each decoded tile) of one tier:
        expert ``local`` of the tier's stacked trellis at ``w_ptr``; 16-row blocks past ``lim`` (padding
        slots only) load no x' and run no mma."""
        estride = k_tiles * n_tiles * (8 * KA + 4 * HALF)          # int32 words per expert
        mma_pass(x_ptr, w_ptr + local * estride, z_ptr, lim, m0, a0, a1, pid_n, n_tiles, stride_x, one,
                  KA, HALF, CB, MULT, ADD, NT, WARPS, NWL, ASM, MB, SWAP, PDL, unroll_for(KA, HALF),
                  XFRAG, MB > 1, HALVES, ATOMIC)

    @triton.jit
    def _ld_pack(ptr, PDL: tl.constexpr):
        """A load of the packer's output; with ``PDL`` from L2 (``.cg``), as it is read before this launch waits."""
        if PDL:
            return tl.load(ptr, cache_modifier=".cg")
        return tl.load(ptr)

    # k_per follows from the row count (the split-K target counts route blocks): no specialization on it,
    # or a prewarm at one row count would not cover another
    @triton.jit(do_not_specialize=["rows", "one", "k_per", "numel"])
    def _moe_mma_kernel(x_ptr, z_ptr, blk_ptr, desc_ptr, npad_ptr, routes_ptr, numel, w0, w1, w2, w3, v0, v1, v2, v3,
                        rows, k_tiles, n_tiles, k_per, stride_x, stride_zs, one, n_blocks, stride_xp, stride_zp,
                        SHIFT: tl.constexpr, TIERS: tl.constexpr,
                        CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr, NT: tl.constexpr,
                        WARPS: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr, NPROJ: tl.constexpr,
                        XFRAG: tl.constexpr = False, MB: tl.constexpr = 1, REAL: tl.constexpr = False,
                        HALVES: tl.constexpr = False, ATOMIC: tl.constexpr = False, PDL: tl.constexpr = False):
        """z[slot, :] = x'[slot, :]·Q_e for the BLOCK_M slots of route block ``program_id(1)``
        (expert e = blk[j]), the n-tiles of ``program_id(0)``, K-split ``program_id(2)`` (partials
        ``z[split]``); blocks past ``npad / BLOCK_M`` exit. NPROJ = 2: two projections of the same
        geometry in one grid (gate and up): programs ``program_id(0) >= n_blocks`` run the second
        (tiers ``v0..v3``, input ``x + stride_xp``, partials ``z + stride_zp``). ``XFRAG``: x' in fragment
        order (``stride_x`` then int32 words per row block; route blocks are whole row blocks). ``MB``: 16-row
        blocks per pass sharing each decoded tile (``BLOCK_M`` a multiple of 16·MB). ``REAL``: the block's live
        routes are counted in ``routes_ptr`` (sorted routes, padding ``>= numel``, at the tail of the block):
        rows past them are neither loaded nor stored, and 16-row blocks of padding only run no mma. ``ATOMIC``
        (``stride_zs = 0``): every K split adds into ``z[…, 0]`` (``red.add``) instead of storing its partials.
        ``PDL`` (programmatic dependent launch): the block's expert, tier and first trellis words are read before
        the wait for the pass that wrote x' (that pass waited for the packer before it let this launch start);
        no early trigger (the next pass's programs would hold multiprocessor slots while this grid runs)."""
        pid_n = tl.program_id(0)
        j = tl.program_id(1)
        pid_k = tl.program_id(2)
        if NPROJ > 1:
            if pid_n >= n_blocks:
                pid_n -= n_blocks
                x_ptr += stride_xp
                z_ptr += stride_zp
                w0 = v0
                w1 = v1
                w2 = v2
                w3 = v3
        ws = (w0, w1, w2, w3)
        NTIERS: tl.constexpr = tier_count(TIERS)
        a0 = pid_k * k_per
        a1 = tl.minimum(a0 + k_per, k_tiles)
        z_ptr = z_ptr + pid_k * stride_zs
        if j * BLOCK_M < _ld_pack(npad_ptr, PDL):
            e = _ld_pack(blk_ptr + j, PDL)
            d = tl.load(desc_ptr + e)
            tier = d >> SHIFT
            local = d & ((1 << SHIFT) - 1)
            if REAL:
                sl = j * BLOCK_M + tl.arange(0, BLOCK_M)
                lim = j * BLOCK_M + tl.sum((_ld_pack(routes_ptr + sl, PDL) < numel).to(tl.int32), axis=0)
            else:
                lim = tl.minimum(rows, (j + 1) * BLOCK_M)
            # blocks of at most 8 routes (the decode plan): the decoded tile is the mma's A operand
            # (mma.SWAP: one mma per tile, half the accumulators); else 16-route passes
            for mb in tl.static_range(0, BLOCK_M, 8 if BLOCK_M <= 8 else 16 * MB):
                m0 = j * BLOCK_M + mb
                for t in tl.static_range(NTIERS):
                    if tier == t:
                        _tier_pass(x_ptr, ws[t], z_ptr, lim, m0, local, a0, a1, k_tiles, n_tiles, pid_n, stride_x,
                                   one, tier_field(TIERS, t, 0), tier_field(TIERS, t, 1), CB, MULT, ADD, NT, WARPS,
                                   tier_field(TIERS, t, 2), ASM, BLOCK_M <= 8, XFRAG, MB, HALVES, ATOMIC, PDL)


def default_target_programs(device: torch.device) -> int:
    """The split-K target of a tiered launch: :data:`TARGET_PROGRAMS` on a GPU, 0 (no split) in the CPU
    interpreter, where programs are what costs."""
    return TARGET_PROGRAMS if device.type == "cuda" else 0


def frag_blocks(block_m: int) -> int:
    """The fragment order the tiered launch reads x' in for route blocks of ``block_m``: 2 (8-row B
    fragments: blocks of 8, the swapped mma), 1 (16-row A fragments: multiples of 16), 0 (none: row-major)."""
    return 2 if block_m == 8 else 1 if block_m % 16 == 0 else 0


def pass_row_blocks(block_m: int) -> int:
    """16-row blocks per pass of the tiered launch for route blocks of ``block_m``: as many as divide the
    block, up to 4 (a route block of 64 decodes each tile once, not four times; the dense kernel's
    33–64-row configuration); 1 below 32."""
    return next(m for m in (4, 2, 1) if block_m % (16 * m) == 0) if block_m >= 32 else 1


def _check_stacks(name: str, tier_trellis: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(k-tiles, n-tiles) of a list of tier stacks, checked: 1..MAX_TIERS contiguous stacks of one geometry."""
    if not 1 <= len(tier_trellis) <= MAX_TIERS:
        raise ValueError(f"{name}: {len(tier_trellis)} tiers; 1 to {MAX_TIERS} are supported")
    k_tiles, n_tiles = int(tier_trellis[0].shape[1]), int(tier_trellis[0].shape[2])
    for t, tr in enumerate(tier_trellis):
        if tr.dim() != 4 or tuple(tr.shape[1:3]) != (k_tiles, n_tiles) or not tr.is_contiguous():
            raise ValueError(f"{name}: tier {t} trellis {tuple(tr.shape)} is not a contiguous "
                             f"[experts, {k_tiles}, {n_tiles}, 16K] stack")
    return k_tiles, n_tiles


def tier_words(name: str, tier_trellis: Sequence[torch.Tensor], second: Optional[Sequence[torch.Tensor]]
                ) -> tuple[int, int, list[torch.Tensor], list[torch.Tensor]]:
    """(k-tiles, n-tiles, words, second words) of a tiered launch: the checked stacks of the first projection
    and of ``second`` (same tier shapes; the first's when None) as int32 views, each list padded to
    :data:`MAX_TIERS` with the first stack (the kernel never reads the padding tiers)."""
    k_tiles, n_tiles = _check_stacks(name, tier_trellis)
    if second is not None:
        _check_stacks(name, second)
        if [tuple(a.shape) for a in second] != [tuple(a.shape) for a in tier_trellis]:
            raise ValueError(f"{name}: the second projection's tiers do not match the first's")
    ws = [tr.view(torch.int32) for tr in tier_trellis]
    ws += [ws[0]] * (MAX_TIERS - len(ws))
    vs = ws if second is None else [tr.view(torch.int32) for tr in second] + [ws[0]] * (MAX_TIERS - len(second))
    return k_tiles, n_tiles, ws, vs


def tiered_partials(xs: torch.Tensor, tier_trellis: Sequence[torch.Tensor], block_experts: torch.Tensor,
                    num_padded: torch.Tensor, descriptors: torch.Tensor, shift: int, block_m: int, codebook: str,
                    *, second: Optional[Sequence[torch.Tensor]] = None, nt: Optional[int] = None, num_warps: int = 1,
                    target_programs: Optional[int] = None, zero: bool = True, xfrag: bool = False,
                    routes: Optional[tuple[torch.Tensor, int]] = None, atomic: bool = False,
                    acc: Optional[torch.Tensor] = None, pdl: bool = False, alloc: Optional[Callable] = None
                    ) -> torch.Tensor:
    """One tiered launch; returns the split-K partials ``z [P, splits, slots, out_p]`` (fp32) of
    ``xs[slot]·Q_{e(slot)}``. ``P = 1``, or 2 with ``second`` (a second projection of the same geometry
    and tier order, e.g. up next to gate, in the same launch): ``xs`` is then ``[slots, in_p]`` (both read
    it) or ``[2, slots, in_p]`` (one input per projection). ``zero=False``: ``torch.empty`` partials —
    the rows of slots past ``num_padded`` are then left unwritten (garbage), every other element is
    written — except with ``routes = (sorted_routes, numel)`` (:class:`RoutePack`): then each block's padding
    slots (routes ``>= numel``) are not computed either (their rows are left unwritten), and 16-row blocks of
    padding only inside a 32/64-route block run no mma. K is split so that about ``target_programs``
    programs run (default :data:`TARGET_PROGRAMS` on a GPU, each split at least about
    :data:`MIN_SPLIT_K_TILES` k-tiles, :data:`MIN_SPLIT_K_TILES_ATOMIC` with ``atomic``; no split in the CPU
    interpreter, where programs are what costs).
    ``xfrag``: ``xs`` is in the mma's fragment
    order (:func:`frag_blocks`; route blocks of 8 or a multiple of 16), not row-major. Route blocks of 32/64
    run passes in which 2/4 16-row blocks share each decoded tile (:func:`pass_row_blocks`). ``atomic``: the K
    splits add into one buffer, ``z [P, 1, slots, out_p]`` (``red.add``; with ``zero=False`` the caller zeroes
    the rows it will read before the launch; ``acc``: that buffer, given). ``pdl``: a programmatic dependent
    launch where the device has it (:func:`~exl3rt.kernels.common.use_pdl`): the launch before it must be a
    pass that waited for the packer before letting this one start (the fused passes of :func:`exl3_moe`).
    ``alloc(shape, dtype=, device=)`` makes ``torch.empty``-like partials (a launch plan's recording notes them)."""
    name = "grouped_gemv"
    nproj = 1 if second is None else 2
    in_p = xs.shape[-1]
    slots = xs.shape[-2]
    k_tiles, n_tiles, ws, vs = tier_words(name, tier_trellis, second)
    if in_p != k_tiles * 16:
        raise ValueError(f"{name}: xs has {in_p} columns, the trellis {k_tiles * 16} rows")
    if xs.stride(-1) != 1 or xs.stride(-2) != in_p:
        raise ValueError(f"{name}: xs must be row-contiguous")
    frag = frag_blocks(block_m) if xfrag else 0
    if xfrag and not frag:
        raise ValueError(f"{name}: fragment-order x' needs route blocks of 8 or a multiple of 16, not {block_m}")
    stride_xp = xs.stride(0) if xs.dim() == 3 and xs.shape[0] > 1 else 0
    ntw = (DEFAULT_NT if nt is None else nt) * num_warps
    while n_tiles % ntw:
        ntw //= 2
    warps = min(num_warps, ntw)
    if target_programs is None:
        target_programs = default_target_programs(xs.device)
    n_blocks, max_blocks = n_tiles // ntw, int(block_experts.shape[0])
    tier_bits = [bits_from_trellis(tr[0]) for tr in tier_trellis]
    splits, k_per = gemv_splits(k_tiles, nproj * n_blocks * max_blocks, target_programs,
                                k_multiple=max(_mm.default_unroll(b) for b in tier_bits),
                                min_k=MIN_SPLIT_K_TILES_ATOMIC if atomic else MIN_SPLIT_K_TILES)
    make = torch.zeros if zero else (alloc or torch.empty)
    shape = (nproj, 1 if atomic else splits, slots, n_tiles * 16)
    if acc is not None:
        if not atomic or tuple(acc.shape) != shape or acc.dtype != torch.float32 or not acc.is_contiguous():
            raise ValueError(f"{name}: acc must be a contiguous fp32 {list(shape)} tensor, with atomic=True")
        z = acc
    else:
        z = make(shape, dtype=torch.float32, device=xs.device)
    cb, mult, add = cb_args(codebook)
    grid = (nproj * n_blocks, max_blocks, splits)
    stride_x = (4 if frag == 2 else 8) * in_p if frag else in_p    # int32 per row block of 8 / 16 rows, or fp16 per row
    real = routes is not None
    routes_t, numel = routes if real else (block_experts, 0)
    launch(_moe_mma_kernel, grid, xs, z, block_experts, descriptors, num_padded, routes_t, numel, *ws, *vs, slots,
           k_tiles, n_tiles, k_per, stride_x, 0 if atomic else z.stride(1), 1, n_blocks, stride_xp, z.stride(0),
           SHIFT=shift, ATOMIC=atomic,
           TIERS=tier_spec(tier_bits),
           CB=cb, MULT=mult, ADD=add, NT=ntw // warps, WARPS=warps, BLOCK_M=block_m,
           ASM=use_asm(xs.device), NPROJ=nproj, XFRAG=bool(frag), MB=pass_row_blocks(block_m),
           REAL=real, HALVES=use_halves(xs.device, cb), num_warps=warps,
           **(pdl_args(xs.device) if pdl else {}))
    return z


def grouped_gemv(xs: torch.Tensor, tier_trellis: Sequence[torch.Tensor], block_experts: torch.Tensor,
                 num_padded: torch.Tensor, descriptors: torch.Tensor, shift: int, block_m: int, codebook: str,
                 *, nt: Optional[int] = None, num_warps: int = 1, target_programs: Optional[int] = None) -> torch.Tensor:
    """``z[slot] = xs[slot]·Q_{e(slot)}`` (fp32 ``[slots, out_p]``) for fp16 ``xs [slots, in_p]``, every
    tier in one launch. ``tier_trellis[t]``: the tier's experts stacked ``[n_t, in_p/16, out_p/16, 16K_t]``
    (int16, contiguous, local order); ``block_experts`` / ``num_padded`` from :class:`RoutePack`.
    K is split so that about ``target_programs`` programs run (partials summed in fp32 at the end;
    default 2112 on a GPU, no split in the CPU interpreter, where programs are what costs)."""
    z = tiered_partials(xs, tier_trellis, block_experts, num_padded, descriptors, shift, block_m, codebook,
                        nt=nt, num_warps=num_warps, target_programs=target_programs)[0]
    return z[0] if z.shape[0] == 1 else z.sum(0)


@dataclasses.dataclass
class MoEWeights:
    """One layer's experts for :func:`exl3_moe`, in tier order.

    ``gate``/``up``/``down``: per tier, the tier's experts' trellis stacked ``[n_t, …]`` (``gate`` None
    for ungated experts); rotation tables in combined order (``[E, n]``; a broadcast table ``[1, n]``
    is used for every expert); ``descriptors [E]`` int32 and ``shift`` from the
    :class:`~exl3rt.moe.tiers.TierLayout`; ``expert_map [E_router]`` global → combined.
    """

    up: list[torch.Tensor]
    down: list[torch.Tensor]
    gate: Optional[list[torch.Tensor]]
    up_suh: torch.Tensor
    up_svh: torch.Tensor
    down_suh: torch.Tensor
    down_svh: torch.Tensor
    gate_suh: Optional[torch.Tensor]
    gate_svh: Optional[torch.Tensor]
    descriptors: torch.Tensor
    shift: int
    expert_map: torch.Tensor
    codebook: str
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu
    #: launch plans of :func:`planned_moe` (per call shape), kept with the weights they hold addresses of
    plans: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_experts(self) -> int:
        return int(self.descriptors.shape[0])

    @classmethod
    def from_experts(cls, layout, experts: Sequence[dict], *, codebook: Optional[str] = None,
                     act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> "MoEWeights":
        """``experts[g]`` (global order) maps ``gate_proj``/``up_proj``/``down_proj`` to objects with
        ``trellis``, ``suh``, ``svh`` (and ``codebook``), e.g. :class:`~exl3rt.format.EncodedLinear`
        or :class:`~exl3rt.runtime.linear.Exl3Linear`; ``layout`` the layer's ``TierLayout``."""
        gated = "gate_proj" in experts[0]
        cbs = {getattr(p, "codebook", codebook) for ex in experts for p in ex.values()}
        cbs.discard(None)
        if codebook is None:
            if len(cbs) != 1:
                raise ValueError(f"{layout.layer}: experts use codebooks {sorted(cbs)}; one per layer is supported")
            codebook = cbs.pop()
        order = list(layout.combined_to_global)

        def stacks(proj: str) -> list[torch.Tensor]:
            return [torch.stack([experts[g][proj].trellis for g in tier.expert_ids]).contiguous()
                    for tier in layout.tiers]

        def table(proj: str, field: str) -> torch.Tensor:
            return torch.stack([getattr(experts[g][proj], field) for g in order]).float()

        dev = experts[0]["up_proj"].trellis.device
        up_suh = table("up_proj", "suh")
        gate_suh = table("gate_proj", "suh") if gated else None
        if gate_suh is not None and torch.equal(gate_suh, up_suh):
            gate_suh = up_suh       # one input rotation serves gate and up (checked once, at bind time)
        return cls(up=stacks("up_proj"), down=stacks("down_proj"), gate=stacks("gate_proj") if gated else None,
                   up_suh=up_suh, up_svh=table("up_proj", "svh"),
                   down_suh=table("down_proj", "suh"), down_svh=table("down_proj", "svh"),
                   gate_suh=gate_suh,
                   gate_svh=table("gate_proj", "svh") if gated else None,
                   descriptors=layout.descriptor_tensor(dev).to(torch.int32), shift=layout.descriptor_shift,
                   expert_map=layout.global_to_combined_tensor(dev), codebook=codebook, act=act)


def _rows(table: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Per-slot rows of a scale table (``[1, n]`` broadcast, or ``[E, n]`` indexed by the slot's expert)."""
    return table.expand(e.shape[0], -1) if table.shape[0] == 1 else table[e]


def fused_glue_supported(w: MoEWeights) -> bool:
    """The fused passes (:mod:`exl3rt.kernels.moe_glue`) compute ``w`` exactly: activation ``F.silu``."""
    return w.act is F.silu


def _row_stride(table: torch.Tensor) -> int:
    """Row stride of a scale table for the passes: 0 for a broadcast ``[1, n]`` table."""
    return 0 if table.shape[0] == 1 else int(table.stride(0))


#: routes up to which the fused path packs them with one Triton program (:func:`pack_routes_fused`); more
#: (prefill) go through the torch packer, whose ~40 small launches are then amortized over many tokens
PACK_MAX_ROUTES = 16384     # 2048 tokens at top-8: a prefill packs in one launch and can be planned
PACK_MAX_EXPERTS = 1024
# the packer's sort widths (routes rounded up to one of these) and the warps that sort each: few widths, so a
# row-bucket prewarm meets every one wherever it occurs. The widest sorts 16k keys in one program: ~0.4 ms on
# an H200 at 8 warps (16: 0.45, 32: 0.51), against ~0.9 ms for the torch packer's launches and its host work
PACK_WIDTHS = ((64, 4), (1024, 4), (PACK_MAX_ROUTES, 8))
# where the kernels run in Triton's interpreter (CPU tensors) a 16k-key sort takes ~90 s: the torch packer
# takes calls past this many routes there
PACK_INTERPRETED_MAX_ROUTES = 1024


def pack_max_routes(device: torch.device) -> int:
    """The most routes one packer launch takes on ``device`` (more: the torch packer, and the call is not
    planned)."""
    return PACK_MAX_ROUTES if device.type == "cuda" else PACK_INTERPRETED_MAX_ROUTES


def pack_routes_fused(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor,
                      *, pdl: bool = False, alloc: Optional[Callable] = None) -> RoutePack:
    """:func:`~exl3rt.kernels.routing.pack_routes` (same outputs, bit for bit) as one Triton launch when
    ``T·k <= PACK_MAX_ROUTES`` and ``E <= PACK_MAX_EXPERTS``, else the torch packer. Fresh buffers
    (``torch.empty``: the kernel writes every element). ``pdl``: a programmatic dependent launch where the
    device has it (it lets the next launch start at once, then waits for the previous one). ``alloc(shape,
    dtype=, device=)`` makes the buffers."""
    from .moe_glue import moe_pack_kernel
    alloc = alloc or torch.empty        # looked up per call (tests put a stand-in in torch.empty)
    numel, E = int(topk_ids.numel()), int(num_experts)
    if (topk_ids.dtype not in ID_DTYPES or topk_ids.dim() != 2 or not 0 < numel <= pack_max_routes(topk_ids.device)
            or E > PACK_MAX_EXPERTS):
        return pack_routes(topk_ids, E, block_m, expert_map=expert_map)
    dev = topk_ids.device
    cap = route_capacity(numel, E, block_m)
    pack = RoutePack(sorted_routes=alloc((cap,), dtype=torch.int32, device=dev),
                     block_experts=alloc((cap // block_m,), dtype=torch.int32, device=dev),
                     num_padded=alloc((1,), dtype=torch.int32, device=dev),
                     expert_counts=alloc((E,), dtype=torch.int32, device=dev),
                     max_numel=numel, num_experts=E, block_m=int(block_m))
    np_, warps = next(w for w in PACK_WIDTHS if numel <= w[0])
    scratch = alloc((np_,), dtype=torch.int32, device=dev)
    emap = expert_map if expert_map.is_contiguous() else expert_map.contiguous()
    launch(moe_pack_kernel, (1,), topk_ids.reshape(-1), emap, pack.sorted_routes, pack.block_experts,
           pack.num_padded, pack.expert_counts, scratch, numel, int(emap.shape[0]), E, cap, pack.max_blocks,
           NP=np_, EP=next_pow2(E), FB=256, BLOCK_M=int(block_m), num_warps=warps, **(pdl_args(dev) if pdl else {}))
    return pack


@dataclasses.dataclass(frozen=True)
class GlueLaunch:
    """Launch shapes of the fused passes (:mod:`exl3rt.kernels.moe_glue`): rows (slots) per program and
    warps of the pre- and mid-pass, split-K partials per load of the mid- and post-pass, warps of the post
    pass (0: by top-k) and whether x'/h' are written in the tiered launch's fragment order (where the route
    block allows it, :func:`frag_blocks`); ``skip_padding``: the tiered launches count each route block's live
    routes and leave its padding slots out (no x' loads, no stores, no mma for 16-row blocks of padding only);
    ``wgmma``: route blocks of 32/64/128 run on the Hopper wgmma tiered launch where it is available
    (:mod:`exl3rt.kernels.moe_wgmma`; x'/h' then row-major, ``frag`` and ``skip_padding`` do not apply);
    ``atomic``: with route blocks of 8 (the decode plan) the tiered launches add their K splits into one buffer
    whose live rows the pass before zeroes (pre: gate/up, mid: down), and mid/post read one split
    (``EXL3RT_KERNEL_DETERMINISTIC=1`` turns it off); ``pdl_max_rows``: calls of at most this many rows (0: none;
    else a power of two, so that the choice follows the plan's row buckets, which prewarm covers) make the six
    launches programmatic dependent launches where the device has them (not with the wgmma tiered launch;
    ``EXL3RT_KERNEL_NO_PDL=1`` turns it off): each pass waits for the launch before it at its start, the pre- and
    mid-pass let the next launch start once they have waited, and the tiered launches read their block's expert
    and first trellis words before waiting.
    :func:`default_glue` gives the measured defaults; a tuning override of :func:`exl3_moe`."""

    pre_rows: int = 4
    pre_warps: int = 1
    mid_rows: int = 2
    mid_warps: int = 1
    mid_splits: int = 8
    post_splits: int = 8
    post_warps: int = 1
    frag: bool = False
    skip_padding: bool = True
    wgmma: bool = True
    atomic: bool = True
    pdl_max_rows: int = 0

    def __post_init__(self):
        n = self.pdl_max_rows
        if n < 0 or n & (n - 1):
            raise ValueError(f"GlueLaunch: pdl_max_rows must be 0 or a power of two (a row bucket's end), got {n}")


def default_glue(block_m: int) -> GlueLaunch:
    """The passes' launch shapes for route blocks of ``block_m`` (a function of the plan, never of T: one
    specialization per plan, so a prewarm at any row count covers every T). One-warp programs throughout;
    8-row blocks (the decode plan): one slot per mid program reading up to 16 partials at once. x'/h' in
    fragment order for 8-row blocks and for blocks whose passes share a decoded tile between 16-row blocks
    (:func:`pass_row_blocks` > 1), row-major for 16; the 8-row blocks' post-pass reads one split per load with 2
    warps; programmatic dependent launch up to ``pdl_max_rows`` (the measurements: docs/moe.md, "Tuned
    constants")."""
    if block_m <= 8:
        return GlueLaunch(mid_rows=1, mid_splits=16, frag=True, post_splits=1, post_warps=2, pdl_max_rows=4)
    return GlueLaunch(frag=pass_row_blocks(block_m) > 1)


def _fused(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: MoEWeights, block_m: int,
           nt: Optional[int], num_warps: int, out: Optional[torch.Tensor], target_programs: Optional[int],
           glue: GlueLaunch, alloc: Optional[Callable] = None) -> torch.Tensor:
    """Six Triton launches: pack (one program; the torch packer past PACK_MAX_ROUTES), pre, gate+up, mid,
    down, post (kernels/moe_glue.py)."""
    from .moe_glue import moe_mid_kernel, moe_post_kernel, moe_pre_kernel
    alloc = alloc or torch.empty
    T, H = x.shape
    k = int(topk_ids.shape[1])
    numel = T * k
    dev = x.device
    use_wg = glue.wgmma and _mwg.applies(dev, block_m)
    pdl = T <= glue.pdl_max_rows and not use_wg and use_pdl(dev)
    pd = pdl_args(dev) if pdl else {}
    pack = pack_routes_fused(topk_ids, w.num_experts, block_m, w.expert_map, pdl=pdl, alloc=alloc)
    slots = pack.capacity
    I = int(w.up[0].shape[2]) * 16
    if H % 128 or I % 128:
        raise ValueError(f"exl3_moe: hidden {H} and intermediate {I} must be multiples of 128")
    if x.stride(-1) != 1:
        x = x.contiguous()
    gated = w.gate is not None
    two = gated and w.gate_suh is not w.up_suh
    up_suh = w.up_suh.contiguous()
    gate_suh = w.gate_suh.contiguous() if two else up_suh
    xs = alloc((2 if two else 1, slots, H), dtype=torch.float16, device=dev)
    pos = alloc((max(numel, 1),), dtype=torch.int32, device=dev)
    frag = frag_blocks(block_m) if glue.frag and not use_wg else 0
    # 8-route blocks: the K splits add into one buffer per launch, whose live rows the pass before zeroes
    atomic = glue.atomic and block_m <= 8 and not use_wg and not env.KERNEL_DETERMINISTIC.get()
    nproj = 2 if gated else 1
    zgu = alloc((nproj, 1, slots, I), dtype=torch.float32, device=dev) if atomic else None
    zz = {"zz_ptr": zgu, "zz_n": I, "zz_pstride": slots * I, "ZNP": nproj} if atomic else {}
    # row blocks and split loads are fixed (never a function of T): one specialization per layer geometry,
    # so a prewarm at any row count covers every T
    br = glue.pre_rows
    launch(
        moe_pre_kernel, (triton.cdiv(slots, br), H // 128),
        x, pack.sorted_routes, pack.block_experts, pack.num_padded, up_suh, gate_suh, xs, pos, slots, numel, k, H,
        x.stride(0), _row_stride(up_suh), _row_stride(gate_suh), slots * H, int(two),
        BR=br, BLOCK_M=block_m, FRAG=frag, num_warps=glue.pre_warps, **zz, **pd)

    common = (pack.block_experts, pack.num_padded, w.descriptors, w.shift, block_m, w.codebook)
    opts = dict(nt=nt, num_warps=num_warps, target_programs=target_programs, zero=False, xfrag=frag > 0,
                routes=(pack.sorted_routes, numel) if glue.skip_padding else None, atomic=atomic, pdl=pdl)

    def tiered(xin: torch.Tensor, tiers: list[torch.Tensor], second: Optional[list[torch.Tensor]] = None,
               acc: Optional[torch.Tensor] = None):
        if use_wg:
            return _mwg.tiered_partials_wgmma(xin, tiers, *common, second=second, alloc=alloc)
        return tiered_partials(xin, tiers, *common, second=second, acc=acc, alloc=alloc, **opts)

    if gated:   # gate and up in one launch: partials zgu[0] gate, zgu[1] up
        zgu = tiered(xs if two else xs[0], w.gate, w.up, acc=zgu)
    else:
        zgu = tiered(xs[0], w.up, acc=zgu)
    splits = int(zgu.shape[1])
    up_svh = w.up_svh.contiguous()
    gate_svh = w.gate_svh.contiguous() if gated else up_svh
    down_suh = w.down_suh.contiguous()
    hs = alloc((slots, I), dtype=torch.float16, device=dev)
    zd = alloc((1, 1, slots, H), dtype=torch.float32, device=dev) if atomic else None
    brm = glue.mid_rows
    launch(
        moe_mid_kernel, (triton.cdiv(slots, brm), I // 128),
        zgu, pack.sorted_routes, pack.block_experts, pack.num_padded, gate_svh, up_svh, down_suh, hs, slots, numel, I,
        splits, zgu.stride(1), zgu.stride(0), _row_stride(gate_svh), _row_stride(up_svh), _row_stride(down_suh),
        GATED=gated, BR=brm, SB=1 if atomic else glue.mid_splits, BLOCK_M=block_m, FRAG=frag,
        num_warps=glue.mid_warps, **({"zz_ptr": zd, "zz_n": H, "ZERO_D": True} if atomic else {}), **pd)

    zd = tiered(hs, w.down, acc=zd)[0]
    splits = int(zd.shape[0])
    down_svh = w.down_svh.contiguous()
    wts = topk_weights.reshape(-1)
    if wts.stride(0) != 1:
        wts = wts.contiguous()
    direct = out is not None and out.is_contiguous() and out.dtype == x.dtype and tuple(out.shape) == (T, H)
    y = out if direct else torch.empty((T, H), dtype=x.dtype, device=dev)
    kp = next_pow2(k)
    wp = glue.post_warps or (1 if kp <= 2 else 4)
    sbp = glue.post_splits
    launch(
        moe_post_kernel, (T, H // 128),
        zd, pack.sorted_routes, pos, pack.block_experts, wts, down_svh, y, numel, k, H, splits, zd.stride(0),
        _row_stride(down_svh), slots, KP=kp, SB=sbp, BLOCK_M=block_m, num_warps=wp, **pd)
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y


def exl3_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: MoEWeights, *,
             block_m: int = 16, nt: Optional[int] = None, num_warps: int = 1, fused: bool = True,
             out: Optional[torch.Tensor] = None, target_programs: Optional[int] = None,
             glue: Optional[GlueLaunch] = None, alloc: Optional[Callable] = None) -> torch.Tensor:
    """``y[t] = Σ_s topk_weights[t, s] · expert_{topk_ids[t, s]}(x[t])`` (see the module docstring).

    ``fused=True`` (default): six Triton launches — route packing in one program (the torch packer past
    ``PACK_MAX_ROUTES`` routes), pre-pass, gate+up, mid-pass, down, post-pass (:mod:`exl3rt.kernels.moe_glue`)
    — where :func:`fused_glue_supported` (activation ``F.silu``), else — and with ``fused=False`` — the
    torch glue around three tiered launches (the reference the fused passes are tested against). Both are
    CUDA-graph capturable. ``out`` (``[T, H]``, x's dtype): written and returned. ``target_programs``
    (split-K of the tiered launches) and ``glue`` (:class:`GlueLaunch`, the fused passes; default
    :func:`default_glue`): tuning overrides. ``alloc(shape, dtype=, device=)``: makes the fused path's scratch
    buffers (``torch.empty``; :func:`planned_moe` notes them).
    """
    if x.shape[0] == 0:
        y = x.new_zeros(x.shape)
        return out.copy_(y) if out is not None else y
    if fused and fused_glue_supported(w):
        return _fused(x, topk_ids, topk_weights, w, block_m, nt, num_warps, out, target_programs,
                      glue or default_glue(block_m), alloc)
    y = _unfused(x, topk_ids, topk_weights, w, block_m, nt, num_warps)
    if out is not None:
        out.copy_(y)
        return out
    return y


#: launches of one fused call whose routes the one-program packer takes (pack, pre, gate+up, mid, down, post)
FUSED_LAUNCHES = 6


@dataclasses.dataclass
class MoEPlan:
    """One layer's fused call at one call shape: the plan generation it was made in, the scratch buffers
    (shapes, dtypes, offsets in a workspace) and the recorded launches (None: the call runs in full)."""
    epoch: int
    scratch: tuple
    nbytes: int
    replay: Optional[Replay]
    views: tuple = (None, ())


def _aligned(*ts: Optional[torch.Tensor]) -> bool:
    """Contiguous and 16-byte aligned: what the recorded kernels were specialized on for a slot tensor."""
    return all(t is None or (t.is_contiguous() and not t.data_ptr() & 15) for t in ts)


def planned_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: MoEWeights, *,
                block_m: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`exl3_moe` with the default launch settings, planned: the first call with these weights at a call
    shape (tokens, top-k, dtypes, route block, device) runs in full and records its six launches; later calls
    replay them through the compiled kernels' launchers (no argument binding), with the scratch buffers taken
    from the stream's workspace where :func:`~exl3rt.kernels.linear.prewarm` reserved one big enough (else, and
    while a CUDA graph is captured, allocated). Plans live in ``w.plans`` (the addresses they hold are the
    weights'); ``exl3rt.kernels.reset_plans`` makes them stale. Calls the packer cannot take in one program,
    other activations and inputs that are not contiguous and 16-byte aligned run in full."""
    dev = x.get_device()
    if dev >= 0 and torch._C._cuda_getDevice() != dev:      # Triton launches on the current device
        with torch.cuda.device(dev):
            return planned_moe(x, topk_ids, topk_weights, w, block_m=block_m, out=out)
    if out is not None and (out.dtype != x.dtype or tuple(out.shape) != tuple(x.shape)):
        return exl3_moe(x, topk_ids, topk_weights, w, block_m=block_m, out=out)
    key = (tuple(x.shape), x.dtype, tuple(topk_ids.shape), topk_ids.dtype, topk_weights.dtype, int(block_m), dev,
           out is None)
    plan = w.plans.get(key)
    if plan is not None and plan.epoch == plans_epoch():
        if plan.replay is None or not _aligned(x, topk_ids, topk_weights, out):
            return exl3_moe(x, topk_ids, topk_weights, w, block_m=block_m, out=out)
        y = out if out is not None else torch.empty_like(x)
        stream = current_stream(dev)
        run_plan(plan, stream, (x, topk_ids, topk_weights, y), stream_workspace(dev, stream), x.device)
        return y
    return _plan_moe(key, x, topk_ids, topk_weights, w, block_m, out)


def _plannable(x, topk_ids, topk_weights, w: MoEWeights, out) -> bool:
    """A fused call whose every tensor is a slot (inputs, output, scratch) or one of the weights' own, unchanged
    between calls: the one-program packer, SiLU, no copy made of a weight table or of an input."""
    numel = int(topk_ids.numel())
    tables = (w.up_suh, w.up_svh, w.down_suh, w.down_svh, w.gate_suh, w.gate_svh, w.expert_map)
    return (fused_glue_supported(w) and x.shape[0] > 0 and topk_ids.dim() == 2 and topk_ids.dtype in ID_DTYPES
            and 0 < numel <= pack_max_routes(topk_ids.device) and w.num_experts <= PACK_MAX_EXPERTS
            and _aligned(x, topk_ids, topk_weights, out) and all(t is None or t.is_contiguous() for t in tables)
            and direct_launch_ok())


def _plan_moe(key: tuple, x, topk_ids, topk_weights, w: MoEWeights, block_m: int, out) -> torch.Tensor:
    if not _plannable(x, topk_ids, topk_weights, w, out):
        w.plans[key] = MoEPlan(plans_epoch(), (), 0, None)
        return exl3_moe(x, topk_ids, topk_weights, w, block_m=block_m, out=out)
    specs, allocated = [], []

    def alloc(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        specs.append((tuple(shape), dtype))
        allocated.append(t)
        return t

    y = out if out is not None else torch.empty_like(x)
    with Recording() as rec:
        exl3_moe(x, topk_ids, topk_weights, w, block_m=block_m, out=y, alloc=alloc)
    direct = x.device.type == "cuda" and not interpreting()
    replay = None
    if len(rec.calls) == FUSED_LAUNCHES and not (direct and any(call[-1] is None for call in rec.calls)):
        try:
            replay = Replay(rec, [x, topk_ids, topk_weights, y, *allocated], direct=direct)
        except ValueError:  # an argument a replay cannot take: this call shape runs in full
            pass
    layout, nbytes = scratch_layout(specs)
    w.plans[key] = MoEPlan(plans_epoch(), layout, nbytes, replay)
    return y


def _unfused(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: MoEWeights,
             block_m: int, nt: Optional[int], num_warps: int) -> torch.Tensor:
    """The torch glue: gather, rotations, activation and weighted sum as torch ops, three tiered launches."""
    T, H = x.shape
    k = topk_ids.shape[1]
    numel = T * k
    pack = pack_routes(topk_ids, w.num_experts, block_m, expert_map=w.expert_map)
    slots = pack.capacity
    r = pack.sorted_routes.to(torch.int64)
    live = r < numel
    tok = torch.where(live, r // k, T)                       # padding slots read a zero row
    blk = pack.block_experts.to(torch.int64)
    e = torch.zeros(slots, dtype=torch.int64, device=x.device)  # the slot's combined expert
    e[:blk.shape[0] * block_m] = blk.clamp(min=0).repeat_interleave(block_m)
    xpad = torch.cat([x.float(), x.new_zeros(1, H, dtype=torch.float32)])[tok]

    def rotate_in(v: torch.Tensor, suh: torch.Tensor) -> torch.Tensor:
        return hadamard_blocks(v * _rows(suh, e)).half().contiguous()

    def tiered(v16: torch.Tensor, tiers: list[torch.Tensor]) -> torch.Tensor:
        return grouped_gemv(v16, tiers, pack.block_experts, pack.num_padded, w.descriptors, w.shift, block_m,
                            w.codebook, nt=nt, num_warps=num_warps)

    xu = rotate_in(xpad, w.up_suh)
    u = hadamard_blocks(tiered(xu, w.up)) * _rows(w.up_svh, e)
    if w.gate is not None:
        xg = xu if w.gate_suh is w.up_suh else rotate_in(xpad, w.gate_suh)
        g = hadamard_blocks(tiered(xg, w.gate)) * _rows(w.gate_svh, e)
        h = w.act(g) * u
    else:
        h = w.act(u)
    hd = rotate_in(h, w.down_suh)
    yd = hadamard_blocks(tiered(hd, w.down)) * _rows(w.down_svh, e)
    wt = torch.where(live, topk_weights.reshape(-1).float()[r.clamp(max=numel - 1)], 0.0)
    y = torch.zeros(T + 1, H, dtype=torch.float32, device=x.device)
    y.index_add_(0, tok, yd * wt[:, None])
    return y[:T].to(x.dtype)


__all__ = ["GlueLaunch", "MoEPlan", "MoEWeights", "default_glue", "exl3_moe", "planned_moe", "frag_blocks",
           "fused_glue_supported", "grouped_gemv", "pack_routes_fused", "tiered_partials", "FUSED_LAUNCHES",
           "MAX_TIERS", "PACK_MAX_ROUTES", "pack_max_routes"]
