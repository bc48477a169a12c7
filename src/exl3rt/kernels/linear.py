"""EXL3 linear on the GPU: input rotation, decode-on-the-fly GEMV or decode + matmul, output rotation.

    y = x·W,   W = diag(suh)·Hk·Q·Hn·diag(svh)          (format.reconstruct)
      = ((x ⊙ suh)·Hk) · Q · Hn ⊙ svh

``exl3_linear(x, trellis, suh, svh, codebook)`` picks a path by row count (:func:`choose_path`):

* ``mma`` (1–64 rows; where the wgmma kernel runs 1–8, and 9–16 at K 1, 2 and 4): pre-pass
  ``x' = (x ⊙ suh)·Hk``, ``mma.mma_kernel`` (decode on the fly) writes fp32 split-K partials, post-pass
  ``y = (Σ_s z[s])·Hn ⊙ svh``; each lane decodes its own ``mma.m16n8k16`` B fragment (the EXL3 tile order is that
  fragment order), x' in fp16 written by the pre-pass in fragment order (one vector load per lane and k-tile),
  fp32 accumulators; the decode costs the same for 1 or 16 rows, and at 17–32 (33–64) rows one decode feeds two
  (four) 16-row blocks (``MmaConfig.row_blocks``); up to 8 rows the decoded tile is the mma's A operand and x'ᵀ
  the B operand (``MmaConfig.swap``: one mma per tile);
* ``wgmma`` (17–256 and 417–512 rows, from 9 rows at K other than 1, 2 and 4; Hopper only:
  :func:`exl3rt.kernels.wgmma.available`): the same passes (x' row-major) around ``wgmma._wgmma_kernel`` —
  each warp decodes one n-tile's k-tiles straight into the registers of a warpgroup MMA's A operand (Qᵀ),
  x'ᵀ the B operand through TMA into shared memory;
* ``decode_mm`` (more rows, 257–416, or 65+ rows without wgmma): ``decode.decode_kernel`` writes Q (fp16, bit-exact)
  once and cuBLAS computes ``x'·Q`` (fp16 operands, fp32 output), then the post-pass.

The Hadamard passes (``hadamard.py``) are 7-stage fp32 butterflies in registers, one launch each.
Half-integer K (mul1) runs the same kernels. Every launch is a Triton specialization on (K,
codebook, launch configuration, dtypes), never on the row count; :func:`prewarm` compiles a list
of layer shapes ahead (e.g. before CUDA-graph capture) and returns how many launches it ran.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from .. import env
from ..format.bits import Bits, bits_from_trellis, is_half
from ..format.codebooks import check_codebook
from ..format.errors import FormatError
from ..util.ints import next_pow2
from . import mma as _mm
from . import decode as _dec
from . import wgmma as _wg
from .common import cb_args, interpreting, kernel_bits, pdl_args, use_asm, use_pdl
from .hadamard import gated_had
from .hadamard import had as _had
from .launch import (Recording, Replay, current_stream, direct_launch_ok, launch, new_plans_epoch, run_plan,
                     scratch_layout, slot_bytes)

from ._triton import HAVE_GDC, triton

Alloc = Callable[[tuple, torch.dtype], torch.Tensor]   # (shape, dtype) -> a scratch tensor on the call's device


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the Q decode of ``decode_mm`` (``decode.decode_kernel``): ``nt`` n-tiles per
    program, warps, k-tiles per program (defaults: the best of 36 tried; docs/kernels.md, "Tuned constants")."""
    nt: int = 8
    num_warps: int = 2
    k_per: int = 1


@dataclass(frozen=True)
class MmaConfig:
    """Launch parameters of the warp-level mma GEMV (``mma.mma_kernel``): ``nt`` n-tiles per warp,
    ``num_warps`` warps per program (each with its own ``nt`` tiles), and how many programs to aim for when
    splitting K."""
    nt: int = 8
    num_warps: int = 1
    target_programs: int = 2112
    num_stages: int = 1
    row_blocks: int = 1
    swap: bool = False   # ≤ 8 rows per row block: the tile is the mma's A operand (one mma per tile)
    unroll: int = 0      # k-tiles per loop iteration (1 or 2); 0: mma.default_unroll(K)


# The launch configurations per row bucket: the best (or within a few % of the best) of those tried on the H200
# (docs/kernels.md, "Tuned constants").
# up to 8 rows: the decoded tile as the mma's A operand (one mma per tile), 4 tiles per warp, ~4224 programs
DEFAULT_MMA = MmaConfig(nt=4, num_warps=1, target_programs=4224, swap=True)
# 9-16 rows: 2 tiles per one-warp program, ~4224 programs
DEFAULT_MMA_MANY_ROWS = MmaConfig(nt=2, num_warps=1, target_programs=4224)
# 9-16 rows above K = 4 (one k-tile per loop iteration): 4 tiles per warp, ~3584 programs
DEFAULT_MMA_MANY_ROWS_WIDE = MmaConfig(nt=4, num_warps=1, target_programs=3584)
# 17-32 rows: one decode feeds two 16-row blocks
DEFAULT_MMA_32_ROWS = MmaConfig(nt=4, num_warps=1, target_programs=2112, row_blocks=2)
# 33-64 rows: one decode feeds four 16-row blocks, 2 tiles per warp
DEFAULT_MMA_64_ROWS = MmaConfig(nt=2, num_warps=1, target_programs=4224, row_blocks=4)


