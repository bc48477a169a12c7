"""The forward of an EXL3 vLLM linear: each logical shard's :class:`Exl3Linear`, outputs concatenated.

Pure torch (no vLLM import). ``Exl3Linear`` picks the path: CPU reference (dequantize once, keep,
matmul) or CUDA (exl3rt's Triton kernels). Concatenating ``[x·W_q, x·W_k, x·W_v]`` is exactly the fused
``x·[W_q W_k W_v]`` vLLM expects, and each product is the one the transformers path computes.

On CUDA a layer of several shards with one K and codebook (q/k/v, gate/up) runs as one EXL3 call
(:func:`fuse_layer`: the shards' codes joined as :class:`~exl3rt.runtime.fusion.FusedLinears` does for transformers):
one ``exl3rt::fused_linear`` op whose output, where every shard is a multiple of 128 wide and the rank takes it
whole, already is vLLM's concatenation.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...kernels.ops import call_fused_linear
from ...runtime.fusion import fuse_group


def exl3_apply(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[..., in] -> [..., sum(out)]``: ``cat_j(x · W_j) + bias`` (one GEMM over the layer's dense weight where
    :func:`~exl3rt.integrations.vllm.dense.use_dense_gemm` prepared one)."""
    if getattr(layer, "exl3_dense", False):
        return layer.cpu_linear(x, layer.weight, bias)
    mods = getattr(layer, "exl3", None)
    if mods is None:
        raise RuntimeError(f"{getattr(layer, 'prefix', type(layer).__name__)}: EXL3 layer used before its weights were "
                           f"processed (process_weights_after_loading did not run)")
    windows = getattr(layer, "exl3_windows", None)   # per module: (out lead, width), (in lead, width)
    group = getattr(layer, "exl3_group", None)
    if group is not None:
        y = _fused_apply(group, x, windows)
        return y if bias is None else y + bias.to(y.dtype)
    outs = []
    for j, m in enumerate(mods):
        if windows is None:
            outs.append(m(x))
            continue
        (o_lead, o_n), (i_lead, i_n) = windows[j]
        xm = x
        if (i_lead, i_n) != (0, m.in_features):     # the rank's input columns inside the covered 128-blocks
            xm = torch.nn.functional.pad(x, (i_lead, m.in_features - i_lead - i_n))
        y = m(xm)
        if (o_lead, o_n) != (0, m.out_features):    # the rank's output rows inside the covered 128-blocks
            y = y[..., o_lead: o_lead + o_n]
        outs.append(y)
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def _fused_apply(group, x: torch.Tensor, windows) -> torch.Tensor:
    """The shards' outputs from one fused call: each shard's columns (its rank window inside them), concatenated
    (no copy where they are the whole fused output in order). Shards of one layer share the input, so a window
    here is only ever on the output side."""
    out = call_fused_linear(x, group.trellis, group.suh, group.svh, group.codebook, group.bounds)
    spans = []
    for j, (a, b) in enumerate(group.columns):
        if windows is not None:
            (o_lead, o_n), _ = windows[j]
            a, b = a + o_lead, a + o_lead + o_n
        spans.append((a, b))
    if all(spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1)):
        a, b = spans[0][0], spans[-1][1]
        return out if (a, b) == (0, out.shape[-1]) else out[..., a:b]
    return torch.cat([out[..., a:b] for a, b in spans], dim=-1)


def fuse_layer(layer: nn.Module, devices: tuple[str, ...] = ("cuda",)) -> bool:
    """Run ``layer``'s shards (q/k/v, gate/up) as one fused EXL3 call where they can be (:func:`~exl3rt.runtime.
    fusion.fuse_group`: one K, codebook and device, a device type in ``devices``; the input taken whole); returns
    whether it did. Call before :func:`warm_layer_kernels`, which then compiles the fused specialization."""
    mods = list(getattr(layer, "exl3", ()))
    windows = getattr(layer, "exl3_windows", None)
    if windows is not None and any(i_win != (0, m.in_features) for m, (_, i_win) in zip(mods, windows)):
        return False
    group = fuse_group(mods, devices)
    if group is None:
        return False
    layer.exl3_group = group
    return True


def dense_weight(layer: nn.Module, dtype: torch.dtype, rows: Optional[int] = None) -> Optional[torch.Tensor]:
    """The layer's product as one dense matrix in vLLM's layout, ``[sum of its outputs, in]`` in ``dtype``: each EXL3
    linear's decoded weight (its rank window, as :func:`exl3_apply` takes it), concatenated; ``rows``: zero rows
    appended up to that many (a head's padded vocab rows, logit 0). Where the forward multiplies by kept decoded
    weights (the CPU), one GEMM over this gives what :func:`exl3_apply` computes with one product per linear and a
    concatenation. Each linear's own kept copy is dropped. None where a linear runs the CUDA kernels, keeps no
    decoded weight, or the layer has none."""
    mods = getattr(layer, "exl3", None)
    if not mods or not all(m.multiplies_kept_weight() for m in mods):
        return None
    windows = getattr(layer, "exl3_windows", None)
    parts = []
    for j, m in enumerate(mods):
        w = m.dequantized_weight(dtype)                       # [in, out]
        if windows is not None:
            (o_lead, o_n), (i_lead, i_n) = windows[j]
            w = w[i_lead: i_lead + i_n, o_lead: o_lead + o_n]
        parts.append(w.t())
        m.clear_dequant_cache()
    dense = torch.cat(parts, dim=0)
    if rows is not None and rows > dense.shape[0]:
        dense = torch.nn.functional.pad(dense, (0, 0, 0, int(rows) - dense.shape[0]))
    return dense.contiguous()   # (a single part may be a strided window)


def warm_layer_kernels(layer: nn.Module, dtype: torch.dtype, done: set) -> int:
    """Get ``layer``'s EXL3 linears ready for activations of ``dtype`` (:meth:`Exl3Linear.prepare`): on CUDA
    compile the kernels (each distinct :meth:`~Exl3Linear.kernel_key` once per ``done``), so that vLLM's profile
    run and CUDA-graph capture find every specialization compiled; on the CPU decode the kept dense weights, so
    that the model vLLM compiles multiplies by them instead of decoding in the graph. Returns the launches."""
    return sum(m.prepare(dtype, done) for m in getattr(layer, "exl3", ()))


def exl3_head_apply(layer: nn.Module, x: torch.Tensor, width: int,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A vocab-parallel head: ``[..., hidden] -> [..., width]`` (``width`` = vLLM's rows per partition).

    The rank's real vocab rows come from its EXL3 matrix (none on a rank past the vocab); the partition's
    padded rows get logit 0, as vLLM's unquantized head (zero-filled weight rows) gives them; vLLM drops
    or masks them. ``bias`` (``[width]``, vLLM's padded layout) is added to all.
    """
    mods = getattr(layer, "exl3", None)
    if mods is not None and len(mods) == 0:
        y = x.new_zeros(*x.shape[:-1], int(width))
    else:
        y = exl3_apply(layer, x)
        if y.shape[-1] > width:
            raise RuntimeError(f"{getattr(layer, 'prefix', 'lm_head')}: the EXL3 head gives {y.shape[-1]} logits per "
                               f"token but vLLM's partition holds {width} rows")
        if y.shape[-1] < width:
            y = torch.nn.functional.pad(y, (0, int(width) - y.shape[-1]))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


__all__ = ["dense_weight", "exl3_apply", "exl3_head_apply", "fuse_layer", "warm_layer_kernels"]
