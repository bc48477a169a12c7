"""Pre-quantized EXL3 linears in vLLM: stored codes (trellis/suh/svh + codebook marker) per logical shard.

The layer gets empty placeholder parameters named like the stored tensors (``trellis``, ``suh``,
``svh``, legacy ``su``/``sv``, markers ``mcg``/``mul1``), so vLLM's weight mapping routes
``…q_proj.trellis`` to ``qkv_proj.trellis`` with shard id ``"q"``. Their loader keeps this rank's piece
of each tensor (:func:`~exl3rt.integrations.vllm.slicing.rank_piece`, 128-block aligned) per shard;
K comes from each trellis, so every tensor can have its own bitrate. ``process_weights_after_loading``
builds one :class:`Exl3Linear` per shard and drops the placeholders.

:class:`Exl3CheckpointHeadMethod` is the same for vLLM's ``ParallelLMHead`` (a quantized ``lm_head``): one
EXL3 matrix of this rank's real vocab rows (column-parallel over the vocab, 128-row aligned), its output
zero-padded to vLLM's rows per partition.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from ...format.codebooks import MARKERS
from ...format.encoded import EncodedLinear
from ...format.errors import FormatError
from ...runtime.linear import Exl3Linear
from ._compat import LinearMethodBase, set_weight_attrs
from .dense import use_dense_gemm
from .forward import exl3_apply, exl3_head_apply, fuse_layer, warm_layer_kernels
from .layout import plan_shards
from .shards import block_cover, check_block_aligned, head_shard
from .slicing import rank_piece

if TYPE_CHECKING:
    from .quant_config import Exl3VllmConfig

log = logging.getLogger("exl3rt.vllm")

_PLACEHOLDER_DTYPES = {"trellis": torch.int16, "suh": torch.float16, "svh": torch.float16, "su": torch.int16,
                       "sv": torch.int16, "mcg": torch.int32, "mul1": torch.int32}


class Exl3CheckpointLinearMethod(LinearMethodBase):
    """Serves stored EXL3 codes (exl3rt / exllamav3 checkpoints), TP-sliced on 128-blocks."""

    def __init__(self, quant_config: "Exl3VllmConfig", prefix: str, names: Sequence[str]):
        self.quant_config = quant_config
        self.prefix = prefix
        self.names = list(names)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        layer.exl3_act_dtype = params_dtype
        self._placeholders(layer, plan_shards(layer, self.prefix, self.names, input_size_per_partition,
                                              output_partition_sizes))

    def _placeholders(self, layer: nn.Module, rank_shards: list) -> None:
        """The stored pieces this rank loads: each shard's covering 128-blocks (a split inside a block keeps
        the whole block), with the windows of the rank's own rows/columns in them for the forward."""
        covers = [block_cover(spec) for spec in rank_shards]
        shards = [cover for cover, _, _ in covers]
        for cover in shards:
            check_block_aligned(cover, self.prefix)
        layer.exl3_windows = [(out_w, in_w) for _, out_w, in_w in covers]
        layer.exl3_shards = shards
        layer.exl3_parts = [dict() for _ in shards]
        for part, dtype in _PLACEHOLDER_DTYPES.items():
            p = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            set_weight_attrs(p, {"weight_loader": self._loader(layer, part)})
            layer.register_parameter(part, p)

    def _loader(self, layer: nn.Module, part: str):
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Optional[object] = None) -> None:
            sid = loaded_shard_id if loaded_shard_id is not None else getattr(loaded_weight, "shard_id", None)
            shards = layer.exl3_shards
            if not shards:
                return  # a head rank past the vocab: no rows of this tensor are kept
            idx = next((i for i, s in enumerate(shards) if s.shard_id == sid), None)
            if idx is None:
                if sid is None and len(shards) == 1:
                    idx = 0
                else:
                    raise FormatError(f"{self.prefix}.{part}: shard id {sid!r} is not one of "
                                      f"{[s.shard_id for s in shards]}; a fused EXL3 tensor on disk is not supported, "
                                      f"store q/k/v (gate/up) as separate linears")
            spec = shards[idx]
            if part in ("mcg", "mul1"):
                value = int(loaded_weight.reshape(-1)[0].item()) & 0xFFFFFFFF
                if value != MARKERS[part] & 0xFFFFFFFF:
                    raise FormatError(f"{spec.name}.{part}: codebook marker is {value:#x}, expected "
                                      f"{MARKERS[part] & 0xFFFFFFFF:#x}")
                layer.exl3_parts[idx]["codebook"] = part
                return
            layer.exl3_parts[idx][part] = rank_piece(part, loaded_weight, spec).to(param.device)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        modules = []
        for spec, parts in zip(layer.exl3_shards, layer.exl3_parts):
            suh = parts.get("suh", parts.get("su"))
            svh = parts.get("svh", parts.get("sv"))
            missing = [n for n, t in (("trellis", parts.get("trellis")), ("suh", suh), ("svh", svh)) if t is None]
            if missing:
                raise FormatError(f"{spec.name}: the checkpoint has no {', '.join(spec.name + '.' + m for m in missing)}; "
                                  f"this linear is not stored as EXL3 (add it to the checkpoint or re-quantize it)")
            enc = EncodedLinear(trellis=parts["trellis"], suh=suh, svh=svh, codebook=parts.get("codebook", "3inst"),
                                in_features=spec.in_features, out_features=spec.out_features, name=spec.name)
            modules.append(Exl3Linear.from_encoded(enc, name=spec.name,
                                                   dequant_cache=self.quant_config.dequant_cache))
        layer.exl3 = nn.ModuleList(modules)
        for part in _PLACEHOLDER_DTYPES:
            delattr(layer, part)
        del layer.exl3_parts
        # compile every kernel specialization now: vLLM's profile run and CUDA-graph capture follow
        dtype = getattr(layer, "exl3_act_dtype", torch.get_default_dtype())
        fuse_layer(layer)             # CUDA: q/k/v or gate/up as one EXL3 call
        warm_layer_kernels(layer, dtype, self.quant_config.linear_warmed)
        # CPU: the decoded product through vLLM's own GEMM (a head's padded vocab rows as zero rows: logit 0)
        use_dense_gemm(layer, dtype, getattr(layer, "exl3_width", None))
        layer._already_called_process_weights_after_loading = True
        self.quant_config.note_layer(self.prefix, "checkpoint")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return exl3_apply(layer, x, bias)


