"""quantize_model: turn a loaded torch model's linears into EXL3 modules, in place, through the cache.

    if config.expert_bits_rule: router statistics on calibration tokens (router_stats.py), model still dense
    for each target of policy.select_targets(model, config, router_stats):
        nn.Linear [out, in]        ──OnlineEncoder──► Exl3Linear (bias kept)       ─► replaces it
        fused experts (3-D params) ──per expert slice──► Exl3Experts of Exl3Linear ─► replaces it
        (the dense weight is dropped as soon as its module is replaced)
    moe_module.install_moe_runtimes: Exl3Experts that can be tiered ─► Exl3MoE (planned MoE runtime)

Peak memory is the model as given plus the codes of one module (for a fused experts module: the codes
of all its experts) — the dense weights shrink away as the pass advances.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
from torch import nn

from ..util.progress import Progress
from .config import Exl3Config
from .experts import Exl3Experts
from .linear import Exl3Linear
from .online import OnlineEncoder, progress_label
from .policy import ExpertsTarget, LinearTarget, PolicyError, select_targets
from .router_stats import calibration_ids as _calibration_ids
from .router_stats import collect_router_stats
from .surgery import quantize_linear, replace_module, untie_head

log = logging.getLogger("exl3rt.runtime")


def _quantize_experts(module: nn.Module, target: ExpertsTarget, enc: OnlineEncoder, config: Exl3Config,
                      progress: Progress) -> Exl3Experts:
    lay = target.layout
    fn, attrs = Exl3Experts.gate_attrs(module)
    new = Exl3Experts(lay, module.act_fn, apply_gate=fn, attrs=attrs, name=target.name)
    params = {"down_proj": module.down_proj.detach(), lay.up_param: getattr(module, lay.up_param).detach()}
    for e in range(lay.num_experts):
        mats: dict[str, torch.Tensor] = {}
        for param, tensor in params.items():
            mats.update(lay.split(param, tensor, e))
        for proj in lay.projections():
            w = mats[proj]
            k = target.bits[e][proj]
            name = target.expert_name(e, proj)
            if k is None:  # kept dense (ignored)
                child = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
                child.weight = nn.Parameter(w.contiguous().clone(), requires_grad=False)
            else:
                child = Exl3Linear.from_encoded(enc.encode(name, w, k), dequant_cache=config.dequant_cache, name=name)
                progress.desc = progress_label(enc.stats)
                progress.update(w.numel(), note=name)
            new.set_projection(e, proj, child)
    if lay.has_bias:
        for p in (f"{lay.up_param}_bias", "down_proj_bias"):
            setattr(new, p, nn.Parameter(getattr(module, p).detach().clone(), requires_grad=False))
    return new


def _nothing_to_quantize(model: nn.Module) -> None:
    """No module of ``model`` is selected: refuse when it already holds EXL3 modules (quantized before), else say
    that nothing was quantized."""
    done = [n for n, m in model.named_modules() if isinstance(m, (Exl3Linear, Exl3Experts))]
    if done:
        raise PolicyError(f"quantize_model: the model is already quantized ({len(done)} EXL3 modules, e.g. {done[0]}) "
                          f"and nothing else in it would be; use it as it is, or load the unquantized model again "
                          f"(from_pretrained without quantization_config) to quantize it with other settings")
    log.warning("exl3rt: quantize_model found no linear to quantize (every one ignored, or the model has none); "
                "the model is unchanged")


def quantize_model(model: nn.Module, config: Optional[Exl3Config] = None, *, cache: Any = None,
                   progress: bool = True, calibration_ids: Any = None, tokenizer: Any = None,
                   layers: bool = False) -> dict[str, Any]:
    """Quantize ``model`` in place (see the module docstring); returns a summary dict.

    ``config`` defaults to ``Exl3Config()`` (K=4, mcg). ``cache`` defaults to
    ``EncodingCache(config.cache_dir, config.cache_mode)``. Summary keys: ``layers`` (matrices),
    ``modules``, ``hits``, ``misses``, ``encode_seconds``, ``read_seconds``, ``seconds``,
    ``total_weights``, ``avg_bits`` (weight-averaged K), ``bpw`` (stored bits of trellis+scales per
    weight), ``code_bytes``, ``cache`` (the cache's own counters), ``cache_root``, ``cache_mode``,
    ``moe`` (experts module -> "runtime …" or "loop: reason"), ``router_stats`` (``{"tokens", "counts"}``) when
    ``config.expert_bits_rule`` gathered them, and with ``layers`` ``names`` (the replaced modules).

    ``calibration_ids`` (token ids) or ``tokenizer`` (for the bundled evaluation text) feed
    ``config.expert_bits_rule``; without either, the tokenizer saved beside the model is used.

    A model that is already quantized (EXL3 modules, e.g. from ``from_pretrained(..., quantization_config=...)`` or
    an EXL3 checkpoint) with nothing left that ``config`` would quantize is refused (:class:`PolicyError` naming a
    quantized module): its codes cannot be quantized again, and a silent no-op would pass for a requantization.
    Modules it left dense (``ignore``) are quantized as any other.
    """
    config = config if config is not None else Exl3Config()
    if not isinstance(config, Exl3Config):
        to_runtime = getattr(config, "to_runtime", None)
        if to_runtime is None:
            raise TypeError(f"quantize_model: config must be an exl3rt Exl3Config, got {type(config).__name__}")
        config = to_runtime()
    t0 = time.perf_counter()
    stats = None
    if config.expert_bits_rule is not None:
        ids = _calibration_ids(model, config.expert_bits_rule.tokens, token_ids=calibration_ids, tokenizer=tokenizer)
        stats = collect_router_stats(model, ids)
    targets = select_targets(model, config, stats)
    if not targets:
        _nothing_to_quantize(model)
    enc = OnlineEncoder(config, cache)
    total = sum(t.num_weights for t in targets)
    names = []
    with Progress(total, progress_label(None), unit="w", enabled=progress and config.progress) as bar:
        for target in targets:
            module = model.get_submodule(target.name)
            if isinstance(target, LinearTarget):
                new = quantize_linear(module, target, enc, config)
                bar.desc = progress_label(enc.stats)
                bar.update(target.num_weights, note=target.name)
            else:
                new = _quantize_experts(module, target, enc, config, bar)
            tied = isinstance(target, LinearTarget) and any(
                p is module.weight for n, p in model.named_parameters(remove_duplicate=False)
                if not n.startswith(target.name + "."))
            replace_module(model, target.name, new)
            if tied:  # e.g. a head sharing the embedding's weight: the embedding keeps it, the head is codes now
                untie_head(model, target.name)
            del module  # the dense weights go with the old module (unless the caller still holds them)
            names.append(target.name)
            enc.stats.modules += 1
    from .moe_module import install_moe_runtimes

    moe = install_moe_runtimes(model, config)
    enc.stats.seconds = time.perf_counter() - t0
    summary = enc.summary()
    if layers:
        summary["names"] = names
    summary["moe"] = moe
    if stats is not None:
        summary["router_stats"] = stats.as_dict()
    log.info("exl3rt: quantized %d matrices in %d modules (%d cache hits, %d encoded) in %.1f s, %.2f bits/weight",
             summary["layers"], summary["modules"], summary["hits"], summary["misses"], summary["seconds"],
             summary["avg_bits"])
    return summary


__all__ = ["quantize_model"]
