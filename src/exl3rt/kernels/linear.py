"""EXL3 linear on the GPU: input rotation, decode-on-the-fly GEMV or decode + matmul, output rotation.

    y = x·W,   W = diag(suh)·Hk·Q·Hn·diag(svh)          (format.reconstruct)
      = ((x ⊙ suh)·Hk) · Q · Hn ⊙ svh

``exl3_linear(x, trellis, suh, svh, codebook)``:

1. pre-pass (Triton, one launch): ``x' = (x ⊙ suh)·Hk`` per 128-block, fp32 (GEMV) or fp16 (GEMM);
2. rows <= ``GEMV_MAX_ROWS``: ``_gemv_kernel`` writes fp32 split-K partials ``z[s] = x'·Q[ks, :]``;
   more rows: ``_decode_kernel`` writes Q (fp16, exact) once and ``torch.matmul(x', Q)`` (fp16
   operands, fp32 accumulation in cuBLAS) gives ``z``;
3. post-pass (Triton, one launch): ``y = (Σ_s z[s])·Hn ⊙ svh`` in the output dtype.

The Hadamard products are 7-stage fp32 butterflies in registers (``_fwht128``), so nothing is
rounded to 16 bits between the GEMV's fp32 accumulators and y.

Half-integer K (mul1) runs the same kernels (the group geometry covers it). Every launch shape is
a Triton specialization on (K, codebook, BM, NT, num_warps, dtypes); :func:`prewarm` compiles a
list of layer shapes ahead (e.g. before CUDA-graph capture) and returns how many launches it ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from .. import env
from ..format.bits import Bits, bits_from_trellis, is_half
from ..format.codebooks import check_codebook
from ..format.errors import FormatError
from . import gemv as _g

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

GEMV_MAX_ROWS = 16     # the GEMV kernel's largest row block
GEMV_DISPATCH_ROWS = 4  # exl3_linear uses the GEMV up to this many rows (H200: GEMV 88-125 µs at 4 rows,
                        # 262-340 µs at 16 rows vs 107-131 µs for decode+matmul)


def interpreting() -> bool:
    """True when the kernels were defined for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _g.HAVE_TRITON and type(_g._gemv_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of the GEMV: NT n-tiles (16 columns each) per program, warps, and how many
    programs to aim for when choosing the split of K (0: one split)."""
    nt: int = 16
    num_warps: int = 4
    target_programs: int = 528
    num_stages: int = 3


@dataclass(frozen=True)
class DecodeConfig:
    nt: int = 16
    num_warps: int = 4
    k_per: int = 4


DEFAULT_GEMV = GemvConfig(nt=4, num_warps=1, target_programs=8448)  # best of 16 tried, 4096x14336 K4, H200


def default_gemv_config(rows: int) -> GemvConfig:
    """Per row block: each thread holds (nt·8)/(32·warps) groups of 32 weights; x' loads cost 16·BM
    per k-tile and thread, so more rows want more groups per thread (2-4), fewer warps."""
    bm = min(GEMV_MAX_ROWS, _next_pow2(rows))
    if bm == 1:
        return DEFAULT_GEMV
    if bm <= 4:
        return GemvConfig(nt=8, num_warps=1, target_programs=4224)
    return GemvConfig(nt=16, num_warps=2, target_programs=2112)
DEFAULT_DECODE = DecodeConfig()


if _g.HAVE_TRITON:
    @triton.jit
    def _fwht128(x, BR: tl.constexpr):
        """Unnormalized Sylvester Walsh-Hadamard transform of each row of x [BR, 128] (fp32):
        7 butterfly stages, stage s pairs (i, i + 2^s) as (a + b, a - b)."""
        for s in tl.static_range(7):
            y = tl.reshape(x, [BR, 64 >> s, 2, 1 << s])
            y = tl.permute(y, (0, 1, 3, 2))
            a, b = tl.split(y)
            y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
            x = tl.reshape(y, [BR, 128])
        return x

    @triton.jit
    def _had_kernel(x_ptr, s_ptr, y_ptr, rows, n, splits, stride_split, PRE: tl.constexpr,
                    BR: tl.constexpr):
        """One [BR, 128] block: PRE: y = (x ⊙ s)·H; else y = (Σ_split x[split])·H ⊙ s  (H = H128/√128)."""
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        r = pid_r * BR + tl.arange(0, BR)
        c = pid_c * 128 + tl.arange(0, 128)
        rmask = r < rows
        offs = r[:, None] * n + c[None, :]
        x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
        if not PRE:
            for s in range(1, splits):
                x += tl.load(x_ptr + s * stride_split + offs, mask=rmask[:, None], other=0.0)
        scale = tl.load(s_ptr + c).to(tl.float32) * 0.08838834764831845  # 1/sqrt(128)
        if PRE:
            x = x * scale[None, :]
        y = _fwht128(x, BR)
        if not PRE:
            y = y * scale[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=rmask[:, None])


def _had(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, pre: bool, splits: int = 1,
         stride_split: int = 0) -> torch.Tensor:
    """pre: out = (x ⊙ scale)·H per 128-block; post: out = (Σ_split x[split])·H ⊙ scale. One launch."""
    rows, n = out.shape
    br = min(16, _next_pow2(rows))
    grid = (triton.cdiv(rows, br), n // 128)
    _had_kernel[grid](x, scale, out, rows, n, splits, stride_split, PRE=pre, BR=br,
                      num_warps=1 if br <= 2 else 4)
    return out


def _kernel_bits(bits: Bits) -> tuple[int, int]:
    """(KA, HALF) of a bitrate: K = KA + HALF/2."""
    return (int(bits), 1) if is_half(bits) else (int(bits), 0)


def _cb_args(codebook: str) -> tuple[int, int, int]:
    cb = _g.CODEBOOK_IDS[check_codebook(codebook)]
    mult, add = _g.CB_AFFINE[cb]
    return cb, mult, add


def _use_asm(device: torch.device) -> bool:
    return device.type == "cuda" and not interpreting() and not env.KERNEL_NO_ASM.get()


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _check(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> tuple[int, int, Bits]:
    bits = bits_from_trellis(trellis)
    in_p, out_p = trellis.shape[0] * 16, trellis.shape[1] * 16
    if in_p % 128 or out_p % 128:
        raise FormatError(f"trellis {tuple(trellis.shape)}: in/out widths must be multiples of 128")
    if suh.shape != (in_p,) or svh.shape != (out_p,):
        raise FormatError(f"suh/svh shapes {tuple(suh.shape)}/{tuple(svh.shape)} do not match the trellis "
                          f"[{in_p}, {out_p}]")
    if not trellis.is_contiguous():
        raise FormatError("trellis must be contiguous")
    return in_p, out_p, bits


def gemv_splits(in_tiles: int, n_blocks: int, target_programs: int) -> tuple[int, int]:
    """(splits, k-tiles per split) so that n_blocks·splits is about ``target_programs``."""
    if target_programs <= 0:
        return 1, in_tiles
    splits = max(1, min(in_tiles, math.ceil(target_programs / max(1, n_blocks))))
    k_per = math.ceil(in_tiles / splits)
    return math.ceil(in_tiles / k_per), k_per


def _geometry(trellis: torch.Tensor, codebook: str, nt_max: int):
    """(k-tiles, n-tiles, n-tiles per program (a divisor of n-tiles), kernel K args, codebook args)."""
    in_tiles, tn = int(trellis.shape[0]), int(trellis.shape[1])
    nt = min(nt_max, tn)
    while tn % nt:
        nt //= 2
    return in_tiles, tn, nt, _kernel_bits(bits_from_trellis(trellis)), _cb_args(codebook)


def gemv_rotated(xh: torch.Tensor, trellis: torch.Tensor, codebook: str,
                 cfg: Optional[GemvConfig] = None) -> torch.Tensor:
    """Split-K partials ``z[s] = x'·Q`` (fp32 ``[splits, rows, out_p]``) for fp32 ``xh`` [rows, in_p]."""
    rows, in_p = xh.shape
    cfg = cfg or default_gemv_config(rows)
    in_tiles, tn, nt, (ka, half), (cb, mult, add) = _geometry(trellis, codebook, cfg.nt)
    n_blocks = tn // nt
    bm = min(GEMV_MAX_ROWS, _next_pow2(rows))
    splits, k_per = gemv_splits(in_tiles, n_blocks, cfg.target_programs)
    z = torch.empty((splits, rows, tn * 16), dtype=torch.float32, device=xh.device)
    grid = (n_blocks, splits, triton.cdiv(rows, bm))
    _g._gemv_kernel[grid](xh, trellis.view(torch.int32), z, rows, in_tiles, tn, k_per, xh.stride(0), z.stride(0),
                          KA=ka, HALF=half, CB=cb, MULT=mult, ADD=add, BM=bm, NT=nt,
                          ASM=_use_asm(xh.device), num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages)
    return z


def decode_fp16(trellis: torch.Tensor, codebook: str, cfg: DecodeConfig = DEFAULT_DECODE,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Q = ``format.reconstruct.decode(trellis, K, codebook)`` (fp16 ``[in_p, out_p]``, bit-exact) by Triton."""
    in_tiles, tn, nt, (ka, half), (cb, mult, add) = _geometry(trellis, codebook, cfg.nt)
    k_per = max(1, min(cfg.k_per, in_tiles))
    if out is None:
        out = torch.empty((in_tiles * 16, tn * 16), dtype=torch.float16, device=trellis.device)
    grid = (tn // nt, triton.cdiv(in_tiles, k_per))
    _g._decode_kernel[grid](trellis.view(torch.int32), out, in_tiles, tn, k_per, KA=ka, HALF=half, CB=cb, MULT=mult,
                            ADD=add, NT=nt, ASM=_use_asm(trellis.device), num_warps=cfg.num_warps)
    return out


def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                codebook: str, bits: Optional[Bits] = None, *, gemv_max_rows: int = GEMV_DISPATCH_ROWS,
                gemv_cfg: Optional[GemvConfig] = None, decode_cfg: DecodeConfig = DEFAULT_DECODE,
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``y = x·W`` for x ``[rows, in_p]`` (padded), W the EXL3 layer; returns ``[rows, out_p]`` in x's dtype.

    ``bits`` is only checked against the trellis shape (K always follows from the shape).
    """
    in_p, out_p, kbits = _check(trellis, suh, svh)
    if bits is not None and float(bits) != float(kbits):
        raise FormatError(f"bits={bits} does not match the trellis shape (K = {kbits})")
    if x.dim() != 2 or x.shape[1] != in_p:
        raise ValueError(f"x: expected [rows, {in_p}], got {tuple(x.shape)}")
    x = x.contiguous()
    rows = x.shape[0]
    out_dtype = out_dtype or x.dtype
    y = torch.empty((rows, out_p), dtype=out_dtype, device=x.device)
    if rows == 0:
        return y
    if rows <= min(gemv_max_rows, GEMV_MAX_ROWS):
        xh = torch.empty((rows, in_p), dtype=torch.float32, device=x.device)
        _had(x, suh, xh, pre=True)
        z = gemv_rotated(xh, trellis, codebook, gemv_cfg)
        _had(z, svh, y, pre=False, splits=z.shape[0], stride_split=z.stride(0))
    else:
        xh = torch.empty((rows, in_p), dtype=torch.float16, device=x.device)
        _had(x, suh, xh, pre=True)
        q = decode_fp16(trellis, codebook, decode_cfg)
        z = torch.matmul(xh, q).float() if x.device.type == "cpu" else _mm_fp32(xh, q)
        _had(z, svh, y, pre=False)
    return y


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp16 × fp16 -> fp32 output (cuBLAS accumulates in fp32; the fp32 output skips one rounding)."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # torch without out_dtype for mm
        return torch.matmul(a, b).float()


def prewarm(shapes: Iterable[tuple[int, int, Bits, str]], rows: Iterable[int] = (1, 2, 4, 8, 16, 32),
            *, device: str | torch.device = "cuda", dtype: torch.dtype = torch.float16) -> int:
    """Compile every specialization needed for layers ``(in_p, out_p, K, codebook)`` and row counts.

    Runs each (shape, rows-bucket) once on random codes; returns the number of launches of
    :func:`exl3_linear` it made. Call before CUDA-graph capture.
    """
    n = 0
    done = set()
    for in_p, out_p, bits, codebook in shapes:
        from ..format.bits import words16_per_tile
        w = words16_per_tile(bits)
        trellis = torch.randint(-32768, 32767, (in_p // 16, out_p // 16, w), dtype=torch.int16, device=device)
        suh = torch.ones(in_p, dtype=torch.float16, device=device)
        svh = torch.ones(out_p, dtype=torch.float16, device=device)
        for r in rows:
            key = (in_p, out_p, bits, codebook, min(GEMV_DISPATCH_ROWS + 1, _next_pow2(r)))
            if key in done:
                continue
            done.add(key)
            exl3_linear(torch.randn(r, in_p, dtype=dtype, device=device), trellis, suh, svh, codebook)
            n += 1
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return n


__all__ = ["exl3_linear", "gemv_rotated", "decode_fp16", "prewarm", "GemvConfig", "DecodeConfig",
           "GEMV_MAX_ROWS", "GEMV_DISPATCH_ROWS", "interpreting", "gemv_splits"]