def default_mma_config(rows: int, bits: Bits = 4) -> MmaConfig:
    """The mma GEMV's launch configuration for ``rows`` of a layer of ``bits`` per weight (see
    :data:`DEFAULT_MMA_MANY_ROWS`)."""
    if rows <= 8:
        return DEFAULT_MMA
    if rows <= 16:
        return DEFAULT_MMA_MANY_ROWS_WIDE if bits > 4 else DEFAULT_MMA_MANY_ROWS
    return DEFAULT_MMA_32_ROWS if rows <= 32 else DEFAULT_MMA_64_ROWS


DEFAULT_DECODE = DecodeConfig()


def use_halves(device: torch.device, cb: int) -> bool:
    """The mma kernels may multiply both halves of each MCG/3INST codebook sum, unrounded
    (``lane_decode_ptx(..., halves=True)``): inline PTX, not MUL1, ``EXL3RT_KERNEL_ROUNDED_DECODE`` unset. The
    kernel takes them where they pay (``mma._halves_for``: swapped operands — 1-8 rows, the MoE decode plan —
    and K other than 4 and 8)."""
    return cb != 2 and use_asm(device) and not env.KERNEL_ROUNDED_DECODE.get()


def use_atomic(cfg: MmaConfig) -> bool:
    """The mma GEMV adds its K splits into one fp32 buffer (``red.add``, zeroed by the pre-pass; the order of
    the adds is not fixed) instead of writing a partial sum per split for the post-pass to add: with swapped
    operands (1-8 rows, where the partials are many splits of few rows: 19-64 splits × 8 rows) unless
    ``EXL3RT_KERNEL_DETERMINISTIC`` is set: faster at 1-8 rows, slower at 16 (docs/kernels.md, "Tuned
    constants")."""
    return cfg.swap and not env.KERNEL_DETERMINISTIC.get()


MAX_SEGMENTS = 3     # a fused layer's column segments (q/k/v); the kernels take two boundaries


def _check(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bounds: tuple = ()) -> tuple[int, int, Bits]:
    bits = bits_from_trellis(trellis)
    in_p, out_p = trellis.shape[0] * 16, trellis.shape[1] * 16
    if in_p % 128 or out_p % 128:
        raise FormatError(f"trellis {tuple(trellis.shape)}: in/out widths must be multiples of 128")
    want_suh = (len(bounds) + 1, in_p) if bounds else (in_p,)
    if suh.shape != want_suh or svh.shape != (out_p,):
        raise FormatError(f"suh/svh shapes {tuple(suh.shape)}/{tuple(svh.shape)} do not match the trellis "
                          f"[{in_p}, {out_p}]" + (f" of {len(bounds) + 1} segments" if bounds else ""))
    if not trellis.is_contiguous() or not suh.is_contiguous():
        raise FormatError("trellis and suh must be contiguous")
    if bounds:
        if len(bounds) >= MAX_SEGMENTS or any(b % 128 for b in bounds) or \
                list(bounds) != sorted(set(bounds)) or not 0 < bounds[0] <= bounds[-1] < out_p:
            raise ValueError(f"segment bounds {tuple(bounds)}: at most {MAX_SEGMENTS - 1} increasing multiples of "
                             f"128 inside (0, {out_p})")
    return in_p, out_p, bits