class Exl3CheckpointHeadMethod(Exl3CheckpointLinearMethod):
    """A stored EXL3 ``lm_head`` as vLLM's ``ParallelLMHead``: this rank's vocab rows, padded rows give logit 0.

    vLLM pads the vocab (to 64 by default) and splits the padded vocab evenly over TP ranks; rank r's real
    rows are ``shard_indices.org_vocab_start_index .. org_vocab_end_index``. The rank holds the stored codes
    of the whole 128-row blocks covering them (:func:`~.shards.block_cover`; a split inside a block shares
    that block with the neighbouring rank) and keeps its own rows of their logits.
    """

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        idx = layer.shard_indices
        if int(getattr(layer, "num_added_embeddings", 0)):
            raise FormatError(f"{self.prefix}: an EXL3 lm_head with added (LoRA) vocabulary rows is not supported; "
                              f"serve it without LoRA extra vocab, or re-quantize with --head-bits 16")
        spec = head_shard(self.names[0], int(layer.org_vocab_size), int(input_size_per_partition),
                          int(idx.org_vocab_start_index), int(idx.org_vocab_end_index),
                          int(getattr(layer, "tp_size", 1)), int(getattr(layer, "tp_rank", 0)))
        layer.exl3_width = int(sum(output_partition_sizes))
        layer.exl3_act_dtype = params_dtype
        self._placeholders(layer, [spec] if spec is not None else [])   # none on a rank past the vocab

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        """The config says tied but the checkpoint stores its own EXL3 head: serve the stored head (vLLM does the
        same for a stored ``lm_head.weight``); the embedding stays as loaded."""
        log.warning("%s: config.json says tie_word_embeddings=true, but the checkpoint stores %s as EXL3; serving "
                    "the stored head (set tie_word_embeddings to false to silence this)", self.prefix, self.prefix)
        return layer

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return exl3_head_apply(layer, x, layer.exl3_width, bias)


__all__ = ["Exl3CheckpointLinearMethod", "Exl3CheckpointHeadMethod"]
