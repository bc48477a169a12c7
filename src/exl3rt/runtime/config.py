"""Exl3Config: what online quantization does to a model (bits, codebook, overrides, cache, devices).

One dataclass, validated on construction, shared by :func:`exl3rt.quantize_model` and the
transformers integration (``import exl3rt.integrations.transformers``, then ``from_pretrained(...,
quantization_config=Exl3Config(bits=4))``).
Errors name the field, the bad value and the fix.

Module-name patterns (``bits_for`` keys and ``ignore`` entries) are shell-style (:mod:`fnmatch`,
case-sensitive) and match the dotted module name, e.g. ``model.layers.3.mlp.down_proj`` or, for a
fused MoE experts module, the per-expert name ``model.layers.3.mlp.experts.7.down_proj``.
``expert_bits`` keys match the experts module itself (``model.layers.*.mlp.experts``).

Per-expert K (fused MoE experts; a whole expert — gate, up, down — gets one K, as the mixed-bitrate
MoE runtime tiers whole experts). For expert ``e`` of experts module ``M``, later wins:
``bits`` → ``bits_for`` (per matrix) → ``expert_bits[M]["default"]`` → ``expert_bits_rule`` →
``expert_bits[M]["experts"][e]``; ``ignore`` still keeps a matrix dense.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from typing import Any, Mapping, Optional

import torch

from ..format.bits import Bits, is_half, normalize_bits
from ..format.codebooks import CODEBOOKS
from ..format.errors import FormatError
from ..util.fields import unknown_fields
from .router_stats import TopRouted

#: the ``quant_method`` name registered with transformers
QUANT_METHOD = "exl3rt"

_BACKENDS = ("auto", "torch", "numba", "triton")


class Exl3ConfigError(ValueError):
    """A field of :class:`Exl3Config` holds a value that cannot be used."""


@dataclasses.dataclass
class Exl3Config:
    """Online EXL3 quantization settings.

    Fields:
      bits            K for every quantized linear (1..8, or 1.5/2.5/3.5 with ``codebook="mul1"``)
      codebook        "mcg" (default), "mul1" or "3inst"
      seed            base seed; each module uses ``module_seed(name, seed)`` (order-independent)
      bits_for        {pattern: K}: per-module K; every matching pattern applies, the last one wins
      ignore          [pattern]: modules left unquantized (a pattern naming a fused experts module
                      keeps all its experts dense)
      quantize_lm_head  quantize ``lm_head`` too (at ``head_bits``; ``bits_for`` can override)
      head_bits       K for ``lm_head`` when ``quantize_lm_head`` (default 6)
      cache_mode      "readwrite" | "readonly" | "off"; None: ``EXL3RT_CACHE_MODE`` (default readwrite)
      cache_dir       cache root; None: ``EXL3RT_CACHE_DIR`` or ``~/.cache/exl3rt``
      encode_device   where encodes run ("cpu", "cuda", "cuda:1"); None: the weight's own device.
                      The codes always end up on the weight's device.
      backend         encoder tile backend: "auto", "torch", "numba", "triton"
      dequant_cache   keep each layer's dequantized weight (activation dtype) on the module after the
                      first forward: None = on for CPU, off for CUDA; True/False force it. It trades
                      memory (the dense weight again) for speed (no re-decode per call).
      progress        show a progress bar with ETA on stderr while loading (default True)
      expert_bits     {experts-module pattern: {"default": K, "experts": {id: K}}}: per-expert K of fused
                      MoE experts (shorthand ``{pattern: {id: K}}``; ``default`` optional). Ids are checked
                      against the model when it is quantized (unknown id: error naming the entry)
      expert_bits_rule  ``TopRouted(high, low, fraction, tokens)``: the most-routed experts of each layer
                      at ``high``, the rest at ``low``, from router statistics on calibration tokens
                      (:func:`exl3rt.quantize_model` only: ``from_pretrained`` cannot route before encoding)
      moe_runtime     run quantized experts through the planned MoE runtime (``Exl3MoE``): None = when the
                      layer can be tiered (else the per-expert loop, logged), True = required (error
                      otherwise), False = always the per-expert loop (``Exl3Experts``)
      moe_max_batched rows one MoE runtime call carries (its arenas are sized for it; larger inputs run
                      in chunks of this many rows)
    """

    bits: Bits = 4
    codebook: str = "mcg"
    seed: int = 0
    bits_for: dict[str, Bits] = dataclasses.field(default_factory=dict)
    ignore: list[str] = dataclasses.field(default_factory=list)
    quantize_lm_head: bool = False
    head_bits: Bits = 6
    cache_mode: Optional[str] = None
    cache_dir: Optional[str] = None
    encode_device: Optional[str] = None
    backend: str = "auto"
    dequant_cache: Optional[bool] = None
    progress: bool = True
    expert_bits: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    expert_bits_rule: Optional[TopRouted] = None
    moe_runtime: Optional[bool] = None
    moe_max_batched: int = 4096

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation -------------------------------------------------------------------------
    def _bits(self, value: Any, field: str) -> Bits:
        try:
            k = normalize_bits(value, name=f"Exl3Config.{field}")
        except FormatError as exc:
            raise Exl3ConfigError(str(exc)) from None
        if is_half(k) and self.codebook != "mul1":
            raise Exl3ConfigError(
                f"Exl3Config.{field}={value!r}: half-integer K needs codebook='mul1' "
                f"(got codebook={self.codebook!r}); use an integer K or set codebook='mul1'"
            )
        return k

    def validate(self) -> None:
        """Normalize and check every field; raise :class:`Exl3ConfigError` naming the field."""
        if self.codebook not in CODEBOOKS:
            raise Exl3ConfigError(f"Exl3Config.codebook={self.codebook!r}: unknown codebook; "
                                  f"use one of {', '.join(repr(c) for c in CODEBOOKS)}")
        self.bits = self._bits(self.bits, "bits")
        self.head_bits = self._bits(self.head_bits, "head_bits")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise Exl3ConfigError(f"Exl3Config.seed={self.seed!r}: must be an int")
        if not isinstance(self.bits_for, Mapping):
            raise Exl3ConfigError(f"Exl3Config.bits_for={self.bits_for!r}: must be a dict {{pattern: K}}, "
                                  f"e.g. {{'*.down_proj': 5}}")
        checked: dict[str, Bits] = {}
        for pattern, k in self.bits_for.items():
            if not isinstance(pattern, str) or not pattern:
                raise Exl3ConfigError(f"Exl3Config.bits_for: key {pattern!r} must be a non-empty module-name pattern")
            checked[pattern] = self._bits(k, f"bits_for[{pattern!r}]")
        self.bits_for = checked
        if isinstance(self.ignore, str) or not isinstance(self.ignore, (list, tuple)):
            raise Exl3ConfigError(f"Exl3Config.ignore={self.ignore!r}: must be a list of module-name patterns, "
                                  f"e.g. ['*.self_attn.*']")
        for pattern in self.ignore:
            if not isinstance(pattern, str) or not pattern:
                raise Exl3ConfigError(f"Exl3Config.ignore: entry {pattern!r} must be a non-empty pattern")
        self.ignore = list(self.ignore)
        for field in ("quantize_lm_head", "progress"):
            if not isinstance(getattr(self, field), bool):
                raise Exl3ConfigError(f"Exl3Config.{field}={getattr(self, field)!r}: must be True or False")
        if self.dequant_cache is not None and not isinstance(self.dequant_cache, bool):
            raise Exl3ConfigError(f"Exl3Config.dequant_cache={self.dequant_cache!r}: must be None, True or False")
        if self.backend not in _BACKENDS:
            raise Exl3ConfigError(f"Exl3Config.backend={self.backend!r}: use one of {', '.join(_BACKENDS)}")
        if self.encode_device is not None:
            try:
                torch.device(self.encode_device)
            except (RuntimeError, TypeError):
                raise Exl3ConfigError(f"Exl3Config.encode_device={self.encode_device!r}: not a torch device; "
                                      f"use None, 'cpu', 'cuda' or 'cuda:N'") from None
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            self.cache_dir = str(self.cache_dir)
        if self.cache_mode is not None:
            self.cache_mode = _check_cache_mode(self.cache_mode)
        self._validate_moe()

    def _validate_moe(self) -> None:
        if not isinstance(self.expert_bits, Mapping):
            raise Exl3ConfigError(f"Exl3Config.expert_bits={self.expert_bits!r}: must be a dict {{experts-module "
                                  f"pattern: {{'default': K, 'experts': {{id: K}}}}}}, e.g. "
                                  f"{{'model.layers.*.mlp.experts': {{'default': 3, 'experts': {{0: 4}}}}}}")
        self.expert_bits = {p: self._expert_entry(p, e) for p, e in self.expert_bits.items()}
        rule = self.expert_bits_rule
        if isinstance(rule, Mapping):
            try:
                rule = TopRouted.from_dict(rule)
            except (TypeError, ValueError) as exc:
                raise Exl3ConfigError(f"Exl3Config.expert_bits_rule: {exc}") from None
        if rule is not None:
            if not isinstance(rule, TopRouted):
                raise Exl3ConfigError(f"Exl3Config.expert_bits_rule={rule!r}: must be None or "
                                      f"TopRouted(high=4, low=3, fraction=0.25, tokens=512)")
            frac, tokens = rule.fraction, rule.tokens
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
                raise Exl3ConfigError(f"Exl3Config.expert_bits_rule.fraction={frac!r}: must be in (0, 1] "
                                      f"(the share of each layer's experts at the higher K)")
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
                raise Exl3ConfigError(f"Exl3Config.expert_bits_rule.tokens={tokens!r}: must be a positive int "
                                      f"(calibration tokens routed to count expert use)")
            rule = dataclasses.replace(rule, high=self._bits(rule.high, "expert_bits_rule.high"),
                                       low=self._bits(rule.low, "expert_bits_rule.low"), fraction=float(frac))
        self.expert_bits_rule = rule
        if self.moe_runtime is not None and not isinstance(self.moe_runtime, bool):
            raise Exl3ConfigError(f"Exl3Config.moe_runtime={self.moe_runtime!r}: must be None (when possible), "
                                  f"True (required) or False (per-expert loop)")
        mb = self.moe_max_batched
        if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
            raise Exl3ConfigError(f"Exl3Config.moe_max_batched={mb!r}: must be a positive int (rows per MoE call)")

    def _expert_entry(self, pattern: Any, entry: Any) -> dict[str, Any]:
        """``{"default": K | None, "experts": {int id: K}}`` from the nested form or the ``{id: K}`` shorthand."""
        where = f"Exl3Config.expert_bits[{pattern!r}]"
        if not isinstance(pattern, str) or not pattern:
            raise Exl3ConfigError(f"Exl3Config.expert_bits: key {pattern!r} must be a non-empty experts-module "
                                  f"pattern, e.g. 'model.layers.*.mlp.experts'")
        if not isinstance(entry, Mapping):
            raise Exl3ConfigError(f"{where}={entry!r}: must be a dict {{'default': K, 'experts': {{id: K}}}} "
                                  f"or {{id: K}}")
        entry = dict(entry)
        default = entry.pop("default", None)
        nested = entry.pop("experts", None)
        if nested is not None and entry:
            raise Exl3ConfigError(f"{where}: give expert ids either under 'experts' or directly, not both "
                                  f"(extra keys {sorted(map(str, entry))})")
        ids = nested if nested is not None else entry
        if not isinstance(ids, Mapping):
            raise Exl3ConfigError(f"{where}['experts']={ids!r}: must be a dict {{expert id: K}}")
        experts: dict[int, Bits] = {}
        for raw, k in ids.items():
            e = raw if isinstance(raw, int) and not isinstance(raw, bool) else \
                int(raw) if isinstance(raw, str) and raw.isdigit() else None
            if e is None or e < 0:
                raise Exl3ConfigError(f"{where}: expert id {raw!r} is not a non-negative integer; keys are expert "
                                      f"ids (0, 1, …), 'default' or 'experts'")
            if e in experts:
                raise Exl3ConfigError(f"{where}: expert {e} is listed twice")
            experts[e] = self._bits(k, f"expert_bits[{pattern!r}][{e}]")
        return {"default": None if default is None else self._bits(default, f"expert_bits[{pattern!r}]['default']"),
                "experts": dict(sorted(experts.items()))}

    # ---- policy helpers -----------------------------------------------------------------------
    def is_ignored(self, name: str) -> bool:
        """True if any ``ignore`` pattern matches module ``name``."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.ignore)

    def expert_entries(self, experts_module: str) -> list[tuple[str, dict[str, Any]]]:
        """``(pattern, entry)`` of every ``expert_bits`` pattern matching ``experts_module``, in order."""
        return [(p, e) for p, e in self.expert_bits.items() if fnmatch.fnmatchcase(experts_module, p)]

    def bits_for_module(self, name: str, *, head: bool = False) -> Bits:
        """K for module ``name``: ``head_bits`` for the head else ``bits``, then the last matching override."""
        k = self.head_bits if head else self.bits
        for pattern, value in self.bits_for.items():
            if fnmatch.fnmatchcase(name, pattern):
                k = value
        return k

    # ---- (de)serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of the fields (plus ``quant_method``, as transformers expects)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["bits_for"] = dict(out["bits_for"])
        out["ignore"] = list(out["ignore"])
        # JSON object keys are strings (from_dict turns them back into ints)
        out["expert_bits"] = {p: {"default": e["default"], "experts": {str(i): k for i, k in e["experts"].items()}}
                              for p, e in self.expert_bits.items()}
        out["expert_bits_rule"] = None if self.expert_bits_rule is None else self.expert_bits_rule.to_dict()
        out["quant_method"] = QUANT_METHOD
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Exl3Config":
        """Inverse of :meth:`to_dict`; unknown keys are an error (a misspelt field must not be ignored)."""
        data = dict(data)
        method = data.pop("quant_method", QUANT_METHOD)
        if str(method) != QUANT_METHOD:
            raise Exl3ConfigError(f"Exl3Config.from_dict: quant_method={method!r} is not {QUANT_METHOD!r}")
        unknown, valid = unknown_fields(cls, data)
        if unknown:
            raise Exl3ConfigError(f"Exl3Config.from_dict: unknown field(s) {unknown}; valid fields: {valid}")
        return cls(**data)

    # ---- transformers ----------------------------------------------------------------------------------
    @property
    def quant_method(self) -> str:
        """``"exl3rt"``: the name transformers picks exl3rt's quantizer by. transformers knows it once
        ``exl3rt.integrations.transformers`` is imported (or its ``register()`` called); read while transformers is
        loaded but before that, this raises :class:`Exl3ConfigError` naming the import, instead of transformers'
        "Unknown quantization type". Reading it registers nothing: ``import exl3rt`` never imports transformers."""
        auto = sys.modules.get("transformers.quantizers.auto")
        known = getattr(auto, "AUTO_QUANTIZER_MAPPING", None)
        if known is not None and QUANT_METHOD not in known:
            raise Exl3ConfigError(
                f"transformers does not know quant_method {QUANT_METHOD!r} yet: `import exl3rt.integrations.transformers` "
                f"(it registers exl3rt's quantizer) before from_pretrained(..., quantization_config=Exl3Config(...))")
        return QUANT_METHOD


def _check_cache_mode(value: Any) -> str:
    """The canonical cache-mode name, or Exl3ConfigError listing the valid ones."""
    from ..cache.modes import CacheMode, parse_cache_mode

    try:
        return str(parse_cache_mode(value))
    except ValueError as exc:
        valid = ", ".join(repr(m.value) for m in CacheMode)
        raise Exl3ConfigError(f"Exl3Config.cache_mode={value!r}: {exc} (valid: {valid}, or None for "
                              f"EXL3RT_CACHE_MODE)") from None


__all__ = ["Exl3Config", "Exl3ConfigError", "QUANT_METHOD"]
