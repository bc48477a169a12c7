"""EXL3 for vLLM's fused-MoE layers (``RoutedExperts``). Imports vLLM.

Two methods share :class:`Exl3MoEMethodBase` (checks, the layer runtime, ``apply``):
:class:`Exl3OnlineMoEMethod` (BF16 experts encoded at load, below) and :class:`Exl3CheckpointMoEMethod`
(pre-quantized EXL3 experts: stored codes, this rank's 128-block slice, per-expert or rank-sliced
checkpoints). Both end in :meth:`Exl3MoEMethodBase.install` with one :class:`Exl3Linear` per expert projection.

Online: ``create_weights`` registers vLLM's usual ``w13_weight [E, 2·I_r, H]`` / ``w2_weight [E, H, I_r]`` on the
``meta`` device with vLLM's expert weight loader (per-expert checkpoint tensors, or fused ones, TP
slicing of the intermediate dim) and turns on vLLM's layer-wise online processing: once all experts of
the layer are in, vLLM materializes the layer, replays the loads and calls
:meth:`process_weights_after_loading`, which encodes every expert's gate/up/down through exl3rt's
:class:`~exl3rt.runtime.online.OnlineEncoder` (cache hit or encode + publish) and builds the layer's
:class:`~exl3rt.integrations.vllm.moe_experts.Exl3VllmMoE`; the BF16 tensors are then dropped. Peak extra
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
from ...format.errors import FormatError
from ...runtime.linear import Exl3Linear
from ._compat import FusedMoEMethodBase, initialize_online_processing, set_weight_attrs
from .moe_experts import (FIELDS, GATED, SHARD_PROJS, UNGATED, ExpertSlice, Exl3VllmMoE, StoredExperts, VllmExpert,
                      activation, expert_slice, rank_layer_experts)
from .shards import ShardError

if TYPE_CHECKING:
    from .quant_config import Exl3VllmConfig

log = logging.getLogger("exl3rt.vllm")


def activation_name(moe: Any) -> str:
    """The name of a vLLM MoE layer's activation (``"silu"`` when it names none)."""
    act = getattr(moe, "activation", "silu")
    return str(getattr(act, "value", act))


