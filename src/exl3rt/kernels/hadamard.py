"""The 128-point Hadamard rotations of an EXL3 linear, as Triton kernels (fp32, in registers).

* ``fwht128``: unnormalized Sylvester Walsh–Hadamard transform of each row of a ``[BR, 128]``
  tensor, 7 butterfly stages (reshape/split/join), usable inside other kernels (the tensor-core
  kernel's epilogue applies it to its accumulators);
* ``_had_kernel`` / :func:`had`: the pre-pass ``x' = (x ⊙ suh)·H`` and the post-pass
  ``y = (Σ_split z[split])·H ⊙ svh`` (H = H128/√128) as one launch each. The post-pass reads up to
  ``SB`` split-K partials per load (one ``[SB, BR, 128]`` block, summed in registers), so the
  split-K reduction costs a few load latencies, not one per split;
* ``_gated_kernel`` / :func:`gated_had`: a gated MLP's middle (gate/up's post-pass, ``silu(g)·u``, down's
  pre-pass) as one launch, so that the MLP of a decoder layer runs as five launches instead of seven and two
  torch operations.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..util.ints import next_pow2
from ._triton import HAVE_GDC, HAVE_TRITON, tl, triton
from .launch import launch as launch_kernel  # (had() has a parameter named launch)

if HAVE_GDC:
    from ._triton import gdc_launch_dependents, gdc_wait

if HAVE_TRITON:
    from ..format.hadamard import HAD_SCALE

    HAD_SCALE_C = tl.constexpr(HAD_SCALE)   # 1/sqrt(128), for the passes that scale by it

    @triton.jit
    def fwht128(x, BR: tl.constexpr):
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
    def frag_offsets(m, k, bstride, SWAP: tl.constexpr):
        """fp16 offset of x'[m, k] in the mma GEMV's fragment order (:func:`xfrag_offsets`); ``bstride``:
        int32 words per row block (16 rows, 8 with ``SWAP``)."""
        kk = k % 16
        if SWAP:    # B fragment of x'ᵀ (16 × 8): lane 4g + c holds x'[g, 2c, 2c + 1] and x'[g, 2c + 8, 2c + 9]
            lane = 4 * (m % 8) + (kk % 8) // 2
            off = ((m // 8) * bstride + (k // 16) * 64 + lane * 2) * 2 + (kk // 8) * 2 + kk % 2
        else:       # A fragment (16 × 16): registers x'[g, 2c..], x'[g + 8, 2c..], x'[g, 2c + 8..], x'[g + 8, 2c + 8..]
            rr = m % 16
            lane = 4 * (rr % 8) + (kk % 8) // 2
            off = ((m // 16) * bstride + (k // 16) * 128 + lane * 4) * 2 + (rr // 8 + 2 * (kk // 8)) * 2 + kk % 2
        return off

    @triton.jit
    def zero_slice(zero_ptr, zero_n, pid_c):
        """Program ``pid_c`` of axis 1 zeroes its slice of the ``zero_n`` fp32 at ``zero_ptr`` (the next kernel's
        accumulation buffer, cleared by the pass before it)."""
        per = tl.cdiv(zero_n, tl.num_programs(1))
        z_end = tl.minimum(pid_c * per + per, zero_n)
        zo = tl.arange(0, 512)
        for z0 in range(pid_c * per, z_end, 512):
            tl.store(zero_ptr + z0 + zo, tl.zeros([512], tl.float32), mask=(z0 + zo) < z_end)

    @triton.jit(do_not_specialize=["rows", "splits", "rows_out"])
    def _had_kernel(x_ptr, s_ptr, y_ptr, rows, n, splits, stride_split, PRE: tl.constexpr,
                    BR: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr = False, FRAG: tl.constexpr = 0,
                    rows_out=0, zero_ptr=None, zero_n=0, ZERO: tl.constexpr = False, seg_y=0, ldy=0):
        """One [BR, 128] block: PRE: y = (x ⊙ s)·H; else y = (Σ_split x[split])·H ⊙ s  (H = H128/√128).
        ``PDL`` (programmatic dependent launch): let the next kernel launch now, wait for the previous
        one's writes before reading. ``FRAG`` (PRE only): y is written in the mma GEMV's fragment order
        (1: A fragments of 16-row blocks, 2: B fragments of 8-row blocks), ``rows_out`` rows (the rows past
        ``rows`` zero). ``ZERO`` (PRE only): the programs of row block 0 also zero the ``zero_n`` fp32 at
        ``zero_ptr`` (the next kernel's accumulation buffer), a slice each. Program axis 2 (PRE only) is the
        segment of a fused layer: segment ``g`` scales by ``s[g·n …]`` and writes ``seg_y`` elements further.
        ``ldy``: y's row stride (not FRAG; 0: ``n``)."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        pid_g = tl.program_id(2)
        s_ptr += pid_g * n
        y_ptr += pid_g * seg_y
        if ZERO:
            if (pid_r == 0) & (pid_g == 0):
                zero_slice(zero_ptr, zero_n, pid_c)
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
        y = fwht128(x, BR)
        if not PRE:
            y = y * scale[None, :]
        if FRAG:
            fo = frag_offsets(r[:, None], c[None, :], n * (4 if FRAG == 2 else 8), FRAG == 2)
            tl.store(y_ptr + fo, y.to(y_ptr.dtype.element_ty), mask=(r < rows_out)[:, None])
        else:
            yoffs = r[:, None] * (n if ldy == 0 else ldy) + c[None, :]
            tl.store(y_ptr + yoffs, y.to(y_ptr.dtype.element_ty), mask=rmask[:, None])


    @triton.jit
    def _act_round(x, ACT_DT: tl.constexpr):
        """fp32 ``x`` rounded to the activation dtype (1 fp16, 2 bf16; else unchanged), back in fp32."""
        if ACT_DT == 1:
            x = x.to(tl.float16).to(tl.float32)
        elif ACT_DT == 2:
            x = x.to(tl.bfloat16).to(tl.float32)
        return x

    @triton.jit(do_not_specialize=["rows", "splits", "inter", "rows_out"])
    def _gated_kernel(z_ptr, svh_ptr, suh_ptr, y_ptr, rows, n, splits, stride_split, inter, rows_out,
                      ACT_DT: tl.constexpr, FRAG: tl.constexpr, BR: tl.constexpr, SB: tl.constexpr,
                      PDL: tl.constexpr = False, zero_ptr=None, zero_n=0, ZERO: tl.constexpr = False):
        """The passes between a gated MLP's gate/up layer and its down layer, one [BR, 128] block of the
        intermediate: gate/up's post-pass on both halves of z ``[splits, rows, 2n]`` (gate's columns, then up's),
        ``h = silu(g)·u`` rounded where torch would round it (``ACT_DT``: 1 fp16, 2 bf16, 0 none), columns from
        ``inter`` on zero (down's input padding), then down's pre-pass ``(h ⊙ suh)·H`` into y in the mma
        GEMV's fragment order (``FRAG`` as in ``_had_kernel``, ``rows_out`` rows). ``ZERO``: the programs of row
        block 0 also zero down's accumulation buffer."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        if ZERO:
            if pid_r == 0:
                zero_slice(zero_ptr, zero_n, pid_c)
        r = pid_r * BR + tl.arange(0, BR)
        c = pid_c * 128 + tl.arange(0, 128)
        rmask = r < rows
        offs = r[:, None] * (2 * n) + c[None, :]
        g = tl.zeros([BR, 128], tl.float32)
        u = tl.zeros([BR, 128], tl.float32)
        sb = tl.arange(0, SB)
        for s0 in range(0, splits, SB):
            m = ((s0 + sb) < splits)[:, None, None] & rmask[None, :, None]
            at = z_ptr + (s0 + sb)[:, None, None] * stride_split + offs[None, :, :]
            g += tl.sum(tl.load(at, mask=m, other=0.0), axis=0)
            u += tl.sum(tl.load(at + n, mask=m, other=0.0), axis=0)
        g = fwht128(g, BR) * (tl.load(svh_ptr + c).to(tl.float32) * HAD_SCALE_C)[None, :]
        u = fwht128(u, BR) * (tl.load(svh_ptr + n + c).to(tl.float32) * HAD_SCALE_C)[None, :]
        # what the layers run apart compute: g and u in the activation dtype, silu(g) rounded, then the product
        g = _act_round(g, ACT_DT)
        u = _act_round(u, ACT_DT)
        a = _act_round(g / (1.0 + tl.exp(-g)), ACT_DT)
        h = _act_round(a * u, ACT_DT)
        h = tl.where((c < inter)[None, :], h, 0.0)
        y = fwht128(h * (tl.load(suh_ptr + c).to(tl.float32) * HAD_SCALE_C)[None, :], BR)
        fo = frag_offsets(r[:, None], c[None, :], n * (4 if FRAG == 2 else 8), FRAG == 2)
        tl.store(y_ptr + fo, y.to(y_ptr.dtype.element_ty), mask=(r < rows_out)[:, None])


def had(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, pre: bool, splits: int = 1,
        stride_split: int = 0, pdl: bool = False, frag: int = 0, launch: Optional[tuple[int, int, int]] = None,
        zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """pre: out = (x ⊙ scale)·H per 128-block; post: out = (Σ_split x[split])·H ⊙ scale. One launch.
    ``frag`` (pre only): out ``[rows_pad, n]`` in the mma GEMV's fragment order (1: 16-row A fragments,
    2: 8-row B fragments; :func:`xfrag_offsets`), rows past x's zero. ``zero`` (pre only; contiguous fp32):
    zeroed by the same launch (the accumulation buffer of the kernel that reads ``out``).

    A fused layer's pre-pass (segments g = 0 … G−1, each with its own input scales): ``scale`` ``[G, n]`` and
    ``out`` ``[G, rows_pad, n]``, ``out[g] = (x ⊙ scale[g])·H``, still one launch. A post-pass may write into
    a column slice of a wider tensor (``out`` with row stride ≥ n, unit column stride)."""
    if zero is not None and (not pre or zero.dtype != torch.float32 or not zero.is_contiguous()):
        raise ValueError("had: zero= takes a contiguous fp32 tensor, in a pre-pass")
    groups, seg_y = 1, 0
    if scale.dim() == 2:
        if not pre or out.dim() != 3 or out.shape[0] != scale.shape[0] or not out.is_contiguous():
            raise ValueError("had: scales [G, n] take a pre-pass into a contiguous out [G, rows, n]")
        groups, seg_y = int(scale.shape[0]), out.stride(0)
        out = out[0]
    rows_out, n = out.shape
    ldy = 0
    if not frag and out.stride(0) != n:
        if out.stride(1) != 1:
            raise ValueError("had: out needs a unit column stride")
        ldy = out.stride(0)
    rows = x.shape[0] if frag or pre else rows_out      # (a pre-pass leaves out's rows past x's unwritten)
    # one-warp programs, the best of 20-36 launch configurations per pass (docs/kernels.md, "Tuned constants")
    if launch is not None:     # (rows per program, warps, splits per load): tuning override
        br, warps, sb = launch
    elif pre:
        br, warps, sb = min(8, next_pow2(rows)), 1, 1
    elif splits > 1 or rows <= 8:
        # (also the one-split sums of the atomic 1-8-row GEMV: more rows per program let the next call's GEMV
        # crowd the post-pass out)
        br, warps, sb = 1, 1, min(32, next_pow2(splits))
    else:
        br, warps, sb = min(4, next_pow2(rows)), 1, 1
    grid = (triton.cdiv(rows_out if frag else rows, br), n // 128, groups)
    extra = {"PDL": True, "launch_pdl": True} if pdl else {}
    zargs = {"zero_ptr": zero, "zero_n": zero.numel(), "ZERO": True} if zero is not None else {}
    launch_kernel(_had_kernel, grid, x, scale, out, rows, n, splits, stride_split, PRE=pre, BR=br, SB=sb, num_warps=warps,
                      FRAG=frag, rows_out=rows_out, **extra, **zargs,
                      **({"seg_y": seg_y} if groups > 1 else {}), **({"ldy": ldy} if ldy else {}))
    return out


#: the activation dtypes ``gated_had`` rounds to, as ``_gated_kernel`` numbers them (others: no rounding)
ACT_DTYPES = {torch.float16: 1, torch.bfloat16: 2}


def gated_had(z: torch.Tensor, svh: torch.Tensor, suh: torch.Tensor, out: torch.Tensor, *, rows: int, inter: int,
              act_dtype: torch.dtype, frag: int, pdl: bool = False, zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A gated MLP's middle in one launch: ``g, u`` = the gate/up layer's post-pass of ``z`` (``[splits, rows,
    2n]`` split-K partials, gate's ``n`` columns then up's; ``svh`` ``[2n]``), ``h = silu(g)·u`` rounded as
    torch rounds it in ``act_dtype``, zero from column ``inter`` on, and ``out`` = the down layer's pre-pass
    ``(h ⊙ suh)·H`` (``suh`` ``[n]``) in the mma GEMV's fragment order (``frag`` 1 or 2, ``out`` ``[rows_pad,
    n]``, the rows past ``rows`` zero). ``zero``: down's accumulation buffer, zeroed by the same launch."""
    splits, zrows, n2 = z.shape
    rows_out, n = out.shape
    if n2 != 2 * n or zrows != rows or z.stride(1) != n2 or z.stride(2) != 1 or svh.shape != (n2,) or \
            suh.shape != (n,) or frag not in (1, 2) or not 0 < inter <= n or n % 128:
        raise ValueError(f"gated_had: z {tuple(z.shape)}, svh {tuple(svh.shape)}, suh {tuple(suh.shape)}, out "
                         f"{tuple(out.shape)}, inter {inter}, frag {frag} do not fit")
    if zero is not None and (zero.dtype != torch.float32 or not zero.is_contiguous()):
        raise ValueError("gated_had: zero= takes a contiguous fp32 tensor")
    br = 1 if rows <= 8 or splits > 1 else min(4, next_pow2(rows))   # (as the post-pass)
    sb = min(32, next_pow2(splits))
    grid = (triton.cdiv(rows_out, br), n // 128)
    extra = {"PDL": True, "launch_pdl": True} if pdl else {}
    zargs = {"zero_ptr": zero, "zero_n": zero.numel(), "ZERO": True} if zero is not None else {}
    launch_kernel(_gated_kernel, grid, z, svh, suh, out, rows, n, splits, z.stride(0), inter, rows_out,
                  ACT_DT=ACT_DTYPES.get(act_dtype, 0), FRAG=frag, BR=br, SB=sb, num_warps=1, **extra, **zargs)
    return out


def xfrag_offsets(rows_pad: int, n: int, swap: bool) -> torch.Tensor:
    """``[rows_pad, n]`` int64: the fp16 offset of x'[m, k] in the mma GEMV's fragment order (the Python
    statement of ``frag_offsets``). Per row block (16 rows; 8 with ``swap``) and k-tile (16 columns),
    lane L's registers are contiguous at 16·L bytes (8·L with ``swap``), in the ``mma.m16n8k16`` A
    fragment order (``swap``: the B fragment of x'ᵀ), so that a lane loads them as one vector."""
    m = torch.arange(rows_pad)[:, None]
    k = torch.arange(n)[None, :]
    kk = k % 16
    if swap:
        lane = 4 * (m % 8) + (kk % 8) // 2
        return ((m // 8) * (n * 8) + (k // 16) * 128 + lane * 4) + (kk // 8) * 2 + kk % 2
    rr = m % 16
    lane = 4 * (rr % 8) + (kk % 8) // 2
    return ((m // 16) * (n * 16) + (k // 16) * 256 + lane * 8) + (rr // 8 + 2 * (kk // 8)) * 2 + kk % 2
