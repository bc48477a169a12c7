"""Online EXL3 for vLLM's fused-MoE layers (``RoutedExperts``): BF16 experts encoded at load. Imports vLLM.

``create_weights`` registers vLLM's usual ``w13_weight [E, 2·I_r, H]`` / ``w2_weight [E, H, I_r]`` on the
``meta`` device with vLLM's expert weight loader (per-expert checkpoint tensors, or fused ones, TP
slicing of the intermediate dim) and turns on vLLM's layer-wise online processing: once all experts of
the layer are in, vLLM materializes the layer, replays the loads and calls
:meth:`process_weights_after_loading`, which encodes every expert's gate/up/down through exl3rt's
:class:`~exl3rt.runtime.online.OnlineEncoder` (cache hit or encode + publish) and builds the layer's
:class:`~exl3rt.integrations.vllm.experts.Exl3VllmMoE`; the BF16 tensors are then dropped. Peak extra
memory while loading is one MoE layer of BF16.

``apply`` gets vLLM's routing (``topk_ids``/``topk_weights`` from the layer's router) and returns this
rank's partial sum; vLLM's MoE runner adds shared experts and all-reduces over TP (no modular
kernel is set, so it never takes the output as reduced).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch
from torch import nn

from ...format.bits import Bits
from ...runtime.linear import Exl3Linear
from ._compat import FusedMoEMethodBase, initialize_online_processing, set_weight_attrs
from .experts import GATED, UNGATED, Exl3VllmMoE, VllmExpert, activation, expert_slice
from .shards import ShardError

if TYPE_CHECKING:
    from .config import Exl3VllmConfig

log = logging.getLogger("exl3rt.vllm")


def _activation_name(moe: Any) -> str:
    act = getattr(moe, "activation", "silu")
    return str(getattr(act, "value", act))


class Exl3OnlineMoEMethod(FusedMoEMethodBase):
    """BF16 checkpoint experts -> one EXL3 matrix per expert projection, run by an exl3rt MoE runtime."""

    uses_meta_device = True

    def __init__(self, quant_config: "Exl3VllmConfig", prefix: str, moe: Any,
                 bits: Sequence[Mapping[str, Bits]]):
        super().__init__(moe)
        self.quant_config = quant_config
        self.prefix = prefix
        self.act_name = _activation_name(moe)
        gated, _ = activation(self.act_name, prefix)
        self.projs = GATED if gated else UNGATED
        if getattr(moe, "has_bias", False):
            raise ShardError(f"{prefix}: MoE experts with biases are not supported by the exl3 plugin yet; keep "
                             f"them unquantized with quantization_config ignore=[{prefix!r}]")
        if getattr(moe, "use_ep", False):
            raise ShardError(f"{prefix}: expert parallelism (--enable-expert-parallel) is not supported by the exl3 "
                             f"plugin yet; use tensor parallelism (each rank holds a 128-block slice of every "
                             f"expert) or keep the experts unquantized")
        self.bits = [dict(b) for b in bits]  # [expert][proj] -> K (experts.expert_bits)

    # ---- vLLM's FusedMoEMethodBase -----------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        moe = self.moe
        hidden = int(moe.hidden_dim_unpadded or hidden_size)
        layer.exl3_slice = expert_slice(self.prefix, hidden, moe.intermediate_size, moe.tp_size, moe.tp_rank)
        if layer.exl3_slice.local != intermediate_size_per_partition or hidden != hidden_size:
            raise ShardError(f"{self.prefix}: vLLM pads this MoE layer (hidden {hidden_size}, intermediate per rank "
                             f"{intermediate_size_per_partition}), which the exl3 plugin does not support")
        attrs = {"weight_loader": extra_weight_attrs["weight_loader"]} if "weight_loader" in extra_weight_attrs else {}
        shards = len(self.projs) - 1
        w13 = nn.Parameter(torch.empty(num_experts, shards * intermediate_size_per_partition, hidden_size,
                                       device="meta", dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        set_weight_attrs(w13, attrs)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size_per_partition, device="meta",
                                      dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w2_weight", w2)
        set_weight_attrs(w2, attrs)
        initialize_online_processing(layer)

    def get_fused_moe_quant_config(self, layer: nn.Module) -> None:
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        if w13.device.type == "meta" or w2.device.type == "meta":
            raise RuntimeError(f"{self.prefix}: its expert weights were never loaded from the checkpoint (still on "
                               f"the meta device); check that the checkpoint has {self.prefix}.<e>.{{"
                               f"{','.join(self.projs)}}}.weight")
        cfg = self.quant_config
        encoder = cfg.encoder()
        sl = layer.exl3_slice
        n_loc = sl.local
        experts, modules = [], []
        for e in range(w13.shape[0]):
            pieces = {"down_proj": w2[e]}
            if len(self.projs) == 3:
                pieces["gate_proj"], pieces["up_proj"] = w13[e, :n_loc], w13[e, n_loc:]
            else:
                pieces["up_proj"] = w13[e]
            linears = {}
            for p in self.projs:
                name = f"{self.prefix}.{e}.{p}"
                enc = encoder.encode(name, pieces[p], self.bits[e][p], device=w13.device, tp=sl.tp(p))
                linears[p] = Exl3Linear.from_encoded(enc, name=name, dequant_cache=cfg.online.dequant_cache)
            experts.append(VllmExpert(linears, self.act_name, layer=self.prefix, expert=e))
            modules.append(nn.ModuleDict(linears))
        layer.exl3_experts = nn.ModuleList(modules)
        moe = self.moe
        runner = Exl3VllmMoE(self.prefix, experts, hidden=sl.hidden, intermediate=n_loc,
                             top_k=int(moe.experts_per_token), settings=cfg.moe_settings(int(moe.max_num_tokens)),
                             cache=cfg.moe_cache(), owner=cfg.moe_owner(self.prefix),
                             moe_runtime=cfg.online.moe_runtime, warmed=cfg.moe_warmed)
        runner.attach_to(layer)
        layer.exl3_moe = runner
        for pname in ("w13_weight", "w2_weight"):
            setattr(layer, pname, nn.Parameter(torch.empty(0, dtype=w13.dtype, device=w13.device),
                                               requires_grad=False))
        layer._already_called_process_weights_after_loading = True
        cfg.note_layer(self.prefix, "online")
        cfg.moe_paths[self.prefix] = runner.path

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Optional[Any] = None, shared_experts_input: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        runner: Optional[Exl3VllmMoE] = getattr(layer, "exl3_moe", None)
        if runner is None:
            raise RuntimeError(f"{self.prefix}: EXL3 MoE layer used before its weights were processed "
                               f"(process_weights_after_loading did not run)")
        return runner(x, topk_ids, topk_weights)


__all__ = ["Exl3OnlineMoEMethod"]
