"""``Exl3VllmConfig``: vLLM's ``QuantizationConfig`` for ``quantization="exl3"``. Imports vLLM.

Module-level class (vLLM pickles the config into its engine and worker processes). Per process it
keeps one :class:`~exl3rt.runtime.online.OnlineEncoder` (not pickled) and a record of the layers it
served (``summary()``).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

import torch

from ...util.names import HEAD
from ...runtime.config import Exl3Config
from ...runtime.policy import is_embedding_name, is_router_name
from ._compat import (LinearBase, ParallelLMHead, QuantizationConfig, QuantizeMethodBase, RoutedExperts,
                      UnquantizedLinearMethod, WeightsMapper)
from .settings import (guess_mode, head_is_exl3, hf_config_dict, online_config, requested_mode, stored_linears,
                       validate_stored)
from .shards import ShardError, shard_names

log = logging.getLogger("exl3rt.vllm")

#: rank-sliced expert tensors (exl3rt.moe.rank_checkpoint): <prefix>.experts.<E|shared_h>.<proj>.rank<r>.<field>
RANK_SLICED_NAME = re.compile(r"\.experts\.(\d+|shared_h)\.[^.]+\.rank\d+\.[^.]+$")

NAME = "exl3"


class Exl3VllmConfig(QuantizationConfig):
    """EXL3 in vLLM: serve stored codes (``mode="checkpoint"``) or encode BF16 weights at load (``"online"``)."""

    def __init__(self, raw: Optional[dict[str, Any]] = None):
        super().__init__()
        self.raw: dict[str, Any] = dict(raw or {})
        self.mode: str = guess_mode(self.raw)
        self.online: Optional[Exl3Config] = online_config(self.raw) if self.mode == "online" else None
        self.stored: Optional[set[str]] = None  # EXL3 linears in the checkpoint (None: not looked at)
        self.layers: dict[str, str] = {}        # prefix -> mode, filled as layers are processed
        self.moe_paths: dict[str, str] = {}     # experts prefix -> "runtime <tiers>" | "loop: <reason>"
        self.moe_warmed: set[int] = set()       # ids of MoE runtimes warmed in this process
        self.linear_warmed: set[tuple] = set()  # Exl3Linear.kernel_key()s warmed in this process
        self.model_dir: Optional[str] = None   # the checkpoint directory (checkpoint mode, local dirs)
        self.rank_meta = None                   # exl3rt.moe.rank_checkpoint.RankMetadata of a rank-sliced checkpoint
        self._encoder = None
        self._progress = None        # LogProgress of this process's online encoding
        self._moe_cache = None
        self._rank_layers: Optional[dict[str, Any]] = None  # this rank's layers of a rank-sliced checkpoint
        self._stored_hf: Optional[set[str]] = None   # ``stored`` as the checkpoint names it (apply_vllm_mapper)
        self._hf_modules: dict[str, str] = {}        # vLLM module name -> checkpoint name, where vLLM renames

    # ---- pickling: the encoder (cache handles, stats) is per process --------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_encoder"] = None
        state["_moe_cache"] = None
        state["_rank_layers"] = None
        state["moe_warmed"] = set()
        state["linear_warmed"] = set()
        state["_progress"] = None
        state.pop("_exl3rt_moe_scope", None)  # exl3rt.moe owner token: per process
        return state

    # ---- vLLM's QuantizationConfig interface ------------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # the Triton kernels are built and tested for sm_80+; vLLM skips this check on CPU

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Exl3VllmConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: Optional[str],
                                     hf_config: Any = None) -> Optional[str]:
        """A checkpoint whose ``quantization_config.quant_method`` is ``exl3`` is served by this plugin."""
        if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == NAME and user_quant in (None, NAME):
            return NAME
        return None

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: Optional[str] = None) -> None:
        """Look at the checkpoint: stored ``*.trellis`` tensors mean checkpoint mode, none mean online. In checkpoint
        mode the checkpoint gets the checks every EXL3 loader shares (``settings.validate_stored``) before vLLM
        builds the model."""
        stored = stored_linears(model_name)
        if stored is None:
            if self.mode == "checkpoint":
                validate_stored(model_name)  # a local directory whose files could not be listed: why, in one line
            return  # not a local directory: keep the mode the dict implies
        forced = requested_mode(self.raw)
        mode = forced or ("checkpoint" if stored else "online")
        if mode == "checkpoint" and not stored:
            raise ShardError(f"{model_name}: quantization_config asks for EXL3 checkpoint mode but no '*.trellis' "
                             f"tensor is stored there; to encode this BF16 checkpoint at load, pass "
                             f"hf_overrides={{'quantization_config': {{'quant_method': 'exl3', 'bits': 4}}}}")
        if mode == "online" and self.online is None:
            self.online = online_config({k: v for k, v in self.raw.items() if k in ("quant_method", "mode")})
        self.mode, self.stored = mode, stored
        self.model_dir = str(model_name)
        if mode == "checkpoint":
            validate_stored(model_name)
            from ...moe.rank_checkpoint import METADATA_KEY, read_rank_metadata

            qc = (hf_config_dict(model_name) or {}).get("quantization_config")
            if isinstance(qc, dict) and METADATA_KEY in qc:
                self.rank_meta = read_rank_metadata(model_name)

    def get_checkpoint_weight_mapper(self):  # type: ignore[override]  (a staticmethod in vLLM's base class)
        """vLLM's mapper, plus: rank-sliced expert tensors are dropped from vLLM's weight stream (this rank's
        are read by :meth:`rank_layer`; other ranks' are never kept)."""
        mapper = QuantizationConfig.get_checkpoint_weight_mapper()
        if self.rank_meta is None:
            return mapper
        return mapper | WeightsMapper(orig_to_new_regex={RANK_SLICED_NAME: None})

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        """The model renames its modules from the checkpoint's names (``hf_to_vllm_mapper``, e.g. ``model.`` ->
        ``language_model.model.`` in multimodal wrappers): rename the stored EXL3 linears (and the rank-sliced
        MoE layers) the same way, so that vLLM's layer prefixes find them. Idempotent: always maps the
        checkpoint's own names (vLLM may call it more than once)."""
        def rename(name: str) -> Optional[str]:
            # apply_list: public from vLLM 0.26 on (map_name only from 0.27; 0.26 has _map_name); [] = dropped
            mapped = hf_to_vllm_mapper.apply_list([name + ".trellis"])
            if not mapped:
                return None
            new = mapped[0]
            return new[: -len(".trellis")] if new.endswith(".trellis") else new

        if self.stored is not None:
            if self._stored_hf is None:
                self._stored_hf = set(self.stored)
            renamed = {n: rename(n) for n in self._stored_hf}
            self.stored = {r for r in renamed.values() if r is not None}
            self._hf_modules = {r: n for n, r in renamed.items() if r is not None and r != n}
        if self.rank_meta is not None:
            for n in self.rank_meta.layers:
                r = rename(n)
                if r is not None and r != n:
                    self._hf_modules[r] = n

    def hf_name(self, prefix: str) -> str:
        """The checkpoint's name of vLLM module ``prefix`` (itself unless :meth:`apply_vllm_mapper` renamed it)."""
        return self._hf_modules.get(prefix, prefix)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, RoutedExperts):
            if self.mode == "checkpoint":
                return self._checkpoint_moe_method(layer, prefix)
            return self._online_moe_method(layer, prefix)
        if isinstance(layer, ParallelLMHead):
            if self.mode == "checkpoint" and head_is_exl3(prefix, self.stored, self.raw):
                from .checkpoint_method import Exl3CheckpointHeadMethod

                return Exl3CheckpointHeadMethod(self, prefix, [prefix])
            return None  # a BF16 (or tied) head, or online mode: vLLM's unquantized embedding method
        if not isinstance(layer, LinearBase):
            return None  # embeddings: vLLM's unquantized method
        names = shard_names(prefix, self.packed_modules_mapping) or [prefix]
        if self.mode == "checkpoint":
            return self._checkpoint_method(prefix, names)
        return self._online_method(prefix, names)

    # ---- helpers --------------------------------------------------------------------------------------
    def _online_method(self, prefix: str, names: list[str]) -> QuantizeMethodBase:
        from .online_method import Exl3OnlineLinearMethod

        cfg = self.online
        assert cfg is not None
        skip = [cfg.is_ignored(n) or is_embedding_name(n) or is_router_name(n) or
                (n.rsplit(".", 1)[-1] == HEAD and not cfg.quantize_lm_head) for n in names]
        if all(skip):
            return UnquantizedLinearMethod()
        if any(skip):
            raise ShardError(f"{prefix}: vLLM fuses {names} into one layer, but only some of them are ignored; "
                             f"ignore all of them or none (quantization_config ignore patterns)")
        bits = [cfg.bits_for_module(n) for n in names]
        return Exl3OnlineLinearMethod(self, prefix, names, bits)

    def _online_moe_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        from .moe_experts import GATED, UNGATED, activation, expert_bits
        from .moe_method import Exl3OnlineMoEMethod, activation_name

        cfg = self.online
        assert cfg is not None
        moe = layer.moe_config
        gated, _ = activation(activation_name(moe), prefix)
        bits = expert_bits(cfg, prefix, int(moe.num_logical_experts), GATED if gated else UNGATED)
        if bits is None:
            return None  # ignored: vLLM's unquantized fused-MoE method
        return Exl3OnlineMoEMethod(self, prefix, moe, bits)

    def _checkpoint_moe_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        from .moe_experts import GATED, UNGATED, activation
        from .moe_method import Exl3CheckpointMoEMethod, activation_name

        moe = layer.moe_config
        gated, _ = activation(activation_name(moe), prefix)
        projs = GATED if gated else UNGATED
        moe_prefix = prefix[: -len(".experts")] if prefix.endswith(".experts") else None
        if self.rank_meta is not None and moe_prefix is not None and self.hf_name(moe_prefix) in self.rank_meta.layers:
            from ...moe.rank_checkpoint import RankCheckpointError

            if int(moe.tp_size) != self.rank_meta.tp_size:
                raise RankCheckpointError(
                    f"{prefix}: the checkpoint stores its experts rank-sliced for tensor_parallel_size="
                    f"{self.rank_meta.tp_size}, vLLM runs tensor_parallel_size={moe.tp_size}; serve it with "
                    f"--tensor-parallel-size {self.rank_meta.tp_size}, or re-slice the experts with "
                    f"exl3rt.moe.rank_checkpoint.save_rank_sliced(..., tp_size={moe.tp_size})")
            return Exl3CheckpointMoEMethod(self, prefix, moe, rank_sliced=True)
        if self.stored is None:
            return Exl3CheckpointMoEMethod(self, prefix, moe)
        n = int(moe.num_logical_experts)
        names = [f"{prefix}.{e}.{p}" for e in range(n) for p in projs]
        present = [nm for nm in names if nm in self.stored]
        if not present:
            return None  # BF16 experts in an EXL3 checkpoint: vLLM's unquantized fused-MoE method
        if len(present) != len(names):
            missing = [nm for nm in names if nm not in self.stored]
            raise ShardError(f"{prefix}: {len(present)} of its {len(names)} expert matrices are stored as EXL3 but "
                             f"{missing[:3]}{' …' if len(missing) > 3 else ''} are not (no '.trellis'); vLLM runs a "
                             f"MoE layer's experts as one fused layer: quantize all of them or none")
        return Exl3CheckpointMoEMethod(self, prefix, moe)

    def rank_layer(self, prefix: str, rank: int, tp_size: int):
        """This rank's :class:`~exl3rt.moe.rank_checkpoint.RankLayer` of experts module ``prefix`` (rank-sliced
        checkpoints). The first call reads rank ``rank``'s tensors of every layer (headers of all ranks are
        checked, no other rank's data is read); each layer is handed out once."""
        from ...moe.rank_checkpoint import RankCheckpointError, load_rank_sliced

        if self._rank_layers is None:
            if self.model_dir is None:
                raise RankCheckpointError(f"{prefix}: rank-sliced experts but no local checkpoint directory")
            self._rank_layers = load_rank_sliced(self.model_dir, rank, tp_size, device="cpu")
        moe_prefix = self.hf_name(prefix[: -len(".experts")])
        try:
            return self._rank_layers.pop(moe_prefix)
        except KeyError:
            raise RankCheckpointError(f"{prefix}: not in the rank-sliced checkpoint's layers (or loaded twice); "
                                      f"quantization_config.moe_tp.layers must name {moe_prefix!r}") from None

    @property
    def moe_runtime(self) -> Optional[bool]:
        """``Exl3Config.moe_runtime`` (online) or the checkpoint dict's ``moe_runtime`` (None: loop where needed)."""
        return self.online.moe_runtime if self.online is not None else self.raw.get("moe_runtime")

    def _checkpoint_method(self, prefix: str, names: list[str]) -> QuantizeMethodBase:
        from .checkpoint_method import Exl3CheckpointLinearMethod

        if self.stored is None:
            return Exl3CheckpointLinearMethod(self, prefix, names)
        present = [n in self.stored for n in names]
        if not any(present):
            return UnquantizedLinearMethod()
        if not all(present):
            missing = [n for n, p in zip(names, present) if not p]
            raise ShardError(f"{prefix}: vLLM fuses {names} into one layer, but {missing} are not stored as EXL3 "
                             f"(no '.trellis'); quantize all of them or none")
        return Exl3CheckpointLinearMethod(self, prefix, names)

    @property
    def dequant_cache(self) -> Optional[bool]:
        return self.online.dequant_cache if self.online is not None else self.raw.get("dequant_cache")

    def encoder(self):
        """This process's :class:`OnlineEncoder` (created on first use)."""
        if self._encoder is None:
            from ...runtime.online import OnlineEncoder

            assert self.online is not None, "online encoder requested in checkpoint mode"
            self._encoder = OnlineEncoder(self.online)
        return self._encoder

    def plan_encoding(self, n_weights: int) -> None:
        """A layer made for online encoding: ``n_weights`` more to encode once its weights load."""
        self._load_progress().plan(n_weights)

    def encoded(self, n_weights: int, prefix: str) -> None:
        """``n_weights`` encoded (or read from the cache) for layer ``prefix``: a log line with the ETA every few
        seconds (vLLM shows no progress of its own while a layer is processed)."""
        self._load_progress().update(n_weights, prefix)

    def _load_progress(self):
        if self._progress is None:
            from ...util.progress import LogProgress, visible_logger
            self._progress = LogProgress(visible_logger("exl3rt.vllm.progress"), "exl3rt: online EXL3 encoding",
                                         unit=" weights")
        return self._progress

    # ---- MoE ----------------------------------------------------------------------------------------
    def moe_cache(self):
        """This process's :class:`~exl3rt.moe.MoERuntimeCache` (layers with equal keys share launches)."""
        if self._moe_cache is None:
            from ...moe import MoERuntimeCache, auto_launch_factory

            self._moe_cache = MoERuntimeCache(auto_launch_factory)
        return self._moe_cache

    def moe_owner(self, prefix: str):
        from ...moe import Owner

        return Owner.of(self, prefix)

    def moe_settings(self, max_batched: int):
        """Plans for ``max_batched`` rows (vLLM's ``max_num_batched_tokens``); ``EXL3RT_MOE_*`` tune the rest."""
        from ...moe import MoESettings

        return MoESettings.from_env(max_batched=max_batched)

    def note_layer(self, prefix: str, how: str) -> None:
        self.layers[prefix] = how

    def summary(self) -> dict[str, Any]:
        """Layers served by the plugin in this process, and the encoder's counters (online mode)."""
        out: dict[str, Any] = {"mode": self.mode, "layers": dict(self.layers)}
        if self.moe_paths:
            out["moe"] = dict(self.moe_paths)
        if self._encoder is not None:
            out["online"] = self._encoder.summary()
        return out


__all__ = ["Exl3VllmConfig", "NAME"]