def seg_tiles(bounds: tuple, tn: int) -> tuple[int, int]:
    """The kernels' two segment boundaries in n-tiles (a missing one at ``tn``: never reached)."""
    b = [c // 16 for c in bounds] + [tn, tn]
    return b[0], b[1]


def gemv_splits(in_tiles: int, n_blocks: int, target_programs: int, k_multiple: int = 1,
                min_k: int = 1) -> tuple[int, int]:
    """(splits, k-tiles per split) so that n_blocks·splits is about ``target_programs``, with at most
    ``ceil(in_tiles / min_k)`` splits; k-tiles per split rounded up to a multiple of ``k_multiple`` (the
    mma loop's k-tiles per iteration)."""
    if target_programs <= 0:
        return 1, in_tiles
    splits = max(1, min(in_tiles, math.ceil(target_programs / max(1, n_blocks)), math.ceil(in_tiles / min_k)))
    k_per = math.ceil(math.ceil(in_tiles / splits) / k_multiple) * k_multiple
    return math.ceil(in_tiles / k_per), k_per


def _geometry(trellis: torch.Tensor, codebook: str, nt_max: int, bounds: tuple = ()):
    """(k-tiles, n-tiles, n-tiles per program (a divisor of n-tiles and of each segment boundary's), kernel K
    args, codebook args)."""
    in_tiles, tn = int(trellis.shape[0]), int(trellis.shape[1])
    nt = min(nt_max, tn)
    while tn % nt or any((b // 16) % nt for b in bounds):
        nt //= 2
    return in_tiles, tn, nt, kernel_bits(bits_from_trellis(trellis)), cb_args(codebook)


def decode_fp16(trellis: torch.Tensor, codebook: str, cfg: DecodeConfig = DEFAULT_DECODE,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Q = ``format.reconstruct.decode(trellis, K, codebook)`` (fp16 ``[in_p, out_p]``, bit-exact) by Triton."""
    in_tiles, tn, nt, (ka, half), (cb, mult, add) = _geometry(trellis, codebook, cfg.nt)
    k_per = max(1, min(cfg.k_per, in_tiles))
    if out is None:
        out = torch.empty((in_tiles * 16, tn * 16), dtype=torch.float16, device=trellis.device)
    grid = (tn // nt, triton.cdiv(in_tiles, k_per))
    launch(_dec.decode_kernel, grid, trellis.view(torch.int32), out, in_tiles, tn, k_per, KA=ka, HALF=half, CB=cb, MULT=mult,
                            ADD=add, NT=nt, ASM=use_asm(trellis.device), num_warps=cfg.num_warps)
    return out


def xfrag_rows(rows: int, cfg: MmaConfig) -> int:
    """Rows of the fragment-ordered x' buffer of ``rows`` rows: whole row blocks of the program (16·``row_blocks``
    rows, 8 with ``swap``), the padding zero."""
    block = (8 if cfg.swap else 16) * cfg.row_blocks
    return -(-rows // block) * block


def mma_rotated(xh: torch.Tensor, trellis: torch.Tensor, codebook: str, cfg: Optional[MmaConfig] = None, *,
                rows: Optional[int] = None, acc: Optional[torch.Tensor] = None, alloc: Optional[Alloc] = None,
                bounds: tuple = ()) -> torch.Tensor:
    """Split-K partials ``z[s] = x'·Q`` (fp32 ``[splits, rows, out_p]``) for fp16 x', by the warp-level mma
    kernel (16·``row_blocks`` rows per program row-block); where :func:`use_atomic` the splits are added into
    one buffer, ``[1, rows, out_p]``: ``acc`` if given (zeroed by the caller, e.g. by the pre-pass), else a
    zeroed new one. ``rows=None``: ``xh`` is x' ``[rows, in_p]``,
    row-major; else ``xh`` is x' of ``rows`` rows in fragment order (:func:`hadamard.xfrag_offsets`,
    ``[xfrag_rows(rows, cfg), in_p]``, as the pre-pass writes it with ``frag``): one vector load per lane
    and k-tile instead of 2–4 scalar loads over 8 rows each. ``alloc``: makes the partials' buffer
    (default ``torch.empty`` on x's device). ``bounds`` (a fused layer, fragment order only): the output columns
    where segments 1, 2 start; ``xh`` is then ``[segments, rows_pad, in_p]``, segment g's x' in ``xh[g]``."""
    xfrag = rows is not None
    seg_x = 0
    if bounds:
        if not xfrag or xh.dim() != 3 or xh.shape[0] != len(bounds) + 1:
            raise ValueError("mma_rotated: a fused layer takes x' [segments, rows_pad, in_p] in fragment order")
        seg_x = xh.stride(0)
        xh = xh[0]
    if not xfrag:
        rows = xh.shape[0]
    in_p = xh.shape[1]
    cfg = cfg or default_mma_config(rows, bits_from_trellis(trellis))
    if xfrag and xh.shape[0] != xfrag_rows(rows, cfg):
        raise ValueError(f"fragment-ordered x' of {rows} rows: expected {xfrag_rows(rows, cfg)} rows, got {xh.shape[0]}")
    in_tiles, tn, nt, (ka, half), (cb, mult, add) = _geometry(trellis, codebook, cfg.nt * cfg.num_warps, bounds)
    warps = min(cfg.num_warps, nt)
    nt_warp = nt // warps
    if cfg.swap and cfg.row_blocks != 1:
        raise ValueError(f"{cfg}: swap takes no row_blocks")
    n_blocks, m_blocks = tn // nt, triton.cdiv(rows, (8 if cfg.swap else 16) * cfg.row_blocks)
    bits = ka + half / 2
    unroll = cfg.unroll or _mm.default_unroll(bits)
    splits, k_per = gemv_splits(in_tiles, n_blocks * m_blocks, cfg.target_programs, k_multiple=unroll)
    atomic = use_atomic(cfg)
    z = split_buffer("mma_rotated", acc, atomic, splits, rows, tn * 16, xh.device, alloc)
    grid = (n_blocks, splits, m_blocks)
    stride_x = in_p * (4 if cfg.swap else 8) if xfrag else xh.stride(0)     # int32 per row block / fp16 per row
    launch(_mm.mma_kernel, grid, xh, trellis.view(torch.int32), z, rows, in_tiles, tn, k_per, stride_x,
                          0 if atomic else z.stride(0), 1, ATOMIC=atomic,
                          KA=ka, HALF=half, CB=cb, MULT=mult, ADD=add, NT=nt_warp, WARPS=warps,
                          NWL=_mm.words_per_lane(bits), ASM=use_asm(xh.device),
                          MB=cfg.row_blocks, SWAP=cfg.swap, UNROLL=unroll, XFRAG=xfrag,
                          HALVES=use_halves(xh.device, cb), num_warps=warps,
                          num_stages=cfg.num_stages, **pdl_args(xh.device),
                          **(dict(zip(("seg_b1", "seg_b2"), seg_tiles(bounds, tn)), seg_x=seg_x) if bounds else {}))
    return z


def split_buffer(name: str, acc: Optional[torch.Tensor], atomic: bool, splits: int, rows: int, out_p: int,
                 device: torch.device, alloc: Optional[Alloc] = None) -> torch.Tensor:
    """The fp32 buffer a GEMV/GEMM launch writes: ``[splits, rows, out_p]`` partials (from ``alloc``, default
    ``torch.empty``), or (``atomic``: the splits are added into one buffer) ``acc`` — checked, zeroed by the
    caller — or a zeroed ``[1, rows, out_p]``."""
    if acc is not None:
        if not atomic or acc.shape != (1, rows, out_p) or acc.dtype != torch.float32 or not acc.is_contiguous():
            raise ValueError(f"{name}: acc must be a contiguous fp32 [1, {rows}, {out_p}] tensor, and only where the "
                             f"splits are added into one buffer (use_atomic)")
        return acc
    if atomic:
        return torch.zeros((1, rows, out_p), dtype=torch.float32, device=device)
    if alloc is not None:
        return alloc((splits, rows, out_p), torch.float32)
    return torch.empty((splits, rows, out_p), dtype=torch.float32, device=device)


PATHS = ("auto", "mma", "wgmma", "decode_mm")
MMA_MAX_ROWS = 64  # the mma GEMV decodes once per 8 / 16 / 32 / 64 rows; above, decode + cuBLAS wins
# with the wgmma kernel (Hopper): from WGMMA_MIN_ROWS (the mma GEMV below; WGMMA_MIN_ROWS_WIDE at a K outside
# MMA_16_BITS) to WGMMA_MAX_ROWS (decode + cuBLAS above), except WGMMA_GAP, where its second 256-row block is
# mostly empty (the crossovers: docs/kernels.md, "Tuned constants")
WGMMA_MIN_ROWS = 17
WGMMA_MIN_ROWS_WIDE = 9      # ... at a K outside MMA_16_BITS
MMA_16_BITS = (1.0, 2.0, 4.0)  # K at which 9-16 rows stay on the mma GEMV
WGMMA_MAX_ROWS = 512
WGMMA_GAP = (257, 416)


def choose_path(rows: int, *, wgmma: bool = False, bits: Bits = 4) -> str:
    """``mma`` (warp-level tensor-core GEMV) up to :data:`MMA_MAX_ROWS`, else ``decode_mm`` (Q to
    fp16, then cuBLAS); with ``wgmma`` (the device runs it, :func:`exl3rt.kernels.wgmma.available`)
    ``wgmma`` from :data:`WGMMA_MIN_ROWS` rows (:data:`WGMMA_MIN_ROWS_WIDE` at a K of ``bits`` outside
    :data:`MMA_16_BITS`) to :data:`WGMMA_MAX_ROWS`, except :data:`WGMMA_GAP` (257–416 rows: the kernel's second
    256-row block mostly empty, decode + cuBLAS faster)."""
    if wgmma and rows <= WGMMA_MAX_ROWS and not WGMMA_GAP[0] <= rows <= WGMMA_GAP[1]:
        if rows >= (WGMMA_MIN_ROWS if float(bits) in MMA_16_BITS else WGMMA_MIN_ROWS_WIDE):
            return "wgmma"
    return "mma" if rows <= MMA_MAX_ROWS else "decode_mm"


def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                codebook: str, bits: Optional[Bits] = None, *, path: str = "auto",
                mma_cfg: Optional[MmaConfig] = None,
                decode_cfg: DecodeConfig = DEFAULT_DECODE, out_dtype: Optional[torch.dtype] = None,
                bounds: tuple = ()) -> torch.Tensor:
    """``y = x·W`` for x ``[rows, in_p]`` (padded), W the EXL3 layer; returns ``[rows, out_p]`` in x's dtype.

    A fused layer (several layers of one input and one K, e.g. q/k/v, as one launch sequence): ``trellis`` their
    trellises concatenated along the output tiles, ``svh`` their output scales concatenated, ``suh``
    ``[segments, in_p]`` their input scales, ``bounds`` the output columns where segments 1, 2 … start
    (multiples of 128, at most :data:`MAX_SEGMENTS` segments); ``y[:, a:b] = x·W_g`` for segment g's columns.

    ``path``: ``auto`` (:func:`choose_path`), ``mma`` (any row count, 16 per row block), ``wgmma``
    (Hopper only) or ``decode_mm`` (decode Q to fp16 in memory, then cuBLAS). ``bits`` is only checked against
    the trellis shape (K always follows from the shape). With every option at its default the call goes
    through :func:`planned_linear` (decided once per layer and row count, replayed cheaply).
    """
    if (path == "auto" and bits is None and mma_cfg is None and out_dtype is None
            and decode_cfg is DEFAULT_DECODE):
        return planned_linear(x, trellis, suh, svh, codebook, bounds)
    return _linear(x, trellis, suh, svh, codebook, bits, path=path, mma_cfg=mma_cfg, decode_cfg=decode_cfg, out_dtype=out_dtype, bounds=bounds)


def _linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str,
            bits: Optional[Bits] = None, *, path: str = "auto", mma_cfg: Optional[MmaConfig] = None,
            decode_cfg: DecodeConfig = DEFAULT_DECODE, out_dtype: Optional[torch.dtype] = None,
            alloc: Optional[Alloc] = None, taken: Optional[list] = None, bounds: tuple = ()) -> torch.Tensor:
    """:func:`exl3_linear` decided and launched in full. ``alloc`` makes every scratch buffer (default
    ``torch.empty`` on x's device); ``taken`` (a list) receives the path run; ``bounds``: a fused layer's
    segment boundaries (:func:`exl3_linear`)."""
    bounds = tuple(int(b) for b in bounds)
    in_p, out_p, kbits = _check(trellis, suh, svh, bounds)
    nseg = len(bounds) + 1
    if bits is not None and float(bits) != float(kbits):
        raise FormatError(f"bits={bits} does not match the trellis shape (K = {kbits})")
    if x.dim() != 2 or x.shape[1] != in_p:
        raise ValueError(f"x: expected [rows, {in_p}], got {tuple(x.shape)}")
    if path not in PATHS:
        raise ValueError(f"path={path!r}: expected one of {PATHS}")
    x = x.contiguous()
    rows = x.shape[0]
    out_dtype = out_dtype or x.dtype
    y = torch.empty((rows, out_p), dtype=out_dtype, device=x.device)
    if rows == 0:
        return y
    if alloc is None:
        def alloc(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=x.device)
    if path == "auto":
        path = choose_path(rows, wgmma=_wg.available(x.device), bits=kbits)
    if taken is not None:
        taken.append(path)
    if path == "mma":
        pdl = use_pdl(x.device)
        cfg = mma_cfg or default_mma_config(rows, kbits)
        xf = alloc((nseg, xfrag_rows(rows, cfg), in_p) if bounds else (xfrag_rows(rows, cfg), in_p), torch.float16)
        acc = alloc((1, rows, out_p), torch.float32) if use_atomic(cfg) else None
        _had(x, suh, xf, pre=True, pdl=pdl, frag=2 if cfg.swap else 1, zero=acc)   # (zeroes acc)
        z = mma_rotated(xf, trellis, codebook, cfg, rows=rows, acc=acc, alloc=alloc, bounds=bounds)
        _had(z, svh, y, pre=False, splits=z.shape[0], stride_split=z.stride(0), pdl=pdl)
        return y
    if path == "wgmma":
        wcfg = _wg.default_wgmma_config(rows, kbits)
        pdl = wcfg.pdl and use_pdl(x.device)
        # x' in whole row blocks (no TMA box past its end: ~2x faster for a partial last block); rows past x's
        # are left unwritten: they only reach product rows that are not stored
        padded = _wg.padded_rows(rows, wcfg)
        xh = alloc((nseg * padded, in_p), torch.float16)
        atomic = _wg.launch_splits(in_p // 16, out_p // 16, wcfg)[2]
        acc = alloc((1, rows, out_p), torch.float32) if atomic else None
        _had(x, suh, xh.view(nseg, padded, in_p) if bounds else xh[:rows], pre=True, pdl=pdl, zero=acc)  # (zeroes acc)
        z = _wg.wgmma_rotated(xh, trellis, codebook, wcfg, pdl=pdl, rows=rows, acc=acc, alloc=alloc,
                              **({"seg": (*seg_tiles(bounds, out_p // 16), padded)} if bounds else {}))
        _had(z, svh, y, pre=False, splits=z.shape[0], stride_split=z.stride(0), pdl=pdl)
        return y
    xh = alloc((nseg, rows, in_p), torch.float16)
    _had(x, suh, xh if bounds else xh[0], pre=True)
    q = decode_fp16(trellis, codebook, decode_cfg)
    edges = (0, *bounds, out_p)
    for g in range(nseg):       # each segment's product, rotated straight into its columns of y
        a, b = edges[g], edges[g + 1]
        qg = q[:, a:b]
        z = torch.matmul(xh[g], qg).float() if x.device.type == "cpu" else _mm_fp32(xh[g], qg)
        _had(z, svh[a:b], y[:, a:b], pre=False)
    return y


# ---- plans: each layer's launches at a row count, decided once -------------------------------------------

PLANNED_PATHS = ("mma", "wgmma")   # decode + cuBLAS runs in full every call
WORKSPACE_MAX_BYTES = 32 << 20     # plans with more scratch than this allocate it per call (big prefills)
MAX_PLANS = 8192                   # then the table starts over (each distinct prompt length makes one per layer)


@dataclass
class LinearPlan:
    """One layer at one row count: the output's shape and dtype, the scratch buffers (shapes, dtypes and
    offsets in a workspace) and the recorded launches (:class:`exl3rt.kernels.launch.Replay`)."""
    y_shape: tuple
    y_dtype: torch.dtype
    scratch: tuple              # ((shape, dtype, byte offset), ...)
    nbytes: int
    replay: Optional[Replay]    # None: this call runs in full every time (decode + cuBLAS)
    views: tuple = (None, ())   # (the workspace tensor the views below are of, the views)


_PLANS: dict = {}
# (device index, stream) -> uint8 tensor. Made and grown only by prewarm (reserve_workspace), never inside a
# call: a call may run where allocations land in a CUDA graph pool (torch.compile's cudagraph trees warm up
# eagerly on their pool), and a buffer kept from there breaks the pool's bookkeeping
_WORKSPACES: dict = {}


def reset_plans() -> None:
    """Forget every plan and workspace (:func:`prewarm` reserves them again). Kernel settings
    (``EXL3RT_KERNEL_*``) are read when a plan is made: call this after changing them in a running process."""
    _PLANS.clear()
    _WORKSPACES.clear()
    new_plans_epoch()


def reserve_workspace(device: torch.device, nbytes: int) -> None:
    """Make the current stream's workspace on ``device`` (CUDA) hold at least ``nbytes`` (at most
    :data:`WORKSPACE_MAX_BYTES`); planned calls whose scratch does not fit allocate it per call."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return
    dev = device.index if device.index is not None else torch.cuda.current_device()
    key = (dev, current_stream(dev))
    nbytes = min(int(nbytes), WORKSPACE_MAX_BYTES)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < nbytes:
        _WORKSPACES[key] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=device)


def stream_workspace(dev: int, stream: int) -> Optional[torch.Tensor]:
    """The workspace :func:`prewarm` reserved for ``stream`` of CUDA device ``dev`` (None: none, or a CUDA graph
    is being captured, when scratch must be allocated per call)."""
    if dev < 0 or torch.cuda.is_current_stream_capturing():
        return None
    return _WORKSPACES.get((dev, stream))


def planned_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                   codebook: str, bounds: tuple = ()) -> torch.Tensor:
    """:func:`exl3_linear` with default options, planned: the first call of a layer (trellis, scales,
    codebook) at a row count, dtype and device decides the path, compiles and launches as usual and records
    the launches; later calls allocate the output, take their scratch from the stream's workspace where
    :func:`prewarm` reserved one big enough (else, and while a CUDA graph is captured, allocate it) and call
    the compiled kernels' launchers directly. On CUDA the plan keys on the tensors' addresses and shapes and
    holds only the addresses: a freed layer leaves a plan that only a new layer of the same shapes at the same
    addresses reaches, and for it the plan is right."""
    dev = x.get_device()
    if dev >= 0 and torch._C._cuda_getDevice() != dev:      # Triton launches on the current device
        with torch.cuda.device(dev):
            return planned_linear(x, trellis, suh, svh, codebook, bounds)
    key = (trellis.data_ptr(), trellis.shape, trellis.dtype, suh.data_ptr(), suh.dtype, svh.data_ptr(), svh.dtype,
           x.shape, x.dtype, dev, codebook, bounds)
    if x.data_ptr() & 15 or not x.is_contiguous():      # not what a replay's kernels were specialized on
        return _linear(x, trellis, suh, svh, codebook, bounds=bounds)
    plan = _PLANS.get(key)
    if plan is None:
        return _plan_call(key, x, functools.partial(_linear, x, trellis, suh, svh, codebook, bounds=bounds))
    if plan.replay is None:
        return _linear(x, trellis, suh, svh, codebook, bounds=bounds)
    return _run_plan(plan, x, dev)


