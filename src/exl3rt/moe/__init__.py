"""Mixed-bitrate MoE planning (docs/moe.md): tiers, route packing, decode/prefill plans, runtime cache, prewarm.

- :mod:`.tiers`: experts grouped by bitrate, the tier-ordered (combined) namespace, descriptors, rotations.
- :mod:`.routing`: top-k ids -> per-expert route blocks (torch reference, graph-friendly shapes).
- :mod:`.plan`: settings, decode/prefill plans, row slicing, the prefill block policy.
- :mod:`.launches`: launches shared across layers by key, per-layer bindings, owners (target vs draft).
- :mod:`.reference`: the torch reference launch (end-to-end on any device).
- :mod:`.triton_launch`: the Triton launch (tiered kernels of :mod:`exl3rt.kernels.moe`).
- :mod:`.tp` / :mod:`.rank_checkpoint`: tensor-parallel expert slicing, rank-sliced checkpoints (docs/moe_tp.md).
- :mod:`.prewarm`: warm every reachable specialization before serving.
"""

from .plan import (DeviceFacts, LayerGeometry, MoESettings, Plan, PlanError, PlanPolicy, Slice,
                   auto_prefill_block_m, query_device_facts, resolve_policy)
from .prewarm import moe_layers, prewarm
from .reference import DenseExpert, ReferenceLaunch, expert_from_linears, reference_launch_factory
from ..kernels.routing import NO_EXPERT, RoutePack, max_route_blocks, pack_routes, route_capacity
from .launches import (MOE_ATTR, Launch, MoELayerRuntime, MoERuntime, MoERuntimeCache, Owner, RuntimeKey,
                      ScratchArena, attach, is_capturing, is_draft_name, scope_token)
from .triton_launch import AutoLaunch, TritonMoELaunch, auto_launch_factory, fused_supported, triton_launch_factory
from .tp import (TPError, dense_experts, expert_shape, moe_partial, rank_bounds, slice_encoded, slice_expert,
                 tp_moe_forward)
from .rank_checkpoint import (LayerMeta, RankCheckpointError, RankLayer, RankMetadata, load_rank_sliced,
                              read_rank_metadata, save_rank_sliced)
from .tiers import (Tier, TierError, TierLayout, TierRotations, tier_rotations, tiers_from_bitrates,
                    tiers_from_experts, tiers_from_partition)

__all__ = [
    "DenseExpert", "DeviceFacts", "Launch", "LayerGeometry", "MOE_ATTR", "MoELayerRuntime", "MoERuntime",
    "MoERuntimeCache", "MoESettings", "NO_EXPERT", "Owner", "Plan", "PlanError", "PlanPolicy", "ReferenceLaunch",
    "RoutePack", "RuntimeKey", "ScratchArena", "Slice", "Tier", "TierError", "TierLayout", "TierRotations",
    "attach", "auto_prefill_block_m", "expert_from_linears", "is_capturing", "is_draft_name", "max_route_blocks",
    "moe_layers", "pack_routes", "prewarm", "query_device_facts", "reference_launch_factory", "resolve_policy",
    "route_capacity", "scope_token", "tier_rotations", "tiers_from_bitrates", "tiers_from_experts",
    "tiers_from_partition", "TritonMoELaunch", "triton_launch_factory", "AutoLaunch", "auto_launch_factory",
    "fused_supported", "TPError", "dense_experts", "expert_shape", "moe_partial", "rank_bounds", "slice_encoded",
    "slice_expert", "tp_moe_forward", "LayerMeta", "RankCheckpointError", "RankLayer", "RankMetadata",
    "load_rank_sliced", "read_rank_metadata", "save_rank_sliced",
]
