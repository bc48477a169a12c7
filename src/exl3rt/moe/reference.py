"""Torch reference launch: the plan + route-pack + dispatch path, with the expert math in plain torch.

For each live block of the packed routes (:func:`~exl3rt.kernels.routing.pack_routes`, combined ids)::

    e      = block_experts[j]                      combined expert of block j
    r      = sorted_routes[j·b : (j+1)·b]          its routes (padding = numel, skipped)
    t, s   = r // k, r % k                         token and top-k slot of each route
    out[t] += topk_weights[t, s] · expert_e(x[t])  accumulated in fp32, cast to x's dtype

``expert_e`` is any callable ``[n, H] -> [n, H]``: a :class:`DenseExpert`
(``down(act(x·gate) * (x·up))``), :func:`expert_from_linears` over EXL3 / dense linears, or a
test's own function. The launch binds a layer by reordering its per-expert callables into the
combined (tier) order and moving the global→combined map to the device, once per layer.

It is a reference (one host sync per call to count the live blocks), not a fast path; the fused
kernel implements the same :class:`~exl3rt.moe.launches.Launch` hooks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .plan import Plan
from ..kernels.routing import RoutePack, pack_routes
from .launches import MoELayerRuntime, RuntimeKey, ScratchArena

Expert = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class DenseExpert:
    """``y = down(act(x·gate) * (x·up))`` (``act(x·up)`` when ``gate`` is None); weights ``[in, out]``."""

    up: torch.Tensor                  # [H, I]
    down: torch.Tensor                # [I, H]
    gate: Optional[torch.Tensor] = None   # [H, I]
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        up = x @ self.up.to(x.dtype)
        h = self.act(x @ self.gate.to(x.dtype)) * up if self.gate is not None else self.act(up)
        return h @ self.down.to(x.dtype)


def expert_from_linears(up: Expert, down: Expert, gate: Optional[Expert] = None,
                        act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> Expert:
    """An expert from three linear modules (e.g. :class:`~exl3rt.runtime.linear.Exl3Linear`)."""
    if gate is None:
        return lambda x: down(act(up(x)))
    return lambda x: down(act(gate(x)) * up(x))


@dataclasses.dataclass
class ReferenceBinding:
    """A layer bound to a reference launch: experts in combined order, the expert map on the device."""

    layer: str
    experts: tuple[Expert, ...]
    expert_map: torch.Tensor


class ReferenceLaunch:
    """:class:`~exl3rt.moe.launches.Launch` in plain torch (any device); see the module docstring."""

    def __init__(self, key: RuntimeKey, plan: Plan, arena: ScratchArena):
        self.key = key
        self.plan = plan
        self.routes: RoutePack = arena.route_buffers(plan)
        self.compiled = False
        self.warmed: set[tuple[int, torch.dtype]] = set()

    def compile(self) -> None:
        self.compiled = True

    def bind(self, layer: MoELayerRuntime) -> ReferenceBinding:
        experts = layer.weights
        if len(experts) != layer.layout.num_experts:
            raise ValueError(f"{layer.name}: {len(experts)} expert callables for {layer.layout.num_experts} experts")
        ordered = tuple(experts[g] for g in layer.layout.combined_to_global)
        return ReferenceBinding(layer.name, ordered,
                                layer.layout.global_to_combined_tensor(torch.device(self.key.device)))

    def warmup(self, rows: int, ids_dtype: torch.dtype) -> int:
        """Pack ``rows`` rows of ids (nothing is compiled lazily here; the count is the specializations visited)."""
        ids = (torch.arange(rows * self.plan.top_k, device=self.key.device) % self.plan.num_experts)
        pack_routes(ids.reshape(rows, self.plan.top_k).to(ids_dtype), self.plan.num_experts, self.plan.block_m,
                    out=self.routes)
        self.warmed.add((rows, ids_dtype))
        return 1

    def run(self, binding: ReferenceBinding, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            out: torch.Tensor) -> None:
        k, b = self.plan.top_k, self.plan.block_m
        numel = topk_ids.numel()
        pack = pack_routes(topk_ids, self.plan.num_experts, b, expert_map=binding.expert_map, out=self.routes)
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        n_blocks = int(pack.num_blocks())
        blocks = pack.block_experts[:n_blocks].tolist()
        for j, e in enumerate(blocks):
            r = pack.sorted_routes[j * b:(j + 1) * b].to(torch.int64)
            r = r[r < numel]
            tok, slot = r // k, r % k
            y = binding.experts[e](x[tok]).float() * topk_weights[tok, slot].float()[:, None]
            acc.index_add_(0, tok, y)
        out.copy_(acc.to(out.dtype))


def reference_launch_factory(key: RuntimeKey, plan: Plan, arena: ScratchArena) -> ReferenceLaunch:
    """The :data:`~exl3rt.moe.launches.LaunchFactory` of the reference launch."""
    return ReferenceLaunch(key, plan, arena)


__all__ = ["DenseExpert", "Expert", "ReferenceBinding", "ReferenceLaunch", "expert_from_linears",
           "reference_launch_factory"]
