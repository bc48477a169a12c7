"""Prewarm: load every kernel specialization a planned MoE model can reach, before serving.

A lazily compiled specialization (row bucket × route-id dtype × plan) first met under live traffic
compiles and allocates while the KV cache already holds the memory it would need; in production
that OOM'd. :func:`prewarm` therefore runs after the eager pass that plans each layer and before
KV-cache sizing:

    for every module carrying a MoELayerRuntime (see ``exl3rt.moe.launches.attach``):
        fail closed if the layer was never planned
        for every runtime it uses (each shared runtime once), every plan (decode, prefill),
        both ends of each route block's range in each row bucket (Plan.warm_rows),
        and route ids int32 and int64:
            count += launch.warmup(rows, ids_dtype)

Returns the count; 0 for a model without EXL3 MoE layers.
"""

from __future__ import annotations

import logging

import torch

from ..kernels.routing import ID_DTYPES
from .launches import MOE_ATTR, MoELayerRuntime

log = logging.getLogger("exl3rt.moe")


def moe_layers(model: torch.nn.Module) -> list[tuple[str, MoELayerRuntime]]:
    """``(module name, layer runtime)`` of every EXL3 MoE layer in ``model`` (each layer once)."""
    out, seen = [], set()
    for name, module in model.named_modules():
        layer = getattr(module, MOE_ATTR, None)
        if isinstance(layer, MoELayerRuntime) and id(layer) not in seen:
            seen.add(id(layer))
            out.append((name, layer))
    return out


def warm_layer(layer: MoELayerRuntime, done: set[int]) -> int:
    """Warm every specialization of ``layer``'s runtimes not in ``done`` (runtime ids; updated): each
    plan, both ends of each route block's range in each row bucket (``Plan.warm_rows``), route ids int32 and
    int64; a runtime shared by several layers is warmed once."""
    n = 0
    for runtime in layer.runtimes():
        if id(runtime) in done:
            continue
        done.add(id(runtime))
        for plan in runtime.policy.plans:
            launch = runtime.launch_for(plan)
            for rows in plan.warm_rows():
                for ids_dtype in ID_DTYPES:
                    n += int(launch.warmup(rows, ids_dtype))
    return n


def prewarm(model: torch.nn.Module) -> int:
    """Warm every reachable specialization of every planned MoE runtime in ``model``; returns the count.

    Raises RuntimeError naming the first layer that has no plan (run one eager forward first).
    """
    layers = moe_layers(model)
    for name, layer in layers:
        if not layer.planned:
            raise RuntimeError(
                f"EXL3 MoE prewarm: layer {layer.name or name} has no planned runtime; the eager profile pass "
                f"must plan every MoE layer (one forward, or MoELayerRuntime.plan(...)) before kernel prewarm")
    warmed, done = 0, set()
    for _, layer in layers:
        warmed += warm_layer(layer, done)
    if layers:
        log.info("EXL3 MoE prewarm: %d specializations over %d layers (%d runtimes)", warmed, len(layers), len(done))
    return warmed


__all__ = ["moe_layers", "prewarm", "warm_layer"]
