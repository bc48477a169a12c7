"""The 128-point Hadamard rotations of an EXL3 linear, as Triton kernels (fp32, in registers).

* ``_fwht128``: unnormalized Sylvester Walsh–Hadamard transform of each row of a ``[BR, 128]``
  tensor, 7 butterfly stages (reshape/split/join), usable inside other kernels (the tensor-core
  kernel's epilogue applies it to its accumulators);
* ``_had_kernel`` / :func:`had`: the pre-pass ``x' = (x ⊙ suh)·H`` and the post-pass
  ``y = (Σ_split z[split])·H ⊙ svh`` (H = H128/√128) as one launch each. The post-pass reads up to
  ``SB`` split-K partials per load (one ``[SB, BR, 128]`` block, summed in registers), so the
  split-K reduction costs a few load latencies, not one per split.
"""

from __future__ import annotations

import torch

from ..util.ints import next_pow2
from ._triton import HAVE_GDC, HAVE_TRITON, tl, triton

if HAVE_GDC:
    from ._triton import gdc_launch_dependents, gdc_wait

if HAVE_TRITON:
    from ..format.hadamard import HAD_SCALE

    HAD_SCALE_C = tl.constexpr(HAD_SCALE)   # 1/sqrt(128), for the passes that scale by it

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

    @triton.jit(do_not_specialize=["rows", "splits"])
    def _had_kernel(x_ptr, s_ptr, y_ptr, rows, n, splits, stride_split, PRE: tl.constexpr,
                    BR: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr = False):
        """One [BR, 128] block: PRE: y = (x ⊙ s)·H; else y = (Σ_split x[split])·H ⊙ s  (H = H128/√128).
        ``PDL`` (programmatic dependent launch): let the next kernel launch now, wait for the previous
        one's writes before reading."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        r = pid_r * BR + tl.arange(0, BR)
        c = pid_c * 128 + tl.arange(0, 128)
        rmask = r < rows
        offs = r[:, None] * n + c[None, :]
        if PRE:
            x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
        else:
            x = tl.zeros([BR, 128], tl.float32)
            sb = tl.arange(0, SB)
            for s0 in range(0, splits, SB):
                sm = (s0 + sb) < splits
                blk = tl.load(x_ptr + (s0 + sb)[:, None, None] * stride_split + offs[None, :, :],
                              mask=sm[:, None, None] & rmask[None, :, None], other=0.0)
                x += tl.sum(blk, axis=0)
        scale = tl.load(s_ptr + c).to(tl.float32) * HAD_SCALE_C
        if PRE:
            x = x * scale[None, :]
        y = _fwht128(x, BR)
        if not PRE:
            y = y * scale[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=rmask[:, None])


def had(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, pre: bool, splits: int = 1,
        stride_split: int = 0, pdl: bool = False) -> torch.Tensor:
    """pre: out = (x ⊙ scale)·H per 128-block; post: out = (Σ_split x[split])·H ⊙ scale. One launch."""
    rows, n = out.shape
    # post-pass: at most 4 rows per program (more programs, each summing SB splits per load: ~64
    # fp32 of the [SB, BR, 128] block per thread); the pre-pass reads one value per element
    br = min(16 if pre else 4, next_pow2(rows))
    warps = 1 if br <= 2 else 4
    sb = 1 if pre else min(max(1, (64 * 32 * warps) // (br * 128)), next_pow2(splits))
    grid = (triton.cdiv(rows, br), n // 128)
    extra = {"PDL": True, "launch_pdl": True} if pdl else {}
    _had_kernel[grid](x, scale, out, rows, n, splits, stride_split, PRE=pre, BR=br, SB=sb, num_warps=warps, **extra)
    return out
