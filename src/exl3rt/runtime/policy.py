"""Which modules of a live torch model get quantized, and at which K.

Selected:

- every ``nn.Linear`` except the head (``lm_head`` / the model's output embeddings, unless
  ``quantize_lm_head``), embeddings, MoE routers and ignored modules;
- MoE experts stored per expert (``…experts.{i}.gate_proj`` as ``nn.Linear``): ordinary linears;
- fused 3-D expert parameters (transformers 5.x experts modules such as ``Qwen3MoeExperts``:
  ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, or the transposed / interleaved /
  ungated variants flagged by ``@use_experts_implementation``): EXL3 codes 2-D matrices, so each
  expert's slice is encoded on its own, under the per-expert name
  ``<experts>.{e}.gate_proj | up_proj | down_proj`` (the names a per-expert checkpoint uses, so
  ``bits_for``/``ignore`` patterns, seeds and cache keys agree with ``exl3rt quantize``).

Per-expert K of fused experts: ``Exl3Config.expert_bits`` (an explicit map per experts module) and
``Exl3Config.expert_bits_rule`` (from :class:`~exl3rt.runtime.router_stats.RouterStats`, gathered on the
loaded model before encoding; without statistics the rule is an error naming the alternatives). Expert
ids are checked against the module's expert count, and every ``expert_bits`` pattern must match a fused
experts module (a pattern matching nothing is a typo, not a no-op).

Never selected: norms (not linears), embeddings (``embed*``, ``wte``, ``wpe`` segments), routers
(segments ``gate``, ``router``, ``shared_expert_gate``; in transformers 5.x most routers are not
``nn.Linear`` anyway). The name rules are those of :mod:`exl3rt.convert.plan`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import nn

from ..util.names import EMBED_NAME, HEAD, ROUTER_NAME
from ..format.bits import Bits
from .config import Exl3Config, Exl3ConfigError

if TYPE_CHECKING:
    from .router_stats import RouterStats

log = logging.getLogger("exl3rt.runtime")

_ROUTER_EXTRA = re.compile(r"(^|\.)shared_expert_gate$")


class PolicyError(ValueError):
    """A module cannot be quantized the way the config asks (message names the module and the fix)."""


@dataclasses.dataclass(frozen=True)
class LinearTarget:
    """One ``nn.Linear`` to replace by an :class:`~exl3rt.runtime.linear.Exl3Linear`."""

    name: str
    bits: Bits
    in_features: int
    out_features: int
    has_bias: bool

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How a fused experts module stores its weights (transformers' ``use_experts_implementation`` flags)."""

    num_experts: int
    hidden: int            # H: expert input and output width
    intermediate: int      # I: per-expert intermediate width
    has_gate: bool = True          # gate_up_proj (gate and up fused) vs up_proj only
    is_concatenated: bool = True   # [gate; up] rows vs interleaved gate0, up0, gate1, …
    is_transposed: bool = False    # slices stored [in, out] instead of [out, in]
    has_bias: bool = False

    @property
    def up_param(self) -> str:
        return "gate_up_proj" if self.has_gate else "up_proj"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the fused parameters (as the HF module declares them)."""
        e, h, i = self.num_experts, self.hidden, self.intermediate
        up_out = 2 * i if self.has_gate else i
        up = (e, h, up_out) if self.is_transposed else (e, up_out, h)
        down = (e, i, h) if self.is_transposed else (e, h, i)
        out = {self.up_param: up, "down_proj": down}
        if self.has_bias:
            out[f"{self.up_param}_bias"] = (e, up_out)
            out["down_proj_bias"] = (e, h)
        return out

    def projections(self) -> tuple[str, ...]:
        """Per-expert projection names, in forward order."""
        return ("gate_proj", "up_proj", "down_proj") if self.has_gate else ("up_proj", "down_proj")

    def shape_of(self, proj: str) -> tuple[int, int]:
        """HF ``[out, in]`` shape of one expert's projection."""
        return (self.hidden, self.intermediate) if proj == "down_proj" else (self.intermediate, self.hidden)

    def split(self, param: str, tensor: torch.Tensor, expert: int) -> dict[str, torch.Tensor]:
        """Expert ``expert``'s matrices, HF ``[out, in]`` views, from fused parameter ``param``.

        ``gate_up_proj[e]`` ``[2I, H]`` → ``gate_proj`` ``[I, H]`` and ``up_proj`` ``[I, H]`` (rows
        ``[:I]``/``[I:]`` when concatenated, ``0::2``/``1::2`` when interleaved); ``down_proj[e]`` →
        ``down_proj`` ``[H, I]``. Transposed layouts are transposed back first.
        """
        w = tensor[expert]
        if self.is_transposed:
            w = w.t()
        if param == "down_proj":
            return {"down_proj": w}
        if not self.has_gate:
            return {"up_proj": w}
        if self.is_concatenated:
            gate, up = w[: self.intermediate], w[self.intermediate:]
        else:
            gate, up = w[0::2], w[1::2]
        return {"gate_proj": gate, "up_proj": up}


