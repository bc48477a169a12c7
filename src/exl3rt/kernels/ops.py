"""PyTorch custom ops (``torch.ops.exl3rt.*``): what torch.compile, CUDA graphs and vLLM see of an EXL3 layer.

Each op is one opaque node with a fake (meta) implementation, so a compiler never traces into the decode or
a Triton kernel, and settings are read outside the traced code.

``exl3rt::linear(x, trellis, suh, svh, weight, codebook, out_features) -> y``
    ``y = x · W[:in, :out]`` for ``x [..., in]`` (any leading shape), ``W = diag(suh)·Hk·Q·Hn·diag(svh)``
    (:func:`exl3rt.format.reconstruct`); ``y [..., out_features]`` in ``x.dtype``, no bias. ``weight``, when
    given, is that product's dense ``W[:in, :out]`` already decoded in ``x.dtype`` (the CPU path keeps one,
    prepared outside traced code): then ``y = x @ weight``. Otherwise CUDA runs the Triton kernels
    (:func:`exl3rt.kernels.exl3_linear`) and any other device decodes W for the call.

``exl3rt::fused_linear(x, trellis, suh, svh, codebook, bounds) -> y``
    Several layers of one input in one call (:mod:`exl3rt.runtime.fusion`): ``trellis`` theirs concatenated along
    the output tiles, ``suh [segments, in_p]``, ``svh`` concatenated, ``bounds`` the output columns where
    segments 1, 2 … start; ``y [..., out_p]`` (every segment's padded width) with ``y[..., a:b] = x·W_g``.

``exl3rt::gated_mlp(x, gu_trellis, gu_suh, gu_svh, d_trellis, d_suh, d_svh, gu_codebook, d_codebook, inter, out_features) -> y``
    A gated MLP ``down(silu(gate(x)) · up(x))`` in one call: ``gu_*`` gate and up as one fused layer (gate's ``n``
    padded columns, then up's; ``inter ≤ n`` the real intermediate width), ``d_*`` down; ``y [..., out_features]``
    in ``x.dtype``, g, u, silu(g) and the product rounded to it as the layers run apart would
    (:func:`exl3rt.kernels.linear.exl3_gated_mlp`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..format.reconstruct import reconstruct


def linear_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decoded ``W [in, out]`` in ``dtype``, stored as ``nn.Linear`` stores its weight (``[out, in]`` contiguous;
    the result is its ``[in, out]`` view): the layout :func:`linear_impl` multiplies through ``F.linear``, so a
    product with it runs the GEMM (and gives the bits) of an unquantized linear."""
    return w.t().to(dtype).contiguous().t()


def linear_impl(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                weight: Optional[torch.Tensor], codebook: str, out_features: int) -> torch.Tensor:
    """What ``exl3rt::linear`` computes (its implementation)."""
    if weight is None:
        if x.is_cuda:
            return padded_linear(x, trellis, suh, svh, codebook, out_features)
        # decoded for this call, laid out as the kept weight is (Exl3Linear.dequantized_weight): the same product
        weight = linear_weight(reconstruct(trellis, suh, svh, codebook)[:x.shape[-1], :out_features], x.dtype)
    return torch.nn.functional.linear(x, weight.t())       # the GEMM nn.Linear runs on its [out, in] weight


@torch.library.custom_op("exl3rt::linear", mutates_args=())
def linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
           weight: Optional[torch.Tensor], codebook: str, out_features: int) -> torch.Tensor:
    return linear_impl(x, trellis, suh, svh, weight, codebook, out_features)


def call_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                weight: Optional[torch.Tensor], codebook: str, out_features: int) -> torch.Tensor:
    """``torch.ops.exl3rt.linear(...)`` where anything traces (torch.compile, export, a tensor subclass such as
    fake tensors); in plain eager mode its implementation, called directly: the dispatch of a Python custom op
    costs more host time (~20 µs) than the kernels' launches."""
    if type(x) is torch.Tensor and not torch.compiler.is_compiling():
        return linear_impl(x, trellis, suh, svh, weight, codebook, out_features)
    return torch.ops.exl3rt.linear(x, trellis, suh, svh, weight, codebook, out_features)


