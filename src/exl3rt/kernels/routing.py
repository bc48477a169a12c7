"""Route packing: top-k expert ids -> per-expert blocks of ``block_m`` routes (torch reference, any device).

A *route* is one (token, slot) pair of the router's output ``topk_ids [T, k]``; its index is
``r = token·k + slot`` (the flattened position), ``numel = T·k``. A grouped MoE kernel processes
routes in blocks of ``block_m`` that all belong to one expert, so the routes are sorted by expert
(stable: token order inside an expert) and every expert's run is padded to a multiple of ``block_m``::

    topk_ids = [[2, 0], [2, 1]], block_m = 2, E = 3       (routes 0..3 -> experts 2, 0, 2, 1)
    sorted_routes = [1, 4,  3, 4,  0, 2,  4]              expert 0: route 1 + pad; 1: 3 + pad; 2: 0, 2
    block_experts = [0, 1, 2]                              one expert per block (-1 past the live blocks)
    num_padded    = [6]                                    live length of sorted_routes (3 blocks)
    expert_counts = [1, 1, 2]                              routes per expert, unpadded

Padding slots hold the sentinel ``numel`` (never a valid route index). The padded length is at
most :func:`route_capacity` ``= numel + min(E, numel)·(block_m − 1)`` — each expert adds at most
``block_m − 1`` padding, and at most ``min(E, numel)`` experts receive a route (the usual bound
``numel + E·(block_m − 1)`` is the same whenever ``E ≤ numel`` and looser otherwise).

Graph-friendly: every returned tensor has a size fixed by the capacity (``out`` may be
preallocated once per plan), and the live counts are tensors, so no step syncs with the host.

An ``expert_map`` (e.g. :meth:`TierLayout.global_to_combined_tensor`) renames router ids before
packing, so ``block_experts`` holds combined ids. Routes whose id (after mapping) is outside
``[0, E)`` — an expert-parallel sentinel, or ``-1`` in the map — are dropped: they appear in no block.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

#: ``block_experts`` value of a block past the live ones
NO_EXPERT = -1

ID_DTYPES = (torch.int32, torch.int64)


def route_capacity(numel: int, num_experts: int, block_m: int) -> int:
    """Padded slots needed by ``numel`` routes at most: ``numel + min(E, numel)·(block_m−1)``."""
    numel, num_experts, block_m = int(numel), int(num_experts), int(block_m)
    if numel < 0 or num_experts <= 0 or block_m <= 0:
        raise ValueError(f"route_capacity: need numel >= 0, num_experts > 0, block_m > 0; "
                         f"got numel={numel}, num_experts={num_experts}, block_m={block_m}")
    return numel + min(num_experts, numel) * (block_m - 1)


def max_route_blocks(numel: int, num_experts: int, block_m: int) -> int:
    """Most blocks: the padded length is a multiple of ``block_m`` and at most the capacity."""
    return route_capacity(numel, num_experts, block_m) // int(block_m)


@dataclasses.dataclass
class RoutePack:
    """Packed routes (see the module docstring). Sizes are fixed by ``max_numel``; counts are tensors.

    ``sorted_routes`` int32 ``[capacity]``, ``block_experts`` int32 ``[max_blocks]``,
    ``num_padded`` int32 ``[1]`` (live length of ``sorted_routes``), ``expert_counts`` int32 ``[E]``
    (routes per expert, unpadded).
    """

    sorted_routes: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    expert_counts: torch.Tensor
    max_numel: int
    num_experts: int
    block_m: int

    @classmethod
    def allocate(cls, max_numel: int, num_experts: int, block_m: int,
                 device: Union[torch.device, str, None] = None) -> "RoutePack":
        """Buffers for up to ``max_numel`` routes (allocate once per plan; reuse on every call)."""
        cap = route_capacity(max_numel, num_experts, block_m)
        return cls(sorted_routes=torch.empty(cap, dtype=torch.int32, device=device),
                   block_experts=torch.empty(cap // block_m, dtype=torch.int32, device=device),
                   num_padded=torch.zeros(1, dtype=torch.int32, device=device),
                   expert_counts=torch.zeros(num_experts, dtype=torch.int32, device=device),
                   max_numel=int(max_numel), num_experts=int(num_experts), block_m=int(block_m))

    @property
    def capacity(self) -> int:
        return int(self.sorted_routes.shape[0])

    @property
    def max_blocks(self) -> int:
        return int(self.block_experts.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.sorted_routes, self.block_experts, self.num_padded, self.expert_counts))

    def num_blocks(self) -> torch.Tensor:
        """Live blocks, int32 ``[1]`` (a tensor: no host sync)."""
        return self.num_padded // self.block_m


def pack_routes(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                expert_map: Optional[torch.Tensor] = None, out: Optional[RoutePack] = None) -> RoutePack:
    """Pack ``topk_ids [T, k]`` (int32 or int64) into per-expert blocks; returns ``out`` (filled) or a new pack.

    ``num_experts`` is the size of the namespace the blocks name (the combined namespace when
    ``expert_map [E_router]`` is given). ``out`` must have been allocated for at least ``T·k`` routes
    with the same ``num_experts`` and ``block_m``.
    """
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"pack_routes: topk_ids dtype {topk_ids.dtype} is not int32 or int64; "
                        f"cast the router's expert ids to an integer type")
    if topk_ids.dim() != 2:
        raise ValueError(f"pack_routes: topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    numel = topk_ids.numel()
    device = topk_ids.device
    if out is None:
        out = RoutePack.allocate(max(numel, 1), num_experts, block_m, device)
    elif out.num_experts != num_experts or out.block_m != block_m or out.max_numel < numel:
        raise ValueError(f"pack_routes: buffers are for <= {out.max_numel} routes, E={out.num_experts}, "
                         f"block_m={out.block_m}; this call has {numel} routes, E={num_experts}, block_m={block_m}; "
                         f"allocate the pack for the plan's capacity")
    E, b, cap = int(num_experts), int(block_m), out.capacity

    ids = topk_ids.reshape(-1).to(torch.int64)
    if expert_map is not None:
        n_map = int(expert_map.shape[0])
        in_map = (ids >= 0) & (ids < n_map)
        ids = torch.where(in_map, expert_map.to(torch.int64)[ids.clamp(0, max(n_map - 1, 0))], -1)
    valid = (ids >= 0) & (ids < E)
    bucket = torch.where(valid, ids, E)  # dropped routes sort into an extra bucket E

    counts = torch.zeros(E + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:E] + (b - 1)) // b * b
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    count_start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank = torch.arange(numel, device=device) - count_start[sorted_bucket]
    live = sorted_bucket < E
    dest = torch.where(live, pad_start[sorted_bucket.clamp(max=E - 1)] + rank, cap)  # dropped -> spare slot

    routes = torch.full((cap + 1,), numel, dtype=torch.int32, device=device)
    routes[dest] = order.to(torch.int32)
    out.sorted_routes.copy_(routes[:cap])

    starts = torch.arange(out.max_blocks, device=device, dtype=torch.int64) * b
    blk = torch.searchsorted(pad_end, starts, right=True)
    out.block_experts.copy_(torch.where(blk < E, blk, NO_EXPERT).to(torch.int32))
    out.num_padded.copy_(pad_end[-1:].to(torch.int32))
    out.expert_counts.copy_(counts[:E].to(torch.int32))
    return out


__all__ = ["ID_DTYPES", "NO_EXPERT", "RoutePack", "max_route_blocks", "pack_routes", "route_capacity"]
