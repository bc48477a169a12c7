"""transformers (5.x) integration: ``from_pretrained(path, quantization_config=Exl3Config(bits=4))``, and
``from_pretrained(<EXL3 checkpoint>)``.

Importing this module registers ``quant_method = "exl3rt"`` (a ``QuantizationConfigMixin`` and an
``HfQuantizer``) with transformers, and ``"exl3"``: EXL3 checkpoints loaded as stored
(:class:`Exl3CheckpointQuantizer`, docs/online.md "Loading EXL3 checkpoints"); registering twice is a no-op.
transformers 5.24 ships no EXL3
method of its own, so the name is free. Two config objects are accepted by ``from_pretrained``:

- :class:`Exl3Config` from this module (a ``QuantizationConfigMixin`` with the runtime fields);
- ``exl3rt.Exl3Config`` (the plain runtime dataclass), which :class:`Exl3HfQuantizer` wraps into the class
  above. Registration is this module's import or :func:`register`, never a side effect of ``import exl3rt``
  (which does not import transformers); before it, that config's ``quant_method`` raises an error naming the import.

How the weights flow (each linear is encoded as its weight loads; the dense model never exists in full):

1. ``_process_model_before_weight_loading`` (model on meta): :func:`exl3rt.runtime.policy.select_targets`
   picks the modules; each is replaced by a placeholder — an ``Exl3Linear`` with meta codes of the
   right shapes plus a meta ``weight`` of the checkpoint's shape (so the checkpoint key still matches
   and transformers routes it to us), or an ``Exl3Experts`` with meta ``gate_up_proj``/``down_proj``.
2. ``param_needs_quantization`` says yes for exactly those placeholder parameters; transformers then
   loads them one at a time (no async prefetch with on-the-fly quantization), runs the model's own
   conversions (e.g. the per-expert merge into ``gate_up_proj``), and calls our op's ``convert``.
3. :class:`Exl3Quantize` ``.convert`` encodes the tensor through the cache (per expert slice for
   fused experts) and returns ``{<module>.trellis, .suh, .svh}`` plus an empty placeholder for the
   dense key, which transformers installs; the dense tensor is dropped when ``convert`` returns.
4. ``_process_model_after_weight_loading`` removes the placeholders, quantizes a tied head if asked
   (``quantize_lm_head`` with tied embeddings: the head is encoded from the embedding and untied),
   checks every selected weight was loaded, plans the MoE runtime of tierable experts
   (:func:`exl3rt.runtime.moe_module.install_moe_runtimes`) and, on CUDA, fuses q/k/v and gate/up and runs each
   Llama-style MLP as one call (:func:`exl3rt.runtime.fusion.fuse_linears`). ``Exl3Config.expert_bits_rule`` is refused
   here: router statistics need the whole model before encoding (use ``quantize_model``).
   ``model.hf_quantizer.summary()`` tells the totals (hits/misses, bits) and which MoE path each experts module
   runs; ``summary(layers=True)`` also names every quantized module.

``model.save_pretrained(dir)`` writes an EXL3 checkpoint (:func:`exl3rt.runtime.export.save_exl3`: the
codes bit for bit, in exllamav3's layout, with ``quant_method: exl3``), the generation config and the tokenizer
files of the local directory the model was loaded from (so ``exl3rt generate --model dir`` runs it): the
model's own ``save_pretrained`` is replaced by that one when loading ends. transformers' generic path
(``PreTrainedModel.save_pretrained`` called on the class) stays refused: it would write our buffers with the
online config, which no loader reads as a checkpoint.

A weight the encoder refuses (NaN/inf values, a bad shape: :class:`exl3rt.encode.errors.EncodeError`) fails
the load, and fast: transformers collects conversion errors, loads on and raises one ``RuntimeError`` with its
load report at the end, so after the first refusal the other weights are passed over instead of encoded (no
hours spent on a load that will fail). The refusal itself — naming the tensor and the fix — is logged (ERROR) as
it happens and is in the report's ``CONVERSION`` entry; inside :func:`refusals_raised`, ``from_pretrained`` raises
it instead of transformers' ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import types
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..encode.errors import EncodeError
from ..format.checkpoint import QUANT_METHOD as CHECKPOINT_METHOD
from ..format.checkpoint import Exl3Checkpoint, LinearInfo
from ..format.encoded import padded_width
from ..format.errors import FormatError
from ..format.validate import validate_checkpoint
from ..runtime.config import QUANT_METHOD
from ..runtime.config import Exl3Config as RuntimeExl3Config
from ..runtime.config import Exl3ConfigError as RuntimeExl3ConfigError
from ..runtime.experts import Exl3Experts
from ..runtime.export import save_exl3
from ..runtime.linear import Exl3Linear
from ..runtime.online import OnlineEncoder, make_cache, progress_label
from ..runtime.moe_module import install_moe_runtimes
from ..runtime.fusion import fuse_linears
from ..runtime.policy import RULE_NEEDS_STATS, ExpertsTarget, LinearTarget, fused_experts_layout, select_targets
from ..runtime.surgery import quantize_linear, replace_module, untie_head
from ..util.tensorfiles import CONFIG_NAME, natural_key
from ..util.progress import Progress
from ..util.units import parse_bytes

log = logging.getLogger("exl3rt.integrations")

_FIELDS = tuple(f for f in RuntimeExl3Config.__dataclass_fields__)


class Exl3Config(QuantizationConfigMixin):
    """transformers-facing twin of :class:`exl3rt.Exl3Config` (same fields, same validation)."""

    def __init__(self, bits=4, codebook="mcg", seed=0, bits_for=None, ignore=None, quantize_lm_head=False,
                 head_bits=6, cache_mode=None, cache_dir=None, encode_device=None, backend="auto",
                 dequant_cache=None, progress=True, expert_bits=None, expert_bits_rule=None, moe_runtime=None,
                 moe_max_batched=4096, **kwargs: Any):
        method = kwargs.pop("quant_method", QUANT_METHOD)
        if str(method) != QUANT_METHOD or kwargs:
            bad = sorted(kwargs) if kwargs else [f"quant_method={method!r}"]
            raise ValueError(f"exl3rt Exl3Config: unknown argument(s) {bad}; valid: {list(_FIELDS)}")
        rt = RuntimeExl3Config(bits=bits, codebook=codebook, seed=seed, bits_for=dict(bits_for or {}),
                               ignore=list(ignore or []), quantize_lm_head=quantize_lm_head, head_bits=head_bits,
                               cache_mode=cache_mode, cache_dir=cache_dir, encode_device=encode_device,
                               backend=backend, dequant_cache=dequant_cache, progress=progress,
                               expert_bits=dict(expert_bits or {}), expert_bits_rule=expert_bits_rule,
                               moe_runtime=moe_runtime, moe_max_batched=moe_max_batched)
        self.quant_method = QUANT_METHOD
        for f in _FIELDS:
            setattr(self, f, getattr(rt, f))

    def to_runtime(self) -> RuntimeExl3Config:
        """The equivalent :class:`exl3rt.Exl3Config`."""
        return RuntimeExl3Config(**{f: getattr(self, f) for f in _FIELDS})

    @classmethod
    def from_runtime(cls, config: RuntimeExl3Config) -> "Exl3Config":
        return cls(**{f: getattr(config, f) for f in _FIELDS})

    def to_dict(self) -> dict[str, Any]:
        return self.to_runtime().to_dict()


_REFUSAL = "exl3rt_encode_error"   # the log record attribute that carries a refused weight's EncodeError


@contextlib.contextmanager
def refusals_raised() -> Iterator[list[EncodeError]]:
    """Inside, ``from_pretrained`` with an exl3rt config raises the encoder's :class:`EncodeError` for the first
    weight it refused (e.g. NaN values; the message names the tensor and the fix) instead of transformers' generic
    ``RuntimeError`` after its load report; the refusal is not logged (the exception says it). Yields the refusals
    caught so far. Other errors pass unchanged."""
    caught: list[EncodeError] = []

    class _Catch(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            exc = getattr(record, _REFUSAL, None)
            if exc is None:
                return True
            caught.append(exc)
            return False

    flt = _Catch()
    log.addFilter(flt)
    try:
        yield caught
    except RuntimeError:
        if caught:
            raise caught[0] from None
        raise
    finally:
        log.removeFilter(flt)


def _as_hf_config(config: Any) -> Exl3Config:
    if isinstance(config, Exl3Config):
        return config
    if isinstance(config, RuntimeExl3Config):
        return Exl3Config.from_runtime(config)
    if isinstance(config, dict):
        return Exl3Config(**config)
    raise TypeError(f"exl3rt: quantization_config must be an exl3rt Exl3Config, got {type(config).__name__}")


def _spent(t: torch.Tensor) -> torch.Tensor:
    """What a dense placeholder key receives once its codes exist: an empty tensor (freed later)."""
    return torch.empty(0, dtype=t.dtype, device=t.device)


class Exl3Quantize(ConversionOps):
    """The per-tensor quantize op transformers calls while loading (see the module docstring, step 3)."""

    def __init__(self, hf_quantizer: "Exl3HfQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], source_patterns: Optional[list[str]] = None,
                target_patterns: Optional[list[str]] = None, full_layer_name: Optional[str] = None,
                model: Optional[nn.Module] = None, **kwargs: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            out.update(self.hf_quantizer.quantize_param(key, value))
        return out


class _Exl3Quantizer(HfQuantizer):
    """What the online and the checkpoint quantizers share: real devices only, compileable, not trainable,
    and transformers' generic save refused (the model's own ``save_pretrained`` writes EXL3)."""

    #: what is being loaded, for the device_map refusal
    loading = "EXL3 layers"

    def validate_environment(self, device_map: Any = None, **kwargs: Any) -> None:
        if isinstance(device_map, dict) and any(str(d) in ("disk", "meta") for d in device_map.values()):
            raise ValueError(f"exl3rt: {self.loading} cannot be placed on 'disk' (or left on 'meta'); "
                             f"use device_map='cpu', 'cuda', or a map of real devices")

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        # the EXL3 layers are custom ops with fake implementations: generate may compile a static-cache step
        return True

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        log.warning("exl3rt: transformers' own save_pretrained cannot write EXL3 codes; call the model's "
                    "save_pretrained (set by exl3rt when it loaded) or exl3rt.runtime.export.save_exl3(model, dir)")
        return False


class Exl3HfQuantizer(_Exl3Quantizer):
    """Online EXL3 quantization inside ``from_pretrained`` (see the module docstring)."""

    loading = "online quantization's layers"

    requires_calibration = False

    def __init__(self, quantization_config: Any, **kwargs: Any):
        quantization_config = _as_hf_config(quantization_config)
        super().__init__(quantization_config, **kwargs)
        if self.pre_quantized:
            raise ValueError("exl3rt: this checkpoint's config.json already names quant_method 'exl3rt', but exl3rt "
                             "online-quantized models are not saved; load the original BF16/FP16 checkpoint")
        self.config: RuntimeExl3Config = quantization_config.to_runtime()
        if self.config.expert_bits_rule is not None:
            raise RuntimeExl3ConfigError(RULE_NEEDS_STATS.format(rule=self.config.expert_bits_rule))
        self.encoder: Optional[OnlineEncoder] = None
        self._pending: dict[str, LinearTarget | ExpertsTarget] = {}  # placeholder param name -> target
        self._done: set[str] = set()
        self._deferred: list[LinearTarget] = []  # tied head: encoded after loading
        self._targets: list[LinearTarget | ExpertsTarget] = []
        self._progress: Optional[Progress] = None
        self._t0 = time.perf_counter()
        self.error: Optional[EncodeError] = None   # the first weight the encoder refused: the load fails

    def param_element_size(self, model: nn.Module, param_name: str, param: torch.Tensor) -> float:
        target = self._pending.get(param_name)
        if target is None:
            return param.element_size()
        if isinstance(target, LinearTarget):
            k = target.bits
        else:  # per-expert K: size for the widest expert
            k = max((b for per in target.bits for b in per.values() if b is not None), default=self.config.bits)
        return float(k) / 8

    # ---- before loading: placeholders --------------------------------------------------------------
    def _encoder(self) -> OnlineEncoder:
        if self.encoder is None:
            self.encoder = OnlineEncoder(self.config, make_cache(self.config))
        return self.encoder

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        cfg = self.config
        self._t0 = time.perf_counter()
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        self._targets = select_targets(model, cfg)
        for target in self._targets:
            module = model.get_submodule(target.name)
            if isinstance(target, LinearTarget):
                if f"{target.name}.weight" in tied:  # a tied head has no checkpoint tensor of its own
                    self._deferred.append(target)
                    continue
                with torch.device("meta"):
                    new = Exl3Linear(target.in_features, target.out_features, target.bits, cfg.codebook,
                                     bias=target.has_bias, dtype=module.weight.dtype, dequant_cache=cfg.dequant_cache,
                                     name=target.name)
                    new.weight = nn.Parameter(torch.empty_like(module.weight), requires_grad=False)
                self._pending[f"{target.name}.weight"] = target
            else:
                new = self._experts_placeholder(module, target)
                self._pending[f"{target.name}.{target.layout.up_param}"] = target
                self._pending[f"{target.name}.down_proj"] = target
            replace_module(model, target.name, new)
        total = sum(t.num_weights for t in self._targets)
        self._progress = Progress(total, progress_label(None), unit="w", enabled=cfg.progress)
        return model

    def _experts_placeholder(self, module: nn.Module, target: ExpertsTarget) -> Exl3Experts:
        lay, cfg = target.layout, self.config
        fn, attrs = Exl3Experts.gate_attrs(module)
        dtype = module.down_proj.dtype
        with torch.device("meta"):
            new = Exl3Experts(lay, module.act_fn, apply_gate=fn, attrs=attrs, name=target.name)
            for e in range(lay.num_experts):
                for proj in lay.projections():
                    out_f, in_f = lay.shape_of(proj)
                    k = target.bits[e][proj]
                    if k is None:
                        child = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
                        child.weight.requires_grad_(False)
                    else:
                        child = Exl3Linear(in_f, out_f, k, cfg.codebook, dequant_cache=cfg.dequant_cache,
                                           name=target.expert_name(e, proj))
                    new.set_projection(e, proj, child)
            for p, shape in lay.param_shapes().items():
                new.register_parameter(p, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
        return new

    # ---- loading: one tensor at a time ------------------------------------------------------------------
    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        return param_name in self._pending

    def get_quantize_ops(self) -> Exl3Quantize:
        return Exl3Quantize(self)

    def quantize_param(self, key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """Codes for the placeholder parameter ``key`` from its loaded tensor ``value`` (step 3)."""
        target = self._pending.get(key)
        if target is None:
            return {key: value}
        if self.error is not None:      # the load already failed: pass over the rest instead of encoding it
            self._done.add(key)
            return {key: _spent(value)}
        try:
            return self._quantize_target(key, value, target)
        except EncodeError as exc:
            self.error = exc
            if self._progress is not None:
                self._progress.close()
            log.error("exl3rt: %s (the load fails; the remaining weights are passed over)", exc,
                      extra={_REFUSAL: exc})
            raise

    def _quantize_target(self, key: str, value: torch.Tensor,
                         target: LinearTarget | ExpertsTarget) -> dict[str, torch.Tensor]:
        enc = self._encoder()
        out: dict[str, torch.Tensor] = {}
        if isinstance(target, LinearTarget):
            mats = {target.name: (value, target.bits)}
        else:
            param = key.rpartition(".")[2]
            mats = {target.expert_name(e, proj): (w, target.bits[e][proj])
                    for e in range(target.layout.num_experts)
                    for proj, w in target.layout.split(param, value, e).items()}
        for name, (w, k) in mats.items():
            if k is None:
                out[f"{name}.weight"] = w.contiguous().clone()
                continue
            codes = enc.encode(name, w, k)
            out.update({f"{name}.trellis": codes.trellis, f"{name}.suh": codes.suh, f"{name}.svh": codes.svh})
            if self._progress is not None:
                self._progress.desc = progress_label(enc.stats)
                self._progress.update(w.numel(), note=name)
        out[key] = _spent(value)
        self._done.add(key)
        return out

    # ---- after loading -------------------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        missing = sorted(k for k in self._pending if k not in self._done)
        if missing:
            raise RuntimeError(f"exl3rt: {len(missing)} selected weight(s) were not in the checkpoint, so they could "
                               f"not be quantized: {missing[:5]}{' …' if len(missing) > 5 else ''}; add their "
                               f"modules to Exl3Config.ignore, or check the checkpoint")
        for key in self._pending:
            prefix, _, param = key.rpartition(".")
            module = model.get_submodule(prefix)
            module._parameters.pop(param, None)  # the dense placeholder (now empty)
        enc = self._encoder()
        for target in self._deferred:
            module = model.get_submodule(target.name)
            new = quantize_linear(module, target, enc, self.config)
            replace_module(model, target.name, new)
            untie_head(model, target.name)
            if self._progress is not None:
                self._progress.desc = progress_label(enc.stats)
                self._progress.update(target.num_weights, note=target.name)
        self.moe = install_moe_runtimes(model, self.config)  # tiered experts -> Exl3MoE (docs/online.md)
        fuse_linears(model)             # on CUDA: q/k/v and gate/up as one call each, a gated MLP as one call
        model.save_pretrained = types.MethodType(save_pretrained_exl3, model)
        enc.stats.modules = len(self._targets)
        enc.stats.seconds = time.perf_counter() - self._t0
        if self._progress is not None:
            self._progress.close()
        s = enc.stats
        log.info("exl3rt: %d matrices in %d modules (%d cache hits, %d encoded; encode %.1f s, read %.1f s)",
                 s.layers, s.modules, s.hits, s.misses, s.encode_seconds, s.read_seconds)
        return model

    def summary(self, layers: bool = False) -> dict[str, Any]:
        """Totals of this load: layers (matrices), modules, hits, misses, encode/read seconds, weights, avg_bits, bpw,
        cache, and ``moe`` (experts module -> "runtime …" or "loop: reason"). ``layers``: also ``names``, every
        quantized module (a model has hundreds: asked for, not printed by default)."""
        out = self._encoder().summary()
        if layers:
            out["names"] = [t.name for t in self._targets]
        out["moe"] = dict(getattr(self, "moe", {}))
        return out


def save_pretrained_exl3(model: nn.Module, save_directory: str | os.PathLike[str], *,
                         max_shard_size: int | str = "8GB", push_to_hub: bool = False, **kwargs: Any) -> None:
    """``model.save_pretrained`` of a model exl3rt quantized: an EXL3 checkpoint plus the generation config and the
    tokenizer files of the local directory the model was loaded from (one already in ``save_directory`` that exl3rt
    did not write, e.g. from ``tokenizer.save_pretrained``, is kept; :func:`exl3rt.runtime.export.source_tokenizer`).

    ``max_shard_size`` as transformers takes it (bytes or "5GB"); other transformers options
    (``safe_serialization``, ``state_dict``, …) do not apply to EXL3 codes and are ignored.
    """
    if push_to_hub:
        raise ValueError("exl3rt: save_pretrained(push_to_hub=True) is not supported; save to a directory, then "
                         "upload it with huggingface_hub's upload_folder")
    gen = getattr(model, "generation_config", None)
    side = {}
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        side["generation_config.json"] = gen.to_json_string(use_diff=True)
    # replaces its own earlier files, as transformers' save_pretrained does; nothing else in the directory
    save_exl3(model, save_directory, max_shard_bytes=parse_bytes(max_shard_size), overwrite=True,
              progress=False, side_texts=side)


# ---- EXL3 checkpoints (quant_method "exl3", as exllamav3 and `exl3rt quantize` write them) ----------------------
_EXPERT_NAME = re.compile(r"(.+)\.(\d+)\.(gate_proj|up_proj|down_proj)")


class Exl3CheckpointConfig(QuantizationConfigMixin):
    """The ``quantization_config`` an EXL3 checkpoint carries (``quant_method: exl3``), kept as it is.

    What loads is read from the checkpoint's own tensors (K from each trellis shape, the codebook from its
    marker), not from these fields: they are the writer's summary (bits, head_bits, codebook, quantizer).
    """

    def __init__(self, quant_method: str = CHECKPOINT_METHOD, **fields: Any):
        if str(getattr(quant_method, "value", quant_method)) != CHECKPOINT_METHOD:
            raise ValueError(f"Exl3CheckpointConfig: quant_method {quant_method!r}, expected {CHECKPOINT_METHOD!r}")
        self.quant_method = CHECKPOINT_METHOD
        self._fields = dict(fields)
        for k, v in fields.items():
            setattr(self, k, v)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": CHECKPOINT_METHOD, **self._fields}


class Exl3CheckpointQuantizer(_Exl3Quantizer):
    """Loads an EXL3 checkpoint into ``Exl3Linear`` / EXL3 expert modules: nothing is encoded.

    Before the model is built, a checkpoint in a local directory gets every check of
    :func:`exl3rt.format.validate.validate_checkpoint` (headers, config.json against the tensors, the values): a
    config that would build a model far larger than its weights, a mislabelled dtype or a NaN is refused before
    anything is allocated (otherwise, e.g. for a Hub ID, the same checks run once transformers names the files).
    Before loading (model on meta), every stored tensor's shape is compared with the model's, and the checkpoint's
    headers say which linears are EXL3: each such
    ``nn.Linear`` becomes an :class:`Exl3Linear` placeholder, each fused experts module whose experts are
    stored per expert (``<experts>.{e}.gate_proj``) an :class:`Exl3Experts` of them. Their buffers are named
    as the checkpoint's tensors, so transformers fills them as they are (int16 trellis, fp16 scales); the
    codebook markers are not module tensors. After loading, every code buffer is checked to have arrived,
    tiered experts get the planned MoE runtime, and ``save_pretrained`` writes EXL3 again.
    """

    requires_calibration = True     # only a checkpoint that is already EXL3
    loading = "EXL3 checkpoints"

    def __init__(self, quantization_config: Any, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)
        self.ckpt: Optional[Exl3Checkpoint] = None
        self.linears: dict[str, Exl3Linear] = {}
        self.bias_dtype: dict[str, torch.dtype] = {}    # linears with a stored bias -> the model's dtype
        self.moe: dict[str, str] = {}

    def update_attn_implementation(self, config: Any) -> Any:
        # the one hook transformers calls with the model's config before it builds the model (``cls(config)``)
        where = getattr(config, "_name_or_path", None)
        if where and (Path(where) / CONFIG_NAME).is_file():
            self.ckpt = validate_checkpoint(where, data=True)
        return super().update_attn_implementation(config)

    def _process_model_before_weight_loading(self, model: nn.Module, checkpoint_files: Any = None,
                                             **kwargs: Any) -> nn.Module:
        if not checkpoint_files:
            raise ValueError("exl3rt: an EXL3 checkpoint loads from its safetensors files; none were given")
        root = Path(checkpoint_files[0]).parent
        if self.ckpt is None or self.ckpt.root.resolve() != root.resolve():
            self.ckpt = validate_checkpoint(root, data=True)
        ckpt = self.ckpt
        _check_shapes(model, ckpt)
        if ckpt.tables:
            raise FormatError(f"{ckpt.tables[0]}.trellis: a quantized table (exllamav3's --embed_bits), which exl3rt "
                              f"does not load; convert with --embed_bits 16 (exllamav3's default)")
        ckpt.check_markers()
        experts: dict[str, dict[tuple[int, str], LinearInfo]] = {}
        for info in ckpt.linears():
            module = _submodule(model, info.name)
            if isinstance(module, nn.Linear):
                _check_widths(info, module.in_features, module.out_features)
                with torch.device("meta"):
                    new = Exl3Linear(module.in_features, module.out_features, info.bits, info.codebook,
                                     bias=info.has_bias, dtype=module.weight.dtype, name=info.name)
                    if info.has_bias:     # stored fp16 at the padded width; trimmed and cast after loading
                        new.bias = nn.Parameter(torch.empty(info.out_padded, dtype=torch.float16),
                                                requires_grad=False)
                        self.bias_dtype[info.name] = module.weight.dtype
                replace_module(model, info.name, new)
                self.linears[info.name] = new
                if info.name.rsplit(".", 1)[-1] == "lm_head":
                    untie_head(model, info.name)
                continue
            m = _EXPERT_NAME.fullmatch(info.name)
            parent = _submodule(model, m.group(1)) if m else None
            if parent is None or fused_experts_layout(parent) is None:
                raise FormatError(f"{info.name}.trellis: the model ({type(model).__name__}) has no linear or "
                                  f"experts module named {info.name}; is this checkpoint made for another "
                                  f"architecture? (config.json names {getattr(model.config, 'architectures', None)})")
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = info
        for name, infos in experts.items():
            replace_module(model, name, self._experts_placeholder(name, model.get_submodule(name), infos))
        _check_complete(model, ckpt)
        unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
        model._keys_to_ignore_on_load_unexpected = unexpected | {r"\.(mcg|mul1)$"}   # codebook markers
        return model

    def _experts_placeholder(self, name: str, module: nn.Module,
                             infos: dict[tuple[int, str], LinearInfo]) -> Exl3Experts:
        lay = fused_experts_layout(module)
        if lay.has_bias:
            raise FormatError(f"{name}: fused expert biases cannot come from a per-expert EXL3 checkpoint")
        fn, attrs = Exl3Experts.gate_attrs(module)
        with torch.device("meta"):
            new = Exl3Experts(lay, module.act_fn, apply_gate=fn, attrs=attrs, name=name)
            for e in range(lay.num_experts):
                for proj in lay.projections():
                    info = infos.get((e, proj))
                    full = f"{name}.{e}.{proj}"
                    if info is None:
                        raise FormatError(f"{full}.trellis: missing from the checkpoint, which stores other experts "
                                          f"of {name}; every expert's {'/'.join(lay.projections())} must be EXL3")
                    out_f, in_f = lay.shape_of(proj)
                    _check_widths(info, in_f, out_f)
                    child = Exl3Linear(in_f, out_f, info.bits, info.codebook, name=full)
                    new.set_projection(e, proj, child)
                    self.linears[full] = child
        return new

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        for name, m in self.linears.items():
            for t in ("trellis", "suh", "svh"):
                if getattr(m, t).device.type == "meta":
                    raise FormatError(f"{name}.{t}: not loaded from the checkpoint (missing from its shards?)")
            if name in self.bias_dtype:
                m.bias = nn.Parameter(m.bias.detach()[: m.out_features].to(self.bias_dtype[name]), requires_grad=False)
            m.encoded()     # validates the loaded tensors (shapes, dtypes), naming the tensor
        self.moe = install_moe_runtimes(model, RuntimeExl3Config())
        fuse_linears(model)
        model.save_pretrained = types.MethodType(save_pretrained_exl3, model)
        return model

    def summary(self, layers: bool = False) -> dict[str, Any]:
        """Totals of the loaded checkpoint (:meth:`exl3rt.format.checkpoint.Exl3Checkpoint.summary`: linears,
        weights, bpw, bytes, codebooks) and ``moe``; nothing was encoded. ``layers``: also ``names``, every EXL3
        linear."""
        out = self.ckpt.summary() if self.ckpt is not None else {}
        if layers:
            out["names"] = sorted(self.linears, key=natural_key)
        out["moe"] = dict(self.moe)
        return out


def plan_checkpoint_load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``from_pretrained(path)`` of the EXL3 checkpoint at ``path`` will build, without reading a weight:
    the model is made on the meta device and given the loader's placeholders, so every check the loader makes
    before reading runs here too (headers and config.json, :func:`~exl3rt.format.validate.validate_checkpoint`;
    shapes against the model, missing or unknown tensors, codebook markers), except the scan of the values.

    Returns ``architecture``, ``linears`` (Exl3Linear names), ``experts`` (Exl3Experts name -> experts),
    ``head`` (K of a quantized head, or None), ``dense`` (linears left unquantized), ``other`` (name -> dtype and
    shape of every other stored tensor)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    ckpt = validate_checkpoint(path, data=False)     # before the model is built from config.json
    config = AutoConfig.from_pretrained(str(path))
    quantizer = Exl3CheckpointQuantizer(Exl3CheckpointConfig(**(getattr(config, "quantization_config", None) or {})))
    quantizer.ckpt = ckpt
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    quantizer._process_model_before_weight_loading(model, checkpoint_files=[str(path / "config.json")])
    ckpt = quantizer.ckpt
    experts = {n: m.num_experts for n, m in model.named_modules() if isinstance(m, Exl3Experts)}
    head = quantizer.linears.get("lm_head")
    return {
        "architecture": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "layers": getattr(config, "num_hidden_layers", None),
        "linears": sorted(quantizer.linears, key=natural_key),
        "experts": experts,
        "head": None if head is None else head.bits,
        "dense": sorted((n for n, m in model.named_modules() if type(m) is nn.Linear), key=natural_key),
        "other": {n: (str(ckpt.tensor_info(n).dtype), tuple(ckpt.tensor_info(n).shape))
                  for n in ckpt.other_tensor_names()},
    }


def _submodule(model: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


_LAYER_INDEX = re.compile(r"\.\d+\.")


def _check_complete(model: nn.Module, ckpt: Exl3Checkpoint) -> None:
    """Every tensor the model expects must be in the checkpoint (tied ones excepted): transformers would
    initialise a missing one at random and only log it. Where transformers renames or fuses checkpoint keys
    for this architecture, only a tensor stored for another layer or expert but not this one counts as missing
    (a renamed key never matches a stored pattern)."""
    stored = set(ckpt.tensor_names())
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
        renamed = bool(extract_weight_conversions_for_model(model))
    except ImportError:     # transformers without conversion mappings renames nothing
        renamed = False
    patterns = {_LAYER_INDEX.sub(".#.", n) for n in stored}
    for name in sorted(set(model.state_dict()) - stored - tied, key=natural_key):
        if not renamed:
            raise FormatError(f"{name}: missing from {ckpt.path}; the checkpoint is incomplete (download or convert "
                              f"it again)")
        if _LAYER_INDEX.sub(".#.", name) in patterns:
            raise FormatError(f"{name}: missing from {ckpt.path}, which stores it for other layers; the checkpoint "
                              f"is incomplete (download or convert it again)")


def _check_shapes(model: nn.Module, ckpt: Exl3Checkpoint) -> None:
    """Every stored tensor that is not part of an EXL3 linear has the shape of the model's tensor of that name (on
    meta: the model config.json builds); transformers would otherwise stop with its own error at the first mismatch
    or, asked to ignore mismatches, initialise the tensor at random. EXL3 widths: :func:`_check_widths`."""
    want = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    for name in ckpt.other_tensor_names():
        info = ckpt.tensor_info(name)
        if name in want and tuple(info.shape) != want[name]:
            raise FormatError(f"{name}: shape {list(info.shape)} in {ckpt.root / info.file}, but the model config.json "
                              f"describes ({type(model).__name__}) has {list(want[name])}; the checkpoint and its "
                              f"config.json disagree (use the checkpoint's own config.json)")


def _check_widths(info: LinearInfo, in_f: int, out_f: int) -> None:
    want = (padded_width(in_f), padded_width(out_f))
    if (info.in_padded, info.out_padded) != want:
        raise FormatError(f"{info.name}.trellis: codes for a [{info.in_padded}, {info.out_padded}] (padded) matrix, "
                          f"but the model's config makes it [{in_f}, {out_f}] (padded {want[0]}, {want[1]}); the "
                          f"checkpoint and its config.json disagree")


def register() -> None:
    """Register ``quant_method="exl3rt"`` (online) and ``"exl3"`` (EXL3 checkpoints) with transformers.

    Idempotent; a foreign owner of either name is an error."""
    for method, pair in ((QUANT_METHOD, (Exl3Config, Exl3HfQuantizer)),
                         (CHECKPOINT_METHOD, (Exl3CheckpointConfig, Exl3CheckpointQuantizer))):
        for mapping, cls in zip((AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING), pair):
            current = mapping.get(method)
            if current is cls:
                continue
            if current is not None and getattr(current, "__module__", "") != __name__:
                raise RuntimeError(f"transformers already has a quantization method named {method!r} "
                                   f"({current.__module__}.{current.__name__}); exl3rt cannot register its own")
            mapping[method] = cls  # new, or this module re-imported (e.g. importlib.reload)


register()

__all__ = ["Exl3CheckpointConfig", "Exl3CheckpointQuantizer", "Exl3Config", "Exl3HfQuantizer", "Exl3Quantize",
           "plan_checkpoint_load", "register", "save_pretrained_exl3"]