@dataclasses.dataclass(frozen=True)
class ExpertsTarget:
    """A fused experts module; ``bits[e][proj]`` is K (``None``: that matrix stays dense)."""

    name: str
    layout: ExpertLayout
    bits: tuple[dict[str, Optional[Bits]], ...]

    def expert_name(self, expert: int, proj: str) -> str:
        return f"{self.name}.{expert}.{proj}"

    @property
    def num_weights(self) -> int:
        """Weights that get encoded (dense-kept matrices excluded)."""
        total = 0
        for per in self.bits:
            for proj, k in per.items():
                if k is not None:
                    o, i = self.layout.shape_of(proj)
                    total += o * i
        return total


def is_embedding_name(name: str) -> bool:
    return bool(EMBED_NAME.search(name))


def is_router_name(name: str) -> bool:
    return bool(ROUTER_NAME.search(name) or _ROUTER_EXTRA.search(name))


def _head_names(model: nn.Module) -> set[str]:
    """Module names of the output head: ``lm_head`` and whatever ``get_output_embeddings()`` returns."""
    names = {n for n, _ in model.named_modules() if n == HEAD or n.endswith("." + HEAD)}
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            head = get_out()
        except (NotImplementedError, AttributeError):
            head = None
        if head is not None:
            names |= {n for n, m in model.named_modules() if m is head}
    return names


def fused_experts_layout(module: nn.Module) -> Optional[ExpertLayout]:
    """The :class:`ExpertLayout` of a fused experts module (3-D ``down_proj`` and ``gate_up_proj``/``up_proj``
    parameters), or None for any other module."""
    params = dict(module.named_parameters(recurse=False))
    down = params.get("down_proj")
    has_gate = "gate_up_proj" in params
    up_name = "gate_up_proj" if has_gate else "up_proj"
    up = params.get(up_name)
    if down is None or up is None or down.dim() != 3 or up.dim() != 3:
        return None
    transposed = bool(getattr(module, "is_transposed", False))
    e = int(down.shape[0])
    h, i = (int(down.shape[2]), int(down.shape[1])) if transposed else (int(down.shape[1]), int(down.shape[2]))
    layout = ExpertLayout(
        num_experts=e, hidden=h, intermediate=i, has_gate=has_gate,
        is_concatenated=bool(getattr(module, "is_concatenated", True)), is_transposed=transposed,
        has_bias=bool(getattr(module, "has_bias", False)) or f"{up_name}_bias" in params,
    )
    if layout.param_shapes()[layout.up_param] != tuple(up.shape):
        log.info("%s: 3-D expert parameters %s/%s in a layout exl3rt does not know; left unquantized",
                 type(module).__name__, tuple(up.shape), tuple(down.shape))
        return None
    return layout


RULE_NEEDS_STATS = (
    "Exl3Config.expert_bits_rule={rule!r} needs router statistics, which exist only for a model loaded in full: "
    "use exl3rt.quantize_model(model, config) on the loaded BF16 model (it routes calibration tokens first), or "
    "give explicit per-expert bits with Exl3Config.expert_bits; transformers from_pretrained(..., "
    "quantization_config=...) encodes each expert as it loads, before any token can be routed")


