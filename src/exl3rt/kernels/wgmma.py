"""Decode-on-the-fly EXL3 GEMM with Hopper warpgroup MMA (Gluon): 17–512 rows on sm_90, 9–512 at K other than
1, 2 and 4 (``linear.choose_path`` sends 257–416 rows to decode + cuBLAS).

Split-K partials ``z[split, m, n] = Σ_{k in split} x'[m, k]·Q[k, n]`` like :mod:`exl3rt.kernels.mma`, but with
``wgmma`` and the roles of the operands swapped: one program is one warpgroup (4 warps) and computes
``zᵀ[64 columns, BR rows] = Qᵀ[64, K] · x'ᵀ[K, BR]``:

* the **A operand is the decoded weight tile, in registers**. The EXL3 tile order is the ``mma.m16n8k16``
  fragment order (``format/tiles.py``), and a lane's decoded registers p01, p45, p23, p67 (the lane decode
  of :mod:`exl3rt.kernels.lane_decode`, one inline-PTX block per tile) are exactly its fragment of the
  transposed 16×16 tile as an A operand — which is also the register layout ``wgmma`` takes for A
  (warp w holds rows 16w…16w + 15). Warp w decodes n-tile ``4·pid_n + w``; four k-tiles (64 columns of
  x') make one ``warpgroup_mma`` of K = 64 (four ``HGMMA.64xBRx16``). The decoded registers become the
  ``[64, 64]`` fp16 A tensor by joins, a reshape and a permute that Gluon proves are no data movement
  (``convert_layout(..., assert_trivial=True)``: the build fails otherwise);
* the **B operand is x'ᵀ in shared memory**: TMA copies ``[BR, 64]`` boxes of the row-major fp16 x' (rows
  past the end read as zeros) into a ring of ``STAGES`` buffers, one mbarrier each; the wgmma reads the
  box through a transposed view.

Each chunk of 4 k-tiles: load the next chunk's trellis words (NWL 32-bit loads per lane and tile), decode,
wait for the x' box, ``wgmma``, refill the box's buffer. Two chunk loops: up to 128 rows per program the
``wgmma`` is waited for before the next decode; with 256 rows per program (``WgmmaConfig.overlap``) one
wgmma group stays in flight and the next chunk is decoded under it — the even and odd chunks' A operands
are two variables (the loop is unrolled by two), so the decode never writes the registers of the wgmma in
flight (one variable carried around the loop did exactly that: to LLVM the A value is dead after the wgmma
instruction, so the next decode got its registers; the sm_90 build test checks the SASS for such writes).
The accumulators (``[64, BR]`` fp32, BR/2 registers per thread) are stored transposed into the partials;
the post-pass (:func:`exl3rt.kernels.hadamard.had`) sums the splits and rotates, as for the mma GEMV.

Two programs share a multiprocessor (~215 registers at BR = 256 with 3 stages, 96 KB of shared memory each).
Measured on the H200 (BENCHMARKS.md) against decode + cuBLAS.

Only on CUDA devices of compute capability 9.0 (``wgmma`` is sm_90a) with Triton's Gluon (checked at
import: ``HAVE_GLUON``; the kernel builds with Triton 3.6 and 3.9, whose TMA copy changed name); no
interpreter: CI checks the host side (configurations, dispatch) and builds the kernel for sm_90, the GPU
tests check the numbers (``tests/test_wgmma.py``). ``EXL3RT_KERNEL_NO_WGMMA=1`` turns the path off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

import torch

from .. import env
from .launch import launch

KC = 4           # k-tiles per chunk (one wgmma of K = 64; one TMA box of 64 x' columns)
WARPS = 4        # one warpgroup: warp w decodes n-tile 4·pid_n + w (64 output columns per program)

try:  # Gluon (Triton >= 3.4) with Hopper's wgmma, TMA and mbarriers
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except Exception:  # pragma: no cover - no Triton, or a Triton without these names
    HAVE_GLUON = False


@dataclass(frozen=True)
class WgmmaConfig:
    """``block_rows``: rows per program (the wgmma's N: 16, 32, 64, 128 or 256); ``stages``: x' buffers in flight;
    ``target_programs``: column groups × K splits the split aims at (each split at least 2 chunks of K);
    ``overlap``: decode chunk c + 1 while chunk c's wgmma runs (one wgmma group in flight) instead of waiting
    for each chunk's wgmma before decoding the next; ``pdl``: ``exl3_linear`` launches the call's three
    kernels with programmatic dependent launch (where the device and Triton support it); ``pair`` (with the
    waiting loop and ``stages`` >= 2): decode two chunks, then issue both wgmmas and wait once;
    ``atomic_min_splits`` (> 0): from this many K splits on, the splits add into one buffer (:func:`use_atomic`);
    ``stored_target_programs`` (> 0): where the splits at ``target_programs`` stay below that (each split stores
    its own partials), K is split for about this many programs instead."""
    block_rows: int = 256
    stages: int = 3
    target_programs: int = 256
    overlap: bool = False
    pdl: bool = False
    pair: bool = False
    atomic_min_splits: int = 0
    stored_target_programs: int = 0

    def __post_init__(self):
        if self.pair and (self.overlap or self.stages < 2):
            raise ValueError(f"WgmmaConfig: pair=True needs the waiting loop (overlap=False) and stages >= 2 (both "
                             f"chunks' x' boxes in flight), got overlap={self.overlap}, stages={self.stages}")


# The launch configuration per row bucket: the fastest tried on the H200 (docs/kernels.md, "Tuned constants").
# 129+ rows: 256 rows per program, 3 x' buffers, the next step decoded while the current wgmma runs
WGMMA_256 = WgmmaConfig(block_rows=256, stages=3, target_programs=256, overlap=True)
# the same at K other than 4 and 8 (the lane decode's normalizing shift): two chunks per wgmma wait
WGMMA_256_PAIR = WgmmaConfig(block_rows=256, stages=3, target_programs=256, pair=True)
# 65-128 rows: 128 rows per program, ~512 programs
WGMMA_128 = WgmmaConfig(block_rows=128, stages=3, target_programs=512)
# the same paired at K other than 4 and 8
WGMMA_128_PAIR = replace(WGMMA_128, pair=True)
# 33-64 rows: 64 rows per program, 3 buffers paired, ~1024 programs, programmatic dependent launch
WGMMA_64 = WgmmaConfig(block_rows=64, stages=3, target_programs=1024, pdl=True, pair=True)
# the small-row buckets add their K splits into one buffer from this many splits on
ATOMIC_MIN_SPLITS = 12
# 17-32 rows: 32 rows per program, 2 buffers paired, ~1536 programs
WGMMA_32 = WgmmaConfig(block_rows=32, stages=2, target_programs=1536, pdl=True, pair=True,
                       atomic_min_splits=ATOMIC_MIN_SPLITS)
# 9-16 rows (K other than 1, 2, 4): 16 rows per program, 2 buffers paired, ~1536 programs (~896 where the splits
# store partials)
WGMMA_16 = WgmmaConfig(block_rows=16, stages=2, target_programs=1536, pdl=True, pair=True,
                       atomic_min_splits=16, stored_target_programs=896)


def default_wgmma_config(rows: int, bits=4) -> WgmmaConfig:
    """The launch configuration for ``rows`` (one of five row buckets: ≤ 16, ≤ 32, ≤ 64, ≤ 128, more) at K =
    ``bits``: from 65 rows the paired loop where the lane decode has a normalizing shift (every K but 4 and 8),
    else one chunk per wait (65-128 rows) or the overlapped loop (more)."""
    if rows <= 32:
        return WGMMA_16 if rows <= 16 else WGMMA_32
    if rows <= 64:
        return WGMMA_64
    from .lane_decode import needs_shift
    from .common import kernel_bits
    paired = needs_shift(*kernel_bits(bits))
    if rows <= 128:
        return WGMMA_128_PAIR if paired else WGMMA_128
    return WGMMA_256_PAIR if paired else WGMMA_256


def available(device: torch.device) -> bool:
    """The wgmma path can run on ``device``: Gluon is there, the device is a CUDA device of compute capability
    9.0 (wgmma is sm_90a only), inline PTX is allowed and ``EXL3RT_KERNEL_NO_WGMMA`` is not set."""
    if not HAVE_GLUON or device.type != "cuda" or env.KERNEL_NO_WGMMA.get() or env.KERNEL_NO_ASM.get():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) == (9, 0)


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def use_atomic(cfg: WgmmaConfig, splits: int) -> bool:
    """The launch adds its ``splits`` K splits into one buffer (``cfg.atomic_min_splits``)."""
    return 0 < cfg.atomic_min_splits <= splits and not env.KERNEL_DETERMINISTIC.get()


def launch_splits(k_tiles: int, n_tiles: int, cfg: WgmmaConfig) -> tuple[int, int, bool]:
    """(splits, k-tiles per split, atomic) of a launch over a ``k_tiles × n_tiles`` layer under ``cfg``."""
    splits, k_per = wgmma_splits(k_tiles, n_tiles // WARPS, cfg.target_programs)
    atomic = use_atomic(cfg, splits)
    if not atomic and cfg.stored_target_programs > 0:
        splits, k_per = wgmma_splits(k_tiles, n_tiles // WARPS, cfg.stored_target_programs)
    return splits, k_per, atomic


def wgmma_splits(k_tiles: int, programs: int, target: int) -> tuple[int, int]:
    """(splits, k-tiles per split): ``programs·splits`` about ``target`` (rounded down, at least one split),
    every split a whole number of chunks and at least two chunks long."""
    splits = max(1, min(target // max(1, programs), k_tiles // (2 * KC)))
    k_per = math.ceil(k_tiles / splits / KC) * KC
    return math.ceil(k_tiles / k_per), k_per


if HAVE_GLUON:
    _KC = gl.constexpr(KC)          # the module's constants, as Gluon reads them
    _WARPS = gl.constexpr(WARPS)
    # the TMA copy: tma.async_copy_global_to_shared up to Triton 3.6, tma.async_load later (same arguments)
    _tma_copy = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

    @gluon.jit
    def _tma_load(desc, coord, bar, dst, pred):
        _tma_copy(desc, coord, bar, dst, pred=pred)

    @gluon.jit
    def _decode_tile(w0, w1, w2, rsh, xorc, TEXT: gl.constexpr, CONS: gl.constexpr, NWL: gl.constexpr):
        """The lane's four f16x2 registers of one tile (positions 0/1, 2/3, 4/5, 6/7)."""
        if NWL == 2:
            r = gl.inline_asm_elementwise(TEXT, CONS, [w0, w1, rsh, xorc],
                                          dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
        else:
            r = gl.inline_asm_elementwise(TEXT, CONS, [w0, w1, w2, rsh, xorc],
                                          dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
        return r

    @gluon.jit
    def chunk_words(wb, off, kstride, m, idx, NWL: gl.constexpr):
        """The lane's raw words of the chunk's _KC k-tiles (``off``: the chunk's first k-tile, in words)."""
        out = ()
        for kt in gl.static_range(_KC):
            o = off + kt * kstride
            out = out + ((gl.load(wb[0] + o, mask=m, other=0), gl.load(wb[1] + o, mask=m, other=0),
                          gl.load(wb[2] + o, mask=m, other=0) if NWL > 2 else idx),)
        return out

    @gluon.jit
    def _halves(r):
        """An f16x2 register as two fp16 values, joined on a new last dimension (k, k + 1)."""
        lo = (r & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)
        hi = (r >> 16).to(gl.int16).to(gl.float16, bitcast=True)
        return gl.join(lo, hi)

    @gluon.jit
    def _a_operand(wc, rsh, xorc, TEXT: gl.constexpr, CONS: gl.constexpr, NWL: gl.constexpr, DOT: gl.constexpr):
        """Decode the chunk's _KC tiles per warp into the wgmma A operand ``[64, 64]`` fp16 (Qᵀ: 64 columns × 64 k).

        Per tile a lane holds A registers (row g = lane/4, k = 2·(lane%4)): p01 (g, k..k+1), p45 (g + 8, k),
        p23 (g, k + 8), p67 (g + 8, k + 8); joins stack them as register dimensions (kl, rh, kh, kt),
        the reshape splits the thread index into (warp, g, c) and the permute orders the dimensions as
        (warp, rh, g | kt, kh, c, kl) = [rows, k] — the A layout itself (asserted: no data movement)."""
        t = ()
        for kt in gl.static_range(_KC):
            p01, p23, p45, p67 = _decode_tile(wc[kt][0], wc[kt][1], wc[kt][2], rsh, xorc, TEXT, CONS, NWL)
            t = t + (gl.join(gl.join(_halves(p01), _halves(p45)), gl.join(_halves(p23), _halves(p67))),)
        x = gl.join(gl.join(t[0], t[1]), gl.join(t[2], t[3]))        # [128, kl, rh, kh, kt & 1, kt >> 1]
        x = gl.reshape(x, [_WARPS, 8, 4, 2, 2, 2, 2, 2])               # warp, g, c, kl, rh, kh, ktl, kth
        x = gl.permute(x, [0, 4, 1, 7, 6, 5, 2, 3])                   # warp, rh, g, kth, ktl, kh, c, kl
        x = gl.reshape(x, [16 * _WARPS, _KC * 16])
        return gl.convert_layout(x, DOT, assert_trivial=True)

    @gluon.jit
    def _gdc(INSTR: gl.constexpr):
        """A grid dependency control instruction (``griddepcontrol.wait`` / ``.launch_dependents``)."""
        gl.inline_asm_elementwise(INSTR + " // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def refill_x(x_desc, xs, bars, st, m0, kt, more):
        """Buffer ``st`` is free: its next box (x' columns from k-tile ``kt``), if ``more``."""
        mbarrier.expect(bars.index(st), x_desc.block_type.nbytes, pred=more)
        _tma_load(x_desc, [m0, kt * 16], bars.index(st), xs.index(st), more)

    @gluon.jit
    def _overlapped_chunks(acc, xs, bars, x_desc, wb, wc, kstride, nchunks, m0, a0, idx, rsh, xorc,
                           TEXT: gl.constexpr, CONS: gl.constexpr, NWL: gl.constexpr, DOT: gl.constexpr,
                           STAGES: gl.constexpr):
        """The chunk loop with one wgmma group in flight: chunk c + 1 is decoded while chunk c's wgmma runs.

        The A operands of even and odd chunks are two variables (the loop is unrolled by two), so the chunk
        being decoded never shares registers with the one in flight (one variable carried around the loop
        let the decode rewrite them — a race the sm_90 build test looks for in the SASS). A buffer is
        refilled once the wgmma reading it has retired."""
        a_ev = _a_operand(wc, rsh, xorc, TEXT, CONS, NWL, DOT)
        wc = chunk_words(wb, _KC * kstride, kstride, nchunks > 1, idx, NWL)
        for c2 in range(nchunks // 2):
            c = 2 * c2
            st = c % STAGES
            mbarrier.wait(bars.index(st), (c // STAGES) & 1)
            acc = warpgroup_mma(a_ev, xs.index(st).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))           # chunk c - 1 retired
            refill_x(x_desc, xs, bars, (c + STAGES - 1) % STAGES, m0, a0 + (c - 1 + STAGES) * _KC,
                    (c >= 1) & (c - 1 + STAGES < nchunks))
            a_od = _a_operand(wc, rsh, xorc, TEXT, CONS, NWL, DOT)
            wc = chunk_words(wb, (c + 2) * _KC * kstride, kstride, c + 2 < nchunks, idx, NWL)
            st = (c + 1) % STAGES
            mbarrier.wait(bars.index(st), ((c + 1) // STAGES) & 1)
            acc = warpgroup_mma(a_od, xs.index(st).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))           # chunk c retired
            refill_x(x_desc, xs, bars, c % STAGES, m0, a0 + (c + STAGES) * _KC, c + STAGES < nchunks)
            a_ev = _a_operand(wc, rsh, xorc, TEXT, CONS, NWL, DOT)
            wc = chunk_words(wb, (c + 3) * _KC * kstride, kstride, c + 3 < nchunks, idx, NWL)
        if nchunks % 2 == 1:                    # an odd count: the last chunk, decoded by the loop, alone
            c = nchunks - 1
            st = c % STAGES
            mbarrier.wait(bars.index(st), (c // STAGES) & 1)
            acc = warpgroup_mma(a_ev, xs.index(st).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    @gluon.jit
    def _waiting_chunks(acc, xs, bars, x_desc, wb, wc, kstride, nchunks, m0, a0, idx, rsh, xorc,
                        TEXT: gl.constexpr, CONS: gl.constexpr, NWL: gl.constexpr, DOT: gl.constexpr,
                        STAGES: gl.constexpr):
        """The chunk loop that waits for each chunk's wgmma before decoding the next (the next chunk's words
        are loaded first); ``wc``: the first chunk's words."""
        for c in range(nchunks):
            wn = chunk_words(wb, (c + 1) * _KC * kstride, kstride, c + 1 < nchunks, idx, NWL)
            a = _a_operand(wc, rsh, xorc, TEXT, CONS, NWL, DOT)
            st = c % STAGES
            mbarrier.wait(bars.index(st), (c // STAGES) & 1)
            acc = warpgroup_mma(a, xs.index(st).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            refill_x(x_desc, xs, bars, st, m0, a0 + (c + STAGES) * _KC, c + STAGES < nchunks)
            wc = wn
        return acc

    @gluon.jit
    def _paired_chunks(acc, xs, bars, x_desc, wb, wc, kstride, nchunks, m0, a0, idx, rsh, xorc,
                       TEXT: gl.constexpr, CONS: gl.constexpr, NWL: gl.constexpr, DOT: gl.constexpr,
                       STAGES: gl.constexpr):
        """The waiting loop two chunks at a time (``WgmmaConfig.pair``, STAGES >= 2): both chunks decoded, both
        wgmmas issued, one wait for both, then both buffers refilled; an odd last chunk alone. ``wc``: the first
        chunk's words."""
        wd = chunk_words(wb, _KC * kstride, kstride, nchunks > 1, idx, NWL)
        for c2 in range(nchunks // 2):
            c = 2 * c2
            a_ev = _a_operand(wc, rsh, xorc, TEXT, CONS, NWL, DOT)
            a_od = _a_operand(wd, rsh, xorc, TEXT, CONS, NWL, DOT)
            wc = chunk_words(wb, (c + 2) * _KC * kstride, kstride, c + 2 < nchunks, idx, NWL)
            wd = chunk_words(wb, (c + 3) * _KC * kstride, kstride, c + 3 < nchunks, idx, NWL)
            st = c % STAGES
            mbarrier.wait(bars.index(st), (c // STAGES) & 1)
            acc = warpgroup_mma(a_ev, xs.index(st).permute((1, 0)), acc, is_async=True)
            st1 = (c + 1) % STAGES
            mbarrier.wait(bars.index(st1), ((c + 1) // STAGES) & 1)
            acc = warpgroup_mma(a_od, xs.index(st1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            refill_x(x_desc, xs, bars, st, m0, a0 + (c + STAGES) * _KC, c + STAGES < nchunks)
            refill_x(x_desc, xs, bars, st1, m0, a0 + (c + 1 + STAGES) * _KC, c + 1 + STAGES < nchunks)
        if nchunks % 2 == 1:
            c = nchunks - 1
            a = _a_operand(wc, rsh, xorc, TEXT, CONS, NWL, DOT)
            st = c % STAGES
            mbarrier.wait(bars.index(st), (c // STAGES) & 1)
            acc = warpgroup_mma(a, xs.index(st).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        return acc

    @gluon.jit
    def run_chunks(acc, xs, bars, x_desc, wb, wc, kstride, nchunks, m0, a0, idx, rsh, xorc,
                TEXT: gl.constexpr, CONS: gl.constexpr, NWL: gl.constexpr, DOT: gl.constexpr,
                STAGES: gl.constexpr, OVERLAP: gl.constexpr, PAIR: gl.constexpr = False):
        """``acc`` + the program's K range: x' boxes already requested for the first ``STAGES`` chunks."""
        if PAIR:
            acc = _paired_chunks(acc, xs, bars, x_desc, wb, wc, kstride, nchunks, m0, a0, idx, rsh, xorc,
                                 TEXT, CONS, NWL, DOT, STAGES)
        elif OVERLAP:
            acc = _overlapped_chunks(acc, xs, bars, x_desc, wb, wc, kstride, nchunks, m0, a0, idx, rsh, xorc,
                                     TEXT, CONS, NWL, DOT, STAGES)
        else:
            acc = _waiting_chunks(acc, xs, bars, x_desc, wb, wc, kstride, nchunks, m0, a0, idx, rsh, xorc,
                                  TEXT, CONS, NWL, DOT, STAGES)
        return acc

    @gluon.jit
    def warp_lanes(w_ptr, tile0, a0, n_tiles, one, KA: gl.constexpr, HALF: gl.constexpr, NWL: gl.constexpr):
        """Per lane of the warpgroup (warp w: n-tile ``tile0 + w``): the pointers of its NWL words in the
        tile at k-tile ``a0`` (a tuple of 3; the third unused when NWL = 2), the k-tile stride in words, R
        (its normalizing shift), the MCG xor constant (a register operand) and the lane index tensor."""
        NW: gl.constexpr = 8 * KA + 4 * HALF                      # words per tile
        LANES: gl.constexpr = gl.BlockedLayout([1], [32], [_WARPS], [0])
        idx = gl.arange(0, 32 * _WARPS, layout=LANES)
        lane = idx % 32
        e_end = (8 * lane + 8) * KA + HALF * (4 * lane + 4)       # the lane's last bit + 1 in its tile's ring
        last = (e_end - 1) // 32
        rsh = 32 * (last + 1) - e_end
        xorc = (lane * 0 + one * 0x3B603B60).to(gl.uint32).to(gl.int32, bitcast=True)   # a register operand
        kstride = n_tiles * NW
        tile = w_ptr + (tile0 + idx // 32) * NW + a0 * kstride
        wb = (tile + (last - NWL + 1 + NW) % NW, tile + (last - NWL + 2 + NW) % NW, tile + (last - NWL + 3 + NW) % NW)
        return wb, kstride, rsh, xorc, idx

    # nothing that follows from the row count is a specialization (rows, the partials' split stride, the
    # k-tiles per split): a prewarm at one row count of a bucket covers the others
    @gluon.jit(do_not_specialize=["rows", "k_per", "stride_zs", "one", "seg_b1", "seg_b2", "seg_rows"])
    def _wgmma_kernel(x_desc, w_ptr, z_ptr, rows, k_tiles, n_tiles, k_per, stride_zs, one,
                      KA: gl.constexpr, HALF: gl.constexpr, NWL: gl.constexpr, TEXT: gl.constexpr,
                      CONS: gl.constexpr, BR: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                      PDL: gl.constexpr = False, PAIR: gl.constexpr = False, ATOMIC: gl.constexpr = False,
                      seg_b1=0, seg_b2=0, seg_rows=0):
        """Program (pid_n, pid_m, pid_k): columns ``64·pid_n …``, rows ``BR·pid_m …``, k-tiles
        ``[pid_k·k_per, …)`` of ``z[pid_k] = x'·Q``; ``x_desc``: TMA descriptor of x' ([rows, K] fp16,
        ``[BR, 64]`` boxes). ``PDL`` (programmatic dependent launch): the next kernel may launch now; the
        first chunk's words are loaded before waiting for the previous kernel (which writes x'). A fused layer
        (``seg_rows`` > 0): the n-tiles from ``seg_b1`` (``seg_b2``) on read x' rows ``seg_rows`` (twice that)
        further down — each column segment has its own x'."""
        if PDL:
            _gdc("griddepcontrol.launch_dependents;")
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        a0 = pid_k * k_per
        nchunks = (gl.minimum(a0 + k_per, k_tiles) - a0) // _KC
        wb, kstride, rsh, xorc, idx = warp_lanes(w_ptr, pid_n * _WARPS, a0, n_tiles, one, KA, HALF, NWL)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_WARPS, 1],
                                                     instr_shape=[16, BR, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        acc = gl.zeros([16 * _WARPS, BR], gl.float32, MMA)
        xs = gl.allocate_shared_memory(gl.float16, [STAGES, BR, _KC * 16], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        m0 = pid_m * BR
        t0 = pid_n * _WARPS
        mx = m0 + ((t0 >= seg_b1).to(gl.int32) + (t0 >= seg_b2).to(gl.int32)) * seg_rows   # x' row of m0
        wc = chunk_words(wb, 0, kstride, nchunks > 0, idx, NWL)
        if PDL:
            _gdc("griddepcontrol.wait;")
        for s in gl.static_range(STAGES):
            refill_x(x_desc, xs, bars, s, mx, a0 + s * _KC, s < nchunks)
        acc = run_chunks(acc, xs, bars, x_desc, wb, wc, kstride, nchunks, mx, a0, idx, rsh, xorc,
                      TEXT, CONS, NWL, DOT, STAGES, OVERLAP, PAIR)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        nn = gl.arange(0, 16 * _WARPS, layout=gl.SliceLayout(1, MMA))
        mm = gl.arange(0, BR, layout=gl.SliceLayout(0, MMA))
        offs = (m0 + mm)[None, :].to(gl.int64) * (n_tiles * 16) + (pid_n * 16 * _WARPS + nn)[:, None]
        if ATOMIC:                  # every split into z[0] (the host passes stride_zs = 0)
            gl.atomic_add(z_ptr + offs, acc, mask=((m0 + mm) < rows)[None, :], sem="relaxed")
        else:
            gl.store(z_ptr + pid_k.to(gl.int64) * stride_zs + offs, acc, mask=((m0 + mm) < rows)[None, :])


def padded_rows(rows: int, cfg: WgmmaConfig) -> int:
    """Rows of an x' buffer for ``rows`` rows under ``cfg``: a whole number of row blocks. A TMA box that reaches
    past the end of x' (zero-filled by the hardware) makes the whole kernel up to ~2× slower; rows past ``rows``
    are read, never stored."""
    return math.ceil(rows / cfg.block_rows) * cfg.block_rows


def wgmma_rotated(xh: torch.Tensor, trellis: torch.Tensor, codebook: str, cfg: Optional[WgmmaConfig] = None,
                  pdl: bool = False, rows: Optional[int] = None, acc: Optional[torch.Tensor] = None,
                  alloc=None, seg: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """Split-K partials ``z [splits, rows, out_p]`` (fp32) of ``xh[:rows]`` (fp16, row-major, 16-byte
    aligned rows) times the layer's Q, on a device where :func:`available` holds; where :func:`use_atomic` the
    splits are added into one buffer ``[1, rows, out_p]``: ``acc`` if given (zeroed by the caller, e.g. by the
    pre-pass), else a zeroed new one. ``rows`` (default: all of
    ``xh``): ``xh`` may hold more rows — give it :func:`padded_rows` rows (their content is read but only
    changes rows of the product that are not stored), else the last row block's TMA boxes reach past its end,
    which is correct but slow. ``pdl``: launch as a programmatic dependent of the kernel that wrote ``xh``
    (and let the next one launch early). ``alloc``: makes the partials' buffer (default ``torch.empty``).
    ``seg`` (a fused layer): ``(b1, b2, seg_rows)``, the n-tiles where column segments 1 and 2 start and the rows
    of x' per segment — segment g's x' is ``xh[g·seg_rows : g·seg_rows + rows]``."""
    from ..format.bits import bits_from_trellis
    from .linear import split_buffer
    if not available(xh.device):
        raise RuntimeError("the wgmma kernel needs a CUDA device of compute capability 9.0 and Triton's Gluon "
                           "(and EXL3RT_KERNEL_NO_WGMMA / EXL3RT_KERNEL_NO_ASM unset)")
    x_rows, in_p = xh.shape
    if seg is not None:
        x_rows = seg[2]
    rows = x_rows if rows is None else int(rows)
    if not 0 < rows <= x_rows:
        raise ValueError(f"wgmma_rotated: rows={rows} must be in 1..{x_rows} (the rows of x')")
    k_tiles, n_tiles = int(trellis.shape[0]), int(trellis.shape[1])
    if xh.dtype != torch.float16 or in_p != 16 * k_tiles or xh.stride(1) != 1 or xh.stride(0) != in_p:
        raise ValueError(f"wgmma_rotated: x' must be a row-major fp16 [rows, {16 * k_tiles}], got "
                         f"{xh.dtype} {tuple(xh.shape)} strides {xh.stride()}")
    if k_tiles % KC or n_tiles % WARPS:
        raise ValueError(f"wgmma_rotated: widths must be multiples of 64 ({16 * k_tiles} × {16 * n_tiles})")
    cfg = cfg or default_wgmma_config(rows, bits_from_trellis(trellis))
    grid_n, grid_m = n_tiles // WARPS, math.ceil(rows / cfg.block_rows)
    # the split follows from the layer and the row bucket, never from the row count itself (the post-pass
    # specializes on it): a prewarm at one row count of the bucket covers every other
    splits, k_per, atomic = launch_splits(k_tiles, n_tiles, cfg)
    z = split_buffer("wgmma_rotated", acc, atomic, splits, rows, n_tiles * 16, xh.device, alloc)
    desc = TensorDescriptor.from_tensor(xh, [cfg.block_rows, KC * 16], x_layout(cfg.block_rows))
    extra = {}
    if pdl:
        extra["launch_pdl"] = True
    launch(_wgmma_kernel, (grid_n, grid_m, splits), desc, trellis.view(torch.int32), z, rows, k_tiles, n_tiles, k_per,
                                            0 if atomic else z.stride(0), 1, num_warps=WARPS,
                                            **kernel_constants(bits_from_trellis(trellis), codebook, cfg, pdl, atomic),
                                            **extra,
                                            **(dict(seg_b1=seg[0], seg_b2=seg[1], seg_rows=seg[2]) if seg else {}))
    return z


def kernel_constants(bits, codebook: str, cfg: WgmmaConfig, pdl: bool = False, atomic: bool = False) -> dict:
    """The compile-time arguments of ``_wgmma_kernel`` for K = ``bits``, ``codebook`` and ``cfg`` (PDL and
    ATOMIC only when set: the kernel's defaults)."""
    from .lane_decode import lane_decode_ptx, lane_span_words
    from .common import cb_args, kernel_bits
    ka, half = kernel_bits(bits)
    text, cons, _ = lane_decode_ptx(ka, half, *cb_args(codebook))
    out = dict(KA=ka, HALF=half, NWL=lane_span_words(ka, half), TEXT=text, CONS=cons, BR=cfg.block_rows,
               STAGES=cfg.stages, OVERLAP=cfg.overlap, PAIR=cfg.pair)
    if pdl:
        out["PDL"] = True
    if atomic:
        out["ATOMIC"] = True
    return out


@lru_cache(maxsize=None)
def x_layout(block_rows: int):
    return gl.NVMMASharedLayout.get_default_for([block_rows, KC * 16], gl.float16)


__all__ = ["HAVE_GLUON", "WgmmaConfig", "available", "default_wgmma_config", "kernel_constants", "padded_rows",
           "wgmma_rotated", "use_atomic", "launch_splits", "ATOMIC_MIN_SPLITS",
           "wgmma_splits",
           "WGMMA_16", "WGMMA_32", "WGMMA_64", "WGMMA_128", "WGMMA_128_PAIR", "WGMMA_256", "WGMMA_256_PAIR"]