@linear.register_fake
def _(x, trellis, suh, svh, weight, codebook, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def fused_linear_impl(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str,
                      bounds: list[int]) -> torch.Tensor:
    """What ``exl3rt::fused_linear`` computes (its implementation)."""
    bounds = tuple(bounds)
    out_p = trellis.shape[1] * 16
    if x.is_cuda and _kernel() is not None:
        return padded_linear(x, trellis, suh, svh, codebook, out_p, bounds)
    edges = (0, *bounds, out_p)
    w = torch.cat([reconstruct(trellis[:, a // 16:b // 16].contiguous(), suh[g], svh[a:b], codebook)
                   for g, (a, b) in enumerate(zip(edges[:-1], edges[1:]))], dim=1)
    return torch.matmul(x, w[:x.shape[-1]].to(x.dtype))


@torch.library.custom_op("exl3rt::fused_linear", mutates_args=())
def fused_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str,
                 bounds: list[int]) -> torch.Tensor:
    return fused_linear_impl(x, trellis, suh, svh, codebook, bounds)


@fused_linear.register_fake
def _(x, trellis, suh, svh, codebook, bounds):
    return x.new_empty((*x.shape[:-1], trellis.shape[1] * 16))


def call_fused_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str,
                      bounds: tuple) -> torch.Tensor:
    """``torch.ops.exl3rt.fused_linear(...)`` where anything traces, its implementation directly in plain eager mode
    (as :func:`call_linear`)."""
    if type(x) is torch.Tensor and not torch.compiler.is_compiling():
        return fused_linear_impl(x, trellis, suh, svh, codebook, bounds)
    return torch.ops.exl3rt.fused_linear(x, trellis, suh, svh, codebook, list(bounds))


def gated_mlp_impl(x: torch.Tensor, gu_trellis: torch.Tensor, gu_suh: torch.Tensor, gu_svh: torch.Tensor,
                   d_trellis: torch.Tensor, d_suh: torch.Tensor, d_svh: torch.Tensor, gu_codebook: str, d_codebook: str,
                   inter: int, out_features: int) -> torch.Tensor:
    """What ``exl3rt::gated_mlp`` computes (its implementation)."""
    n = int(gu_trellis.shape[1]) * 8
    if x.is_cuda and _kernel() is not None:
        from .linear import exl3_gated_mlp
        y = exl3_gated_mlp(_padded_rows(x, int(gu_trellis.shape[0]) * 16), gu_trellis, gu_suh, gu_svh, d_trellis,
                           d_suh, d_svh, gu_codebook, d_codebook, inter)
        return _trimmed(y, x.shape, out_features)
    gu = fused_linear_impl(x, gu_trellis, gu_suh, gu_svh, gu_codebook, [n])
    h = torch.nn.functional.silu(gu[..., :inter]) * gu[..., n:n + inter]
    return linear_impl(h, d_trellis, d_suh, d_svh, None, d_codebook, out_features)


@torch.library.custom_op("exl3rt::gated_mlp", mutates_args=())
def gated_mlp(x: torch.Tensor, gu_trellis: torch.Tensor, gu_suh: torch.Tensor, gu_svh: torch.Tensor,
              d_trellis: torch.Tensor, d_suh: torch.Tensor, d_svh: torch.Tensor, gu_codebook: str, d_codebook: str,
              inter: int, out_features: int) -> torch.Tensor:
    return gated_mlp_impl(x, gu_trellis, gu_suh, gu_svh, d_trellis, d_suh, d_svh, gu_codebook, d_codebook, inter,
                          out_features)


@gated_mlp.register_fake
def _(x, gu_trellis, gu_suh, gu_svh, d_trellis, d_suh, d_svh, gu_codebook, d_codebook, inter, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def call_gated_mlp(x: torch.Tensor, gu_trellis: torch.Tensor, gu_suh: torch.Tensor, gu_svh: torch.Tensor,
                   d_trellis: torch.Tensor, d_suh: torch.Tensor, d_svh: torch.Tensor, gu_codebook: str, d_codebook: str,
                   inter: int, out_features: int) -> torch.Tensor:
    """``torch.ops.exl3rt.gated_mlp(...)`` where anything traces, its implementation directly in plain eager mode
    (as :func:`call_linear`)."""
    if type(x) is torch.Tensor and not torch.compiler.is_compiling():
        return gated_mlp_impl(x, gu_trellis, gu_suh, gu_svh, d_trellis, d_suh, d_svh, gu_codebook, d_codebook, inter,
                              out_features)
    return torch.ops.exl3rt.gated_mlp(x, gu_trellis, gu_suh, gu_svh, d_trellis, d_suh, d_svh, gu_codebook, d_codebook,
                                      inter, out_features)


def _padded_rows(x: torch.Tensor, in_p: int) -> torch.Tensor:
    """x as the kernels take it: ``[rows, in_p]``, contiguous, zero past its own width."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if in_p != x.shape[-1]:
        x2 = torch.nn.functional.pad(x2, (0, in_p - x.shape[-1]))
    return x2.contiguous()


def _trimmed(y: torch.Tensor, shape: torch.Size, out_features: int) -> torch.Tensor:
    """The kernels' ``[rows, out_p]`` back in the input's leading ``shape``, trimmed to ``out_features``."""
    if y.shape[1] != out_features:
        y = y[:, :out_features].contiguous()
    return y if len(shape) == 2 else y.view(*shape[:-1], out_features)


def padded_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str,
                  out_features: int, bounds: tuple = ()) -> torch.Tensor:
    """The kernels' contract: flatten to 2-D, zero-pad to ``in_p``, ``[rows, in_p] -> [rows, out_p]``, trim to
    ``out_features``. The Triton kernels on CUDA; elsewhere (or without Triton) the untrimmed W decoded."""
    x2 = _padded_rows(x, trellis.shape[0] * 16)
    kernel = _kernel()
    if kernel is not None and x.is_cuda:
        y = kernel(x2, trellis, suh, svh, codebook, bounds=bounds) if bounds else \
            kernel(x2, trellis, suh, svh, codebook)
    else:
        y = x2 @ reconstruct(trellis, suh, svh, codebook).to(x.dtype)
    return _trimmed(y, x.shape, out_features)


_KERNEL: list = []


def _kernel():
    """:func:`exl3rt.kernels.linear.exl3_linear` (None without Triton), imported on first use: importing it
    loads Triton."""
    if not _KERNEL:
        from .decode import HAVE_TRITON
        if HAVE_TRITON:
            from .linear import exl3_linear
            _KERNEL.append(exl3_linear)
        else:
            _KERNEL.append(None)
    return _KERNEL[0]


__all__ = ["linear", "linear_impl", "linear_weight", "call_linear", "padded_linear", "fused_linear", "fused_linear_impl",
           "call_fused_linear", "gated_mlp", "gated_mlp_impl", "call_gated_mlp"]