class Exl3MoEMethodBase(FusedMoEMethodBase):
    """What both EXL3 fused-MoE methods share: the checks, the layer runtime built from the experts' EXL3
    linears (:meth:`install`), and ``apply`` (vLLM's routing in, this rank's partial sum out)."""

    #: how :meth:`Exl3VllmConfig.summary` records the layer ("online" / "checkpoint")
    how = "exl3"

    def __init__(self, quant_config: "Exl3VllmConfig", prefix: str, moe: Any):
        super().__init__(moe)
        self.quant_config = quant_config
        self.prefix = prefix
        self.act_name = activation_name(moe)
        gated, _ = activation(self.act_name, prefix)
        self.projs = GATED if gated else UNGATED
        if getattr(moe, "has_bias", False):
            raise ShardError(f"{prefix}: MoE experts with biases are not supported by the exl3 plugin yet; keep "
                             f"them unquantized with quantization_config ignore=[{prefix!r}]")
        if getattr(moe, "use_ep", False):
            raise ShardError(f"{prefix}: expert parallelism (--enable-expert-parallel) is not supported by the exl3 "
                             f"plugin yet; use tensor parallelism (each rank holds a 128-block slice of every "
                             f"expert) or keep the experts unquantized")

    def _slice(self, hidden_size: int, intermediate_size_per_partition: int, *, require_blocks: bool) -> ExpertSlice:
        moe = self.moe
        hidden = int(moe.hidden_dim_unpadded or hidden_size)
        sl = expert_slice(self.prefix, hidden, moe.intermediate_size, moe.tp_size, moe.tp_rank,
                          require_blocks=require_blocks)
        if sl.local != intermediate_size_per_partition or hidden != hidden_size:
            raise ShardError(f"{self.prefix}: vLLM pads this MoE layer (hidden {hidden_size}, intermediate per rank "
                             f"{intermediate_size_per_partition}), which the exl3 plugin does not support")
        return sl

    def get_fused_moe_quant_config(self, layer: nn.Module) -> None:
        return None

    def install(self, layer: nn.Module, linears: Sequence[Mapping[str, Exl3Linear]]) -> None:
        """Attach ``linears`` (``[expert][proj]``, this rank's EXL3 matrices) and the layer's runner
        (:class:`Exl3VllmMoE`: MoE runtime or per-expert loop) to ``layer``; record it in the config."""
        cfg = self.quant_config
        sl: ExpertSlice = layer.exl3_slice
        experts = [VllmExpert(dict(ex), self.act_name, layer=self.prefix, expert=e) for e, ex in enumerate(linears)]
        layer.exl3_experts = nn.ModuleList([nn.ModuleDict(dict(ex)) for ex in linears])
        moe = self.moe
        runner = Exl3VllmMoE(self.prefix, experts, hidden=sl.hidden, intermediate=sl.width,
                             top_k=int(moe.experts_per_token), settings=cfg.moe_settings(int(moe.max_num_tokens)),
                             cache=cfg.moe_cache(), owner=cfg.moe_owner(self.prefix),
                             moe_runtime=cfg.moe_runtime, warmed=cfg.moe_warmed)
        runner.attach_to(layer)
        # plan (and warm) now, outside any traced code: vLLM compiles the model around apply(), and a plan made
        # on the first call would be traced into the graph
        dev = next((m.trellis.device for ex in linears for m in ex.values()), None)
        if dev is not None:
            dtype = getattr(layer, "exl3_act_dtype", torch.get_default_dtype())
            runner.plan(dev, dtype)
            if dev.type != "cuda":      # the reference launch multiplies by kept decoded weights: decode them now
                for ex in linears:
                    for m in ex.values():
                        m.prepare(dtype)
        layer.exl3_moe = runner
        layer._already_called_process_weights_after_loading = True
        cfg.note_layer(self.prefix, self.how)
        cfg.moe_paths[self.prefix] = runner.path

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Optional[Any] = None, shared_experts_input: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        runner: Optional[Exl3VllmMoE] = getattr(layer, "exl3_moe", None)
        if runner is None:
            raise RuntimeError(f"{self.prefix}: EXL3 MoE layer used before its weights were processed "
                               f"(process_weights_after_loading did not run)")
        return runner(x, topk_ids, topk_weights)


class Exl3OnlineMoEMethod(Exl3MoEMethodBase):
    """BF16 checkpoint experts -> one EXL3 matrix per expert projection, run by an exl3rt MoE runtime."""

    uses_meta_device = True
    how = "online"

    def __init__(self, quant_config: "Exl3VllmConfig", prefix: str, moe: Any,
                 bits: Sequence[Mapping[str, Bits]]):
        super().__init__(quant_config, prefix, moe)
        self.bits = [dict(b) for b in bits]  # [expert][proj] -> K (experts.expert_bits)

    # ---- vLLM's FusedMoEMethodBase -----------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        layer.exl3_slice = self._slice(hidden_size, intermediate_size_per_partition, require_blocks=False)
        layer.exl3_act_dtype = params_dtype
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
        self.quant_config.plan_encoding(w13.numel() + w2.numel())

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
        linears = []
        for e in range(w13.shape[0]):
            pieces = {"down_proj": w2[e]}
            if len(self.projs) == 3:
                pieces["gate_proj"], pieces["up_proj"] = w13[e, :n_loc], w13[e, n_loc:]
            else:
                pieces["up_proj"] = w13[e]
            ex = {}
            for p in self.projs:
                name = f"{self.prefix}.{e}.{p}"
                enc = encoder.encode(name, pieces[p], self.bits[e][p], device=w13.device, tp=sl.tp(p))
                ex[p] = Exl3Linear.from_encoded(enc, name=name, dequant_cache=cfg.online.dequant_cache)
            linears.append(ex)
        cfg.encoded(w13.numel() + w2.numel(), self.prefix)
        self.install(layer, linears)
        for pname in ("w13_weight", "w2_weight"):
            setattr(layer, pname, nn.Parameter(torch.empty(0, dtype=w13.dtype, device=w13.device),
                                               requires_grad=False))


