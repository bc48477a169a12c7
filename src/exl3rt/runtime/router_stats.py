"""Router statistics and the "most-routed experts at the higher K" rule.

Counting (before any expert is quantized, on the model as loaded)::

    for each fused experts module M (transformers 5.x: forward(hidden [T, H], top_k_index [T, k], weights)):
        pre-forward hook on M:  counts[M][e] += #{(t, s) : top_k_index[t, s] = e}     (e < E; the
                                expert-parallel sentinel E is not an expert)
    run the calibration tokens through the model (no grad, windows of at most ``window`` tokens)

The hook sits on the experts' input, i.e. on exactly what the block's router decided (after any
model-specific selection such as group-limited top-k), whatever the router module returns.

:class:`TopRouted` turns counts into bitrates: in each layer the ``ceil(fraction·E)`` experts with the
most routes get K = ``high``, the rest K = ``low`` (ties: the lower expert id wins, so the choice is
deterministic). Calibration tokens are the user's ids, or the bundled evaluation text
(:func:`exl3rt.evaluation.bundled_text`) through the model's tokenizer; at most ``TopRouted.tokens``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..format.bits import Bits
from ..util.fields import unknown_fields

log = logging.getLogger("exl3rt.runtime")

RULE_NAME = "top_routed"


class RouterStatsError(ValueError):
    """Router statistics cannot be gathered as asked (message says what to pass instead)."""


@dataclasses.dataclass(frozen=True)
class TopRouted:
    """Per layer, the ``ceil(fraction·E)`` most-routed experts at K=``high``, the others at K=``low``.

    ``tokens``: how many calibration tokens to route (the first ``tokens`` of the given ids or of the
    bundled text). K values are validated by :class:`~exl3rt.runtime.config.Exl3Config`.
    """

    high: Bits = 4
    low: Bits = 3
    fraction: float = 0.25
    tokens: int = 512

    def num_high(self, num_experts: int) -> int:
        """How many of ``num_experts`` experts get ``high``: ``ceil(fraction·E)``."""
        return min(num_experts, math.ceil(self.fraction * num_experts - 1e-9))

    def bits(self, counts: torch.Tensor) -> list[Bits]:
        """K per expert from route ``counts [E]`` (most routes first, ties to the lower id)."""
        e = int(counts.numel())
        order = sorted(range(e), key=lambda i: (-int(counts[i]), i))
        high = set(order[: self.num_high(e)])
        return [self.high if i in high else self.low for i in range(e)]

    def to_dict(self) -> dict[str, Any]:
        return {"rule": RULE_NAME, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TopRouted":
        data = dict(data)
        rule = data.pop("rule", RULE_NAME)
        if rule != RULE_NAME:
            raise ValueError(f"unknown expert-bits rule {rule!r}; the only rule is {RULE_NAME!r}")
        unknown, valid = unknown_fields(cls, data)
        if unknown:
            raise ValueError(f"unknown TopRouted field(s) {unknown}; valid: {valid}")
        return cls(**data)


@dataclasses.dataclass
class RouterStats:
    """Routes per expert of every fused experts module: ``counts[name] int64 [E]``; ``tokens`` routed."""

    counts: dict[str, torch.Tensor]
    tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "counts": {n: c.tolist() for n, c in self.counts.items()}}


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    from .policy import fused_experts_layout

    out = []
    for name, module in model.named_modules():
        layout = fused_experts_layout(module)
        if layout is not None:
            out.append((name, module, layout.num_experts))
    return out


def calibration_ids(model: nn.Module, tokens: int, *, token_ids: Any = None, tokenizer: Any = None) -> torch.Tensor:
    """At most ``tokens`` calibration ids (int64 ``[N]``): ``token_ids`` if given, else the bundled evaluation
    text through ``tokenizer`` (or the tokenizer saved beside the model, ``model.name_or_path``, local files only).
    """
    if token_ids is not None:
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
    else:
        if tokenizer is None:
            tokenizer = _local_tokenizer(model)
        from ..evaluation import bundled_text

        ids = torch.tensor(tokenizer(bundled_text(), add_special_tokens=False)["input_ids"], dtype=torch.int64)
    ids = ids[: int(tokens)]
    if ids.numel() == 0:
        raise RouterStatsError("router statistics: no calibration tokens; pass calibration_ids= with at least one id")
    return ids


def _local_tokenizer(model: nn.Module) -> Any:
    path = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    hint = ("the expert-bits rule needs calibration tokens: pass tokenizer= (the bundled evaluation text is used) "
            "or calibration_ids= to quantize_model, or give explicit per-expert bits (Exl3Config.expert_bits)")
    if not path:
        raise RouterStatsError(f"router statistics: the model has no name_or_path to find its tokenizer; {hint}")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means: no usable local tokenizer
        raise RouterStatsError(f"router statistics: no tokenizer found beside the model at {path!r} "
                               f"({type(exc).__name__}); {hint}") from None


@torch.no_grad()
def collect_router_stats(model: nn.Module, ids: torch.Tensor, *, window: Optional[int] = None) -> RouterStats:
    """Route ``ids [N]`` through ``model`` (windows of ``window`` tokens) and count routes per expert (see top)."""
    modules = _experts_modules(model)
    counts = {name: torch.zeros(e, dtype=torch.int64) for name, _, e in modules}
    if not modules:
        return RouterStats(counts, 0)
    if window is None:
        cfg = getattr(model, "config", None)
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        window = int(getattr(text, "max_position_embeddings", 0) or 512)
        window = min(window, 512)

    def hook_for(name: str, num_experts: int):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            idx = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if idx is None:
                raise RouterStatsError(f"{name}: the experts module was called without top_k_index; router "
                                       f"statistics need the transformers 5.x experts signature")
            flat = idx.reshape(-1).to("cpu", torch.int64)
            flat = flat[(flat >= 0) & (flat < num_experts)]
            counts[name] += torch.bincount(flat, minlength=num_experts)
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n, e), with_kwargs=True) for n, m, e in modules]
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        for start in range(0, int(ids.numel()), window):
            model(input_ids=ids[start:start + window][None].to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    log.info("exl3rt: router statistics over %d tokens in %d MoE layers", ids.numel(), len(modules))
    return RouterStats(counts, int(ids.numel()))


def rule_bits(rule: TopRouted, stats: RouterStats, name: str) -> Sequence[Bits]:
    """K per expert of experts module ``name`` under ``rule`` (raises if ``stats`` never saw the module)."""
    counts = stats.counts.get(name)
    if counts is None:
        raise RouterStatsError(f"{name}: no router statistics were gathered for this experts module; the "
                               f"calibration pass must reach every MoE layer")
    return rule.bits(counts)


ExpertBitsRule = Union[TopRouted]

__all__ = ["ExpertBitsRule", "RULE_NAME", "RouterStats", "RouterStatsError", "TopRouted", "calibration_ids",
           "collect_router_stats", "rule_bits"]