def expert_overrides(config: Exl3Config, name: str, num_experts: int,
                     router_stats: Optional["RouterStats"] = None) -> list[Optional[Bits]]:
    """Whole-expert K of each expert of fused experts module ``name`` (None: use ``bits``/``bits_for``).

    Later wins: ``expert_bits`` defaults, ``expert_bits_rule``, ``expert_bits`` per-expert entries.
    Raises Exl3ConfigError for an expert id ``>= num_experts`` (naming the entry) or a rule without stats.
    """
    entries = config.expert_entries(name)
    over: list[Optional[Bits]] = [None] * num_experts
    for _, entry in entries:
        if entry["default"] is not None:
            over = [entry["default"]] * num_experts
    rule = config.expert_bits_rule
    if rule is not None:
        if router_stats is None:
            raise Exl3ConfigError(RULE_NEEDS_STATS.format(rule=rule))
        from .router_stats import rule_bits

        over = list(rule_bits(rule, router_stats, name))
    for pattern, entry in entries:
        for e, k in entry["experts"].items():
            if e >= num_experts:
                raise Exl3ConfigError(
                    f"Exl3Config.expert_bits[{pattern!r}][{e}]: expert {e} does not exist in {name} "
                    f"({num_experts} experts, ids 0..{num_experts - 1}); remove the entry or fix the pattern")
            over[e] = k
    return over


def select_targets(model: nn.Module, config: Exl3Config,
                   router_stats: Optional["RouterStats"] = None) -> list[LinearTarget | ExpertsTarget]:
    """Modules of ``model`` to quantize, in ``named_modules`` order (see the module docstring).

    ``router_stats`` feeds ``config.expert_bits_rule`` (see :mod:`exl3rt.runtime.router_stats`).
    """
    from .experts import Exl3Experts
    from .linear import Exl3Linear

    heads = _head_names(model)
    targets: list[LinearTarget | ExpertsTarget] = []
    skip_below: list[str] = []
    experts_names: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in skip_below):
            continue
        if isinstance(module, (Exl3Linear, Exl3Experts)):
            skip_below.append(name)
            continue
        if isinstance(module, nn.Linear):
            head = name in heads
            if (head and not config.quantize_lm_head) or is_embedding_name(name) or is_router_name(name):
                continue
            if config.is_ignored(name):
                continue
            targets.append(LinearTarget(name, config.bits_for_module(name, head=head), int(module.in_features),
                                        int(module.out_features), module.bias is not None))
            continue
        layout = fused_experts_layout(module)
        if layout is None:
            continue
        experts_names.append(name)
        if config.is_ignored(name):
            skip_below.append(name)
            continue
        if getattr(module, "has_post_expert_norm", False):
            raise PolicyError(f"{name}: experts with a post-expert norm ({type(module).__name__}) are not supported "
                              f"yet; add {name!r} (or a pattern for it) to Exl3Config.ignore to keep them dense")
        over = expert_overrides(config, name, layout.num_experts, router_stats)
        per_expert = tuple(
            {p: (None if config.is_ignored(f"{name}.{e}.{p}") else
                 over[e] if over[e] is not None else config.bits_for_module(f"{name}.{e}.{p}"))
             for p in layout.projections()}
            for e in range(layout.num_experts)
        )
        targets.append(ExpertsTarget(name, layout, per_expert))
        skip_below.append(name)
    _check_patterns_used(config, experts_names)
    return targets


def _check_patterns_used(config: Exl3Config, experts_names: list[str]) -> None:
    """Every ``expert_bits`` pattern must name at least one fused experts module of the model."""
    for pattern in config.expert_bits:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in experts_names):
            found = ", ".join(experts_names[:3]) + (" …" if len(experts_names) > 3 else "") or "none"
            raise Exl3ConfigError(
                f"Exl3Config.expert_bits[{pattern!r}]: the pattern matches no fused experts module of this model "
                f"(experts modules: {found}); patterns name the experts module itself, e.g. "
                f"'model.layers.*.mlp.experts'")


def iter_names(targets: list[LinearTarget | ExpertsTarget]) -> Iterator[tuple[str, Optional[Bits]]]:
    """Every 2-D matrix name a target list covers, with its K (None: kept dense)."""
    for t in targets:
        if isinstance(t, LinearTarget):
            yield t.name, t.bits
        else:
            for e, per in enumerate(t.bits):
                for proj, k in per.items():
                    yield t.expert_name(e, proj), k


__all__ = ["ExpertLayout", "ExpertsTarget", "LinearTarget", "PolicyError", "expert_overrides", "fused_experts_layout",
           "is_embedding_name", "is_router_name", "iter_names", "select_targets"]