def _run_plan(plan: LinearPlan, x: torch.Tensor, dev: int) -> torch.Tensor:
    y = torch.empty(plan.y_shape, dtype=plan.y_dtype, device=x.device)
    stream = current_stream(dev)
    run_plan(plan, stream, (x, y), stream_workspace(dev, stream), x.device)
    return y


def _plan_call(key: tuple, x: torch.Tensor, call: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Run ``call(alloc=, taken=)`` (the full call on input ``x``) once; where it is plannable (it took a planned
    path, no launch hook is installed) record its launches as the key's plan."""
    if not direct_launch_ok():
        return call()
    specs, allocated, taken = [], [], []

    def alloc(shape, dtype):
        t = torch.empty(shape, dtype=dtype, device=x.device)
        specs.append((tuple(shape), dtype))
        allocated.append(t)
        return t

    with Recording() as rec:
        y = call(alloc=alloc, taken=taken)
    if not taken or taken[0] not in PLANNED_PATHS:
        _remember(key, LinearPlan(tuple(y.shape), y.dtype, (), 0, None))
        return y
    scratch, off = scratch_layout(specs)
    direct = x.device.type == "cuda" and not interpreting()
    if direct and any(call[-1] is None for call in rec.calls):
        return y           # a launch returned no compiled kernel (a stand-in for one): nothing to replay
    try:
        replay = Replay(rec, [x, y, *allocated], direct=direct)
    except ValueError:      # an argument a replay cannot take: this call runs in full every time
        replay = None
    _remember(key, LinearPlan(tuple(y.shape), y.dtype, scratch, off, replay))
    return y


def _remember(key: tuple, plan: LinearPlan) -> None:
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp16 × fp16 -> fp32 output (cuBLAS accumulates in fp32; the fp32 output skips one rounding)."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # torch without out_dtype for mm
        return torch.matmul(a, b).float()


def specialization(rows: int, bits: Bits = 4, wgmma: bool = False) -> tuple:
    """The kernel specializations ``exl3_linear`` uses for ``rows`` (per layer shape, K and codebook;
    ``wgmma``: on a device that runs the wgmma kernel): the path, its launch configuration and the
    Hadamard passes' row block (the kernels do not specialize on ``rows`` itself)."""
    path = choose_path(rows, wgmma=wgmma, bits=bits)
    cfg = (default_mma_config(rows, bits) if path == "mma" else
           _wg.default_wgmma_config(rows, bits) if path == "wgmma" else None)
    return (path, cfg, min(16, next_pow2(rows)))


PREWARM_ROWS = (1, 2, 3, 5, 9, 17, 33, 65)  # one row count per bucket of :func:`specialization`
WGMMA_PREWARM_ROWS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)  # the same where the wgmma kernel runs


