"""``torch.ops.exl3rt.moe``: an MoE layer call as one opaque custom op.

``exl3rt::moe(x, topk_ids, topk_weights, handle) -> y``: ``x [tokens, H]``, ``topk_ids`` / ``topk_weights``
``[tokens, top_k]``, ``y [tokens, H]`` (``Σ_j w_j · expert_{id_j}(x)``, the layer's own arithmetic). ``handle``
names the layer object (a :class:`~exl3rt.moe.MoELayerRuntime`, or any object with ``moe_forward(x, ids,
weights)``) registered with :func:`register`: a compiler sees one node per layer and never traces the route
packing, the planning or the per-expert loop, which all run inside the op (as vLLM names its attention layers
to its custom ops). The registry holds weak references: a layer that is freed leaves it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

_LAYERS: dict[int, "weakref.ref[Any]"] = {}
_HANDLES = itertools.count(1)


def register(layer: Any) -> int:
    """A handle for ``layer`` (its ``moe_forward`` runs when the op is called with it)."""
    handle = next(_HANDLES)
    _LAYERS[handle] = weakref.ref(layer)
    weakref.finalize(layer, _LAYERS.pop, handle, None)
    return handle


def registered(handle: int) -> Any:
    ref = _LAYERS.get(int(handle))
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError(f"exl3rt::moe: no live MoE layer has handle {handle} (the layer was freed, or the "
                           f"compiled graph outlived its model)")
    return layer


@torch.library.custom_op("exl3rt::moe", mutates_args=())
def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int) -> torch.Tensor:
    return registered(handle).moe_forward(x, topk_ids, topk_weights)


@moe.register_fake
def _(x, topk_ids, topk_weights, handle):
    return torch.empty_like(x)


def call_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int) -> torch.Tensor:
    """``torch.ops.exl3rt.moe(...)`` where anything traces (torch.compile, export, tensor subclasses); in plain
    eager mode the layer's ``moe_forward`` directly: the dispatch of a Python custom op costs host time
    (~20 µs) that an eager decode step pays per layer."""
    if type(x) is torch.Tensor and not torch.compiler.is_compiling():
        return registered(handle).moe_forward(x, topk_ids, topk_weights)
    return torch.ops.exl3rt.moe(x, topk_ids, topk_weights, handle)


__all__ = ["moe", "call_moe", "register", "registered"]