class Exl3CheckpointMoEMethod(Exl3MoEMethodBase):
    """Pre-quantized EXL3 experts: the stored codes of every expert projection, this rank's 128-block slice.

    Per-expert checkpoints (``<experts>.<e>.<proj>.{trellis,suh,svh,mcg|mul1}``): ``create_weights``
    registers empty placeholders ``w13_<field>`` / ``w2_<field>`` (the names vLLM's expert mapping turns
    those tensors into) whose loader keeps this rank's piece per expert in a :class:`StoredExperts`
    (a dict per expert: trellis widths differ between bitrates). Rank-sliced checkpoints
    (``<experts>.<e>.<proj>.rank<r>.*``, :mod:`exl3rt.moe.rank_checkpoint`): vLLM's weight stream drops them
    (the config's checkpoint weight mapper) and ``process_weights_after_loading`` takes this rank's layer
    from :meth:`Exl3VllmConfig.rank_layer` (only rank r's tensors are read). Either way the codes become
    one :class:`Exl3Linear` per expert projection and the layer runtime of :meth:`install`.
    """

    how = "checkpoint"

    def __init__(self, quant_config: "Exl3VllmConfig", prefix: str, moe: Any, rank_sliced: bool = False):
        super().__init__(quant_config, prefix, moe)
        self.rank_sliced = bool(rank_sliced)
        self.how = "checkpoint (rank-sliced)" if self.rank_sliced else "checkpoint"

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        sl = self._slice(hidden_size, intermediate_size_per_partition, require_blocks=True)
        layer.exl3_slice = sl
        layer.exl3_act_dtype = params_dtype
        layer.exl3_stored = StoredExperts(self.prefix, num_experts, self.projs, sl)
        shard_projs = SHARD_PROJS[len(self.projs) == 3]
        for group in ("w13", "w2"):
            for field in FIELDS:
                p = nn.Parameter(torch.empty(0, dtype=_FIELD_DTYPES[field]), requires_grad=False)
                set_weight_attrs(p, {"weight_loader": self._loader(layer, group, field, shard_projs)})
                layer.register_parameter(f"{group}_{field}", p)

    def _loader(self, layer: nn.Module, group: str, field: str, shard_projs: Mapping[str, str]):
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str = "",
                 shard_id: Optional[str] = None, expert_id: Optional[int] = None, return_success: bool = False
                 ) -> Optional[bool]:
            proj = shard_projs.get(str(shard_id))
            if proj is None or expert_id is None:
                raise FormatError(f"{self.prefix}: {weight_name or group + '_' + field}: shard {shard_id!r} / expert "
                                  f"{expert_id!r} is not a per-expert EXL3 tensor; store experts as "
                                  f"{self.prefix}.<e>.<{'|'.join(self.projs)}>.{{trellis,suh,svh}} (a fused 3-D "
                                  f"EXL3 expert tensor is not supported)")
            layer.exl3_stored.add(int(expert_id), proj, field, loaded_weight, device=param.device)
            return True if return_success else None
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        cfg = self.quant_config
        sl: ExpertSlice = layer.exl3_slice
        stored: StoredExperts = layer.exl3_stored
        if self.rank_sliced:
            device = layer.w13_trellis.device
            encoded = rank_layer_experts(cfg.rank_layer(self.prefix, sl.tp_rank, sl.tp_size), sl, self.projs)
            encoded = [{p: lin.to(device) for p, lin in ex.items()} for ex in encoded]
        else:
            encoded = stored.encoded()
        linears = [{p: Exl3Linear.from_encoded(enc, name=enc.name, dequant_cache=cfg.dequant_cache)
                    for p, enc in ex.items()} for ex in encoded]
        stored.clear()
        del layer.exl3_stored
        for group in ("w13", "w2"):
            for field in FIELDS:
                delattr(layer, f"{group}_{field}")
        self.install(layer, linears)


_FIELD_DTYPES = {"trellis": torch.int16, "suh": torch.float16, "svh": torch.float16, "su": torch.int16,
                 "sv": torch.int16, "mcg": torch.int32, "mul1": torch.int32}


__all__ = ["Exl3CheckpointMoEMethod", "Exl3MoEMethodBase", "Exl3OnlineMoEMethod", "activation_name"]