def prewarm_rows(device: str | torch.device) -> tuple[int, ...]:
    """One row count per bucket of :func:`specialization` on ``device``."""
    return WGMMA_PREWARM_ROWS if _wg.available(torch.device(device)) else PREWARM_ROWS


def _measured_alloc(device) -> tuple[Alloc, list]:
    """An ``alloc`` for a prewarm call, and the list it records each scratch buffer's workspace room in."""
    scratch: list = []

    def alloc(shape, dt):
        scratch.append(slot_bytes(tuple(shape), dt))
        return torch.empty(shape, dtype=dt, device=device)
    return alloc, scratch


def prewarm(shapes: Iterable[tuple], rows: Optional[Iterable[int]] = None,
            *, device: str | torch.device = "cuda", dtype: torch.dtype = torch.float16) -> int:
    """Compile every specialization needed for layers ``(in_p, out_p, K, codebook)`` (a fused layer:
    ``(in_p, out_p, K, codebook, bounds)``) and row counts (default :func:`prewarm_rows` of the device).

    Runs each distinct (shape, K, codebook, :func:`specialization`) once on random codes; returns
    the number of launches of :func:`exl3_linear` it made, and reserves the current stream's workspace for
    the planned calls' scratch (:func:`reserve_workspace`). Call before CUDA-graph capture.
    """
    from ..format.bits import words16_per_tile
    n = need = 0
    done = set()
    wg = _wg.available(torch.device(device))
    rows = (WGMMA_PREWARM_ROWS if wg else PREWARM_ROWS) if rows is None else tuple(rows)
    for in_p, out_p, bits, codebook, *more in shapes:
        bounds = tuple(more[0]) if more else ()
        w = words16_per_tile(bits)
        trellis = torch.randint(-32768, 32767, (in_p // 16, out_p // 16, w), dtype=torch.int16, device=device)
        suh = torch.ones((len(bounds) + 1, in_p) if bounds else (in_p,), dtype=torch.float16, device=device)
        svh = torch.ones(out_p, dtype=torch.float16, device=device)
        for r in rows:
            key = (in_p, out_p, bits, codebook, bounds, dtype, specialization(r, bits, wg))
            if key in done:
                continue
            done.add(key)
            alloc, scratch = _measured_alloc(device)
            _linear(torch.randn(r, in_p, dtype=dtype, device=device), trellis, suh, svh, codebook, alloc=alloc,
                    bounds=bounds)
            need = max(need, sum(scratch))
            n += 1
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        # scratch grows with the rows; a bucket's rows stay below twice the count prewarmed
        reserve_workspace(device, 2 * need)
    return n


# ---- gated MLP: down(silu(gate(x)) · up(x)) with gate/up fused -------------------------------------------

def gated_mlp_fused(rows: int, gu_bits: Bits, down_bits: Bits, device: torch.device) -> bool:
    """True where :func:`exl3_gated_mlp` runs the fused sequence at ``rows`` (both layers on the mma GEMV: the
    decode's row counts); elsewhere it calls the two layers apart with torch's activation between them."""
    wg = _wg.available(device)
    return choose_path(rows, wgmma=wg, bits=gu_bits) == "mma" and choose_path(rows, wgmma=wg, bits=down_bits) == "mma"


def exl3_gated_mlp(x: torch.Tensor, gu_trellis: torch.Tensor, gu_suh: torch.Tensor, gu_svh: torch.Tensor,
                   d_trellis: torch.Tensor, d_suh: torch.Tensor, d_svh: torch.Tensor, gu_codebook: str,
                   d_codebook: str, inter: int) -> torch.Tensor:
    """``y = down(silu(gate(x)) · up(x))`` for x ``[rows, in_p]`` (padded); returns ``[rows, out_p]`` in x's dtype.

    ``gu_*``: gate and up as one fused layer (:func:`exl3_linear` with ``bounds=(n,)``: gate's ``n`` padded
    columns, then up's ``n``; ``gu_suh`` ``[2, in_p]``); ``d_*``: down, ``[n, out_p]``; ``inter``: the real
    intermediate width (≤ n; down's input columns past it are zero). At the decode's row counts
    (:func:`gated_mlp_fused`) five launches: gate/up's pre-pass and GEMV, one pass for gate/up's output
    rotation, the activation and down's input rotation (:func:`exl3rt.kernels.hadamard.gated_had`), down's GEMV
    and post-pass; g, u, silu(g) and h are rounded to x's dtype where torch would round them, so the result is
    that of the layers run apart to the kernels' rounding. Planned as :func:`planned_linear` is."""
    dev = x.get_device()
    if dev >= 0 and torch._C._cuda_getDevice() != dev:
        with torch.cuda.device(dev):
            return exl3_gated_mlp(x, gu_trellis, gu_suh, gu_svh, d_trellis, d_suh, d_svh, gu_codebook, d_codebook,
                                  inter)
    key = ("gated", gu_trellis.data_ptr(), gu_trellis.shape, gu_trellis.dtype, gu_suh.data_ptr(), gu_suh.dtype,
           gu_svh.data_ptr(), gu_svh.dtype, d_trellis.data_ptr(), d_trellis.shape, d_trellis.dtype, d_suh.data_ptr(),
           d_suh.dtype, d_svh.data_ptr(), d_svh.dtype, x.shape, x.dtype, dev, gu_codebook, d_codebook, inter)
    call = functools.partial(_gated_mlp, x, gu_trellis, gu_suh, gu_svh, d_trellis, d_suh, d_svh, gu_codebook,
                             d_codebook, inter)
    if x.data_ptr() & 15 or not x.is_contiguous():
        return call(planned=True)
    plan = _PLANS.get(key)
    if plan is None:
        return _plan_call(key, x, call)
    if plan.replay is None:
        return call(planned=True)
    return _run_plan(plan, x, dev)


def _gated_mlp(x: torch.Tensor, gu_trellis: torch.Tensor, gu_suh: torch.Tensor, gu_svh: torch.Tensor,
               d_trellis: torch.Tensor, d_suh: torch.Tensor, d_svh: torch.Tensor, gu_codebook: str, d_codebook: str,
               inter: int, *, alloc: Optional[Alloc] = None, taken: Optional[list] = None,
               planned: bool = False) -> torch.Tensor:
    """:func:`exl3_gated_mlp` decided and launched in full (``alloc``, ``taken`` as for :func:`_linear`; ``planned``:
    where the layers run apart, through their own plans)."""
    n = int(gu_trellis.shape[1]) * 8 if gu_trellis.dim() == 3 else 0
    if n == 0 or n % 128:
        raise FormatError(f"gate/up trellis {tuple(gu_trellis.shape)}: two halves of a multiple of 128 columns expected")
    in_p, _, gu_bits = _check(gu_trellis, gu_suh, gu_svh, (n,))
    d_in, out_p, d_bits = _check(d_trellis, d_suh, d_svh)
    if d_in != n or not 0 < inter <= n:
        raise FormatError(f"down trellis {tuple(d_trellis.shape)} takes {d_in} inputs, gate/up give {n} "
                          f"(intermediate width {inter})")
    if x.dim() != 2 or x.shape[1] != in_p:
        raise ValueError(f"x: expected [rows, {in_p}], got {tuple(x.shape)}")
    x = x.contiguous()
    rows = x.shape[0]
    if rows == 0 or not gated_mlp_fused(rows, gu_bits, d_bits, x.device):
        if taken is not None:
            taken.append("apart")
        one = planned_linear if planned else _linear
        gu = one(x, gu_trellis, gu_suh, gu_svh, gu_codebook, bounds=(n,))
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, n:n + inter]
        if inter != n:
            h = torch.nn.functional.pad(h, (0, n - inter))
        return one(h.contiguous(), d_trellis, d_suh, d_svh, d_codebook)
    if taken is not None:
        taken.append("mma")
    if alloc is None:
        def alloc(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=x.device)
    pdl = use_pdl(x.device)
    y = torch.empty((rows, out_p), dtype=x.dtype, device=x.device)
    cfg = default_mma_config(rows, gu_bits)
    xf = alloc((2, xfrag_rows(rows, cfg), in_p), torch.float16)
    acc = alloc((1, rows, 2 * n), torch.float32) if use_atomic(cfg) else None
    _had(x, gu_suh, xf, pre=True, pdl=pdl, frag=2 if cfg.swap else 1, zero=acc)
    z = mma_rotated(xf, gu_trellis, gu_codebook, cfg, rows=rows, acc=acc, alloc=alloc, bounds=(n,))
    dcfg = default_mma_config(rows, d_bits)
    hf = alloc((xfrag_rows(rows, dcfg), n), torch.float16)
    dacc = alloc((1, rows, out_p), torch.float32) if use_atomic(dcfg) else None
    gated_had(z, gu_svh, d_suh, hf, rows=rows, inter=inter, act_dtype=x.dtype, frag=2 if dcfg.swap else 1, pdl=pdl,
              zero=dacc)
    zd = mma_rotated(hf, d_trellis, d_codebook, dcfg, rows=rows, acc=dacc, alloc=alloc)
    _had(zd, d_svh, y, pre=False, splits=zd.shape[0], stride_split=zd.stride(0), pdl=pdl)
    return y


def prewarm_gated(shapes: Iterable[tuple], rows: Optional[Iterable[int]] = None, *,
                  device: str | torch.device = "cuda", dtype: torch.dtype = torch.float16) -> int:
    """:func:`prewarm` for gated MLPs ``(in_p, n, out_p, gate/up K, gate/up codebook, down K, down codebook)``:
    compiles the fused sequence's kernels at every row count of ``rows`` (default :func:`prewarm_rows`) where
    it runs; returns the calls made."""
    from ..format.bits import words16_per_tile
    rows = prewarm_rows(device) if rows is None else tuple(rows)
    wg = _wg.available(torch.device(device))
    n_calls, need, done = 0, 0, set()
    for in_p, n, out_p, gu_bits, gu_cb, d_bits, d_cb in shapes:
        gu = torch.randint(-32768, 32767, (in_p // 16, 2 * n // 16, words16_per_tile(gu_bits)), dtype=torch.int16,
                           device=device)
        d = torch.randint(-32768, 32767, (n // 16, out_p // 16, words16_per_tile(d_bits)), dtype=torch.int16,
                          device=device)
        ones = functools.partial(torch.ones, dtype=torch.float16, device=device)
        for r in rows:
            key = (in_p, n, out_p, gu_bits, gu_cb, d_bits, d_cb, dtype, specialization(r, gu_bits, wg),
                   specialization(r, d_bits, wg))
            if key in done or not gated_mlp_fused(r, gu_bits, d_bits, torch.device(device)):
                continue
            done.add(key)
            alloc, scratch = _measured_alloc(device)
            _gated_mlp(torch.randn(r, in_p, dtype=dtype, device=device), gu, ones((2, in_p)), ones(2 * n), d,
                       ones(n), ones(out_p), gu_cb, d_cb, n, alloc=alloc)
            need = max(need, sum(scratch))
            n_calls += 1
    if torch.device(device).type == "cuda" and n_calls:
        torch.cuda.synchronize(device)
        reserve_workspace(device, 2 * need)
    return n_calls


__all__ = ["MAX_SEGMENTS", "seg_tiles", "exl3_linear", "decode_fp16", "prewarm", "prewarm_rows", "DecodeConfig",
           "MmaConfig", "mma_rotated", "use_atomic", "xfrag_rows", "choose_path", "default_mma_config", "specialization",
           "PREWARM_ROWS", "WGMMA_PREWARM_ROWS", "WGMMA_MIN_ROWS", "WGMMA_MIN_ROWS_WIDE", "MMA_16_BITS", "WGMMA_MAX_ROWS",
           "WGMMA_GAP", "MMA_MAX_ROWS",
           "interpreting", "gemv_splits", "split_buffer", "planned_linear",
           "stream_workspace",
           "reset_plans", "reserve_workspace", "LinearPlan", "PLANNED_PATHS", "WORKSPACE_MAX_BYTES", "MAX_PLANS",
           "exl3_gated_mlp", "gated_mlp_fused", "prewarm_gated"]
