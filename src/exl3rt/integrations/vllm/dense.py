"""EXL3 layers served on the CPU through vLLM's own GEMM.

On the CPU an EXL3 linear multiplies by its decoded weight, kept from load time. A vLLM layer of several logical
linears (q/k/v, gate/up) would otherwise run one ``x·W`` per linear plus a concatenation, through torch's matmul,
where vLLM's unquantized layers run one GEMM over a prepacked weight (oneDNN, or sgl-kernel on small shapes):
half of BF16's decode rate on SmolLM2-135M. :func:`use_dense_gemm` gives the layer its decoded product as one dense
weight in vLLM's layout (:func:`~exl3rt.integrations.vllm.forward.dense_weight`) and lets vLLM choose and prepack
the GEMM for it, so the layer runs exactly as an unquantized one of these values. The EXL3 linears stay on the layer
(names, K, codes) without their kept copies.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ._compat import dispatch_cpu_unquantized_gemm
from .forward import dense_weight


def use_dense_gemm(layer: nn.Module, dtype: torch.dtype, rows: Optional[int] = None) -> bool:
    """Where ``layer``'s EXL3 linears multiply by kept decoded weights (the CPU), serve their product through
    vLLM's CPU GEMM as one dense ``[outputs (or rows), in]`` weight (``forward.exl3_apply`` then runs it); returns
    whether it did."""
    dense = dense_weight(layer, dtype, rows)
    if dense is None:
        return False
    layer.weight = nn.Parameter(dense, requires_grad=False)
    if dispatch_cpu_unquantized_gemm is not None and dense.device.type == "cpu":
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)     # sets layer.cpu_linear(x, weight, bias)
    else:
        layer.cpu_linear = torch.nn.functional.linear
    layer.exl3_dense = True
    return True


__all__ = ["use_dense_gemm"]
