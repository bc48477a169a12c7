"""Online EXL3 for one vLLM linear: BF16 weight on ``meta``, encoded per logical shard once loaded.

vLLM's layer-wise online processing (``initialize_online_processing``) buffers the checkpoint
tensors of a layer and, once all are there, materializes the layer, replays the loads and calls
:meth:`process_weights_after_loading` right away: peak extra memory is about one layer of BF16.
Each logical shard's rows (``q_proj`` of ``qkv_proj``, this rank's slice) go through
:class:`exl3rt.runtime.online.OnlineEncoder` (cache hit or encode + publish) into an
:class:`~exl3rt.runtime.linear.Exl3Linear`; the BF16 weight is then dropped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from ...format.bits import Bits
from ...runtime.linear import Exl3Linear
from ._compat import LinearMethodBase, ModelWeightParameter, initialize_online_processing
from .layout import plan_shards
from .dense import use_dense_gemm
from .forward import exl3_apply, fuse_layer, warm_layer_kernels

if TYPE_CHECKING:
    from .quant_config import Exl3VllmConfig

log = logging.getLogger("exl3rt.vllm")


class Exl3OnlineLinearMethod(LinearMethodBase):
    """BF16 checkpoint linear -> EXL3 codes at load (one :class:`Exl3Linear` per logical shard)."""

    uses_meta_device = True

    def __init__(self, quant_config: "Exl3VllmConfig", prefix: str, names: Sequence[str], bits: Sequence[Bits]):
        self.quant_config = quant_config
        self.prefix = prefix
        self.names = list(names)
        self.bits = list(bits)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        layer.exl3_shards = plan_shards(layer, self.prefix, self.names, input_size_per_partition,
                                        output_partition_sizes)
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, device="meta", dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=extra_weight_attrs.get("weight_loader"))
        layer.register_parameter("weight", weight)
        initialize_online_processing(layer)
        self.quant_config.plan_encoding(weight.numel())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        w = layer.weight.data
        if w.device.type == "meta":
            raise RuntimeError(f"{self.prefix}: its weight was never loaded from the checkpoint (still on the meta "
                               f"device); check that the checkpoint has {', '.join(n + '.weight' for n in self.names)}")
        encoder = self.quant_config.encoder()
        cfg = encoder.config
        modules = []
        for spec, k in zip(layer.exl3_shards, self.bits):
            piece = w[spec.out_offset: spec.out_offset + spec.out_features]
            enc = encoder.encode(spec.name, piece, k, device=w.device,
                                 tp=None if spec.is_whole else (spec.tp_size, spec.tp_rank, spec.bounds))
            modules.append(Exl3Linear.from_encoded(enc, name=spec.name, dequant_cache=cfg.dequant_cache))
        layer.exl3 = nn.ModuleList(modules)
        self.quant_config.encoded(w.numel(), self.prefix)
        # compile every kernel specialization now: vLLM's profile run and CUDA-graph capture follow
        fuse_layer(layer)             # CUDA: q/k/v or gate/up as one EXL3 call
        warm_layer_kernels(layer, w.dtype, self.quant_config.linear_warmed)
        layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)
        use_dense_gemm(layer, w.dtype)           # CPU: the decoded product through vLLM's own GEMM
        layer._already_called_process_weights_after_loading = True
        self.quant_config.note_layer(self.prefix, "online")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return exl3_apply(layer, x, bias)


__all__ = ["Exl3OnlineLinearMethod"]
