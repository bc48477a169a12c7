"""Runtime cache, per-layer bindings and ownership of planned MoE launches.

Objects, from shared to per layer:

- :class:`Launch` — a compiled specialization of the fused MoE for one :class:`~exl3rt.moe.plan.Plan`
  (the kernel plugs in here; :mod:`exl3rt.moe.reference` is the torch reference). It has hooks
  ``compile()``, ``bind(layer) -> binding``, ``warmup(rows, ids_dtype) -> int`` and
  ``run(binding, x, topk_ids, topk_weights, out)``.
- :class:`MoERuntime` — the launches (decode, prefill) and the :class:`ScratchArena` of one
  :class:`RuntimeKey`. Every layer with the same key shares it; the key holds everything a
  launch or its arena is sized or compiled for, **including the tier counts** (two layers of
  206/50 and 160/96 experts never share, even at equal shapes).
- :class:`MoERuntimeCache` — the runtimes of one owner scope, e.g. one per model. Planning (a miss)
  while a CUDA graph is being captured is an error: plan in an eager pass first.
- :class:`MoELayerRuntime` — one layer: its tiers, weights and rotations, its plan policy (resolved
  once), and its bindings to the shared launches (made once per launch, not per call). Its
  :meth:`~MoELayerRuntime.forward` slices rows by the policy and runs the launches.

Ownership: a target model and its draft / speculator (MTP, EAGLE, …) never share runtimes or
arenas, even when their layers look alike (GLM's MTP layer is named ``model.layers.78``). The
:class:`Owner` of a layer is ``(scope token, is_draft)``; an explicit ``is_draft`` wins over the
name rule (:func:`is_draft_name`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
from typing import Any, Callable, Optional, Protocol

import torch

from .plan import (BlockPolicy, DeviceFacts, LayerGeometry, MoESettings, Plan, PlanError, PlanPolicy,
                   auto_prefill_block_m, query_device_facts, resolve_policy)
from ..kernels.routing import ID_DTYPES, RoutePack
from .op import call_moe, register as register_moe_layer
from .tiers import TierLayout, TierRotations

log = logging.getLogger("exl3rt.moe")

#: attribute under which a module carries its :class:`MoELayerRuntime` (see :func:`attach`)
MOE_ATTR = "exl3rt_moe"

_DRAFT_NAME = re.compile(r"mtp|nextn|eagle|draft|speculator")
_SCOPE_ATTR = "_exl3rt_moe_scope"
_scope_ids = itertools.count(1)


# ---- ownership ------------------------------------------------------------------------------------
def is_draft_name(name: str) -> bool:
    """True for draft / speculator module names (containing mtp, nextn, eagle, draft or speculator)."""
    return bool(_DRAFT_NAME.search(name.lower()))


def scope_token(obj: Any) -> int:
    """A process-unique int stamped on ``obj`` (a model or a config) on first use.

    Unlike ``id()``, a token is never reused after ``obj`` is freed.
    """
    token = getattr(obj, _SCOPE_ATTR, None)
    if token is None:
        token = next(_scope_ids)
        try:
            object.__setattr__(obj, _SCOPE_ATTR, token)
        except (AttributeError, TypeError):
            raise TypeError(f"cannot stamp a MoE runtime scope on {type(obj).__name__}; pass a model or "
                            f"config object that accepts attributes") from None
    return token


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who owns a runtime: a scope (model) and its role. Different owners never share runtimes."""

    scope: int
    is_draft: bool = False

    @classmethod
    def of(cls, scope: Any, name: str = "", is_draft: Optional[bool] = None) -> "Owner":
        """Owner of layer ``name`` in ``scope`` (an object, stamped by :func:`scope_token`, or an int token)."""
        token = scope if isinstance(scope, int) else scope_token(scope)
        return cls(token, bool(is_draft) if is_draft is not None else is_draft_name(name))


# ---- capture ----------------------------------------------------------------------------------------
def is_capturing() -> bool:
    """True while the current CUDA stream captures a graph (False without CUDA)."""
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


# ---- keys, launches, arenas ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RuntimeKey:
    """Everything a runtime's launches and arena depend on; equal keys share one :class:`MoERuntime`."""

    owner: Owner
    device: str
    x_dtype: torch.dtype
    ids_dtype: torch.dtype
    hidden: int
    intermediate: int
    tier_signature: tuple
    codebooks: tuple
    num_experts: int
    top_k: int
    max_decode_m: int
    max_batched: int
    prefill_capacity: int
    decode_block_m: int
    prefill_block_m: Optional[int]
    broadcast_suh: bool
    broadcast_svh: bool

    @classmethod
    def make(cls, owner: Owner, device: torch.device, x_dtype: torch.dtype, ids_dtype: torch.dtype,
             policy: PlanPolicy) -> "RuntimeKey":
        g = policy.geometry
        return cls(owner=owner, device=str(device), x_dtype=x_dtype, ids_dtype=ids_dtype, hidden=g.hidden,
                   intermediate=g.intermediate, tier_signature=g.tier_signature, codebooks=g.codebooks,
                   num_experts=g.num_experts, top_k=g.top_k, max_decode_m=policy.max_decode_m,
                   max_batched=policy.max_batched, prefill_capacity=policy.prefill_capacity,
                   decode_block_m=policy.decode.block_m,
                   prefill_block_m=policy.prefill.block_m if policy.prefill is not None else None,
                   broadcast_suh=g.broadcast_suh, broadcast_svh=g.broadcast_svh)


class ScratchArena:
    """Scratch shared by the layers of one runtime: route buffers per plan (allocated at planning)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._routes: dict[tuple[int, int, int, int], RoutePack] = {}

    def route_buffers(self, plan: Plan) -> RoutePack:
        """Route-pack buffers sized for ``plan`` (one set per plan geometry)."""
        key = (plan.max_rows, plan.top_k, plan.num_experts, plan.block_m)
        if key not in self._routes:
            self._routes[key] = RoutePack.allocate(plan.max_rows * plan.top_k, plan.num_experts, plan.block_m,
                                                   self.device)
        return self._routes[key]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._routes.values())


class Launch(Protocol):
    """A compiled MoE specialization for one plan (the fused kernel implements this)."""

    plan: Plan

    def compile(self) -> None:
        """Build what the plan needs (called once, at planning, never under capture)."""

    def bind(self, layer: "MoELayerRuntime") -> Any:
        """Per-layer fixed artifacts (weights, maps, rotations) for :meth:`run`; called once per layer."""

    def warmup(self, rows: int, ids_dtype: torch.dtype) -> int:
        """Load every lazy specialization a call of ``rows`` rows with ``ids_dtype`` ids needs; returns how many."""

    def run(self, binding: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            out: torch.Tensor) -> None:
        """``out [m, H] = Σ_k w[t,k]·expert(ids[t,k])(x[t])`` for ``m ≤ plan.max_rows`` rows."""


#: ``(key, plan, arena) -> Launch``
LaunchFactory = Callable[[RuntimeKey, Plan, ScratchArena], Launch]


@dataclasses.dataclass
class MoERuntime:
    """Launches and scratch shared by every layer with ``key``."""

    key: RuntimeKey
    policy: PlanPolicy
    launches: dict[str, Launch]
    arena: ScratchArena

    def launch_for(self, plan: Plan) -> Launch:
        return self.launches[plan.kind]


class MoERuntimeCache:
    """Runtimes of one scope by :class:`RuntimeKey` (create one per model or quantization config).

    ``launch_factory`` makes a :class:`Launch` per plan; ``capturing`` and ``device_facts`` are
    injectable (tests, other backends).
    """

    def __init__(self, launch_factory: LaunchFactory, *, capturing: Callable[[], bool] = is_capturing,
                 device_facts: Callable[[torch.device], DeviceFacts] = query_device_facts):
        self.launch_factory = launch_factory
        self.capturing = capturing
        self.device_facts = device_facts
        self._runtimes: dict[RuntimeKey, MoERuntime] = {}

    def __len__(self) -> int:
        return len(self._runtimes)

    def runtimes(self) -> list[MoERuntime]:
        return list(self._runtimes.values())

    def get(self, key: RuntimeKey, policy: PlanPolicy, *, layer: str = "") -> MoERuntime:
        """The runtime of ``key``: shared if planned, else planned now (never during graph capture)."""
        rt = self._runtimes.get(key)
        if rt is not None:
            return rt
        if self.capturing():
            raise RuntimeError(
                f"{layer or 'MoE layer'}: the EXL3 MoE runtime is not planned and a CUDA graph is being captured; "
                f"planning allocates and compiles, so run one eager forward (or call plan()) before capture")
        arena = ScratchArena(torch.device(key.device))
        launches = {}
        for plan in policy.plans:
            arena.route_buffers(plan)
            launch = self.launch_factory(key, plan, arena)
            launch.compile()
            launches[plan.kind] = launch
        rt = MoERuntime(key=key, policy=policy, launches=launches, arena=arena)
        self._runtimes[key] = rt
        pre = policy.prefill
        log.info("EXL3 MoE runtime planned for %s: tiers=%s decode=%d rows block %d, prefill=%s, scratch %.1f KiB",
                 layer or "a layer", key.tier_signature, policy.decode.max_rows, policy.decode.block_m,
                 f"{pre.max_rows}/{policy.max_batched} rows block {pre.block_m}" if pre else "none",
                 arena.nbytes / 1024)
        return rt


# ---- one layer ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Bound:
    runtime: MoERuntime
    bindings: dict[str, Any]


class MoELayerRuntime:
    """One MoE layer: tiers + weights, plan policy (resolved once) and bindings to shared launches.

    ``weights`` is whatever the launches bind (the reference launch takes one callable per global
    expert). ``layer(x [m, H], topk_ids [m, k] int32|int64, topk_weights [m, k]) -> [m, H]`` is one
    ``torch.ops.exl3rt.moe`` call (:mod:`exl3rt.moe.op`), which runs :meth:`forward`.
    """

    def __init__(self, name: str, layout: TierLayout, weights: Any, *, hidden: int, intermediate: int,
                 top_k: int, settings: MoESettings, cache: MoERuntimeCache, owner: Owner,
                 rotations: Optional[TierRotations] = None, block_policy: BlockPolicy = auto_prefill_block_m):
        if not 0 < top_k <= layout.num_experts:
            raise PlanError(f"{name}: top_k={top_k} must be in 1..{layout.num_experts} (the number of experts)")
        self.name = name
        self.layout = layout
        self.weights = weights
        self.rotations = rotations
        self.settings = settings
        self.cache = cache
        self.owner = owner
        self.block_policy = block_policy
        self.geometry = LayerGeometry(
            hidden=int(hidden), intermediate=int(intermediate), num_experts=layout.num_experts, top_k=int(top_k),
            tier_signature=layout.signature, codebooks=layout.codebooks,
            broadcast_suh=bool(rotations.broadcast_suh) if rotations is not None else False,
            broadcast_svh=bool(rotations.broadcast_svh) if rotations is not None else False)
        self.policy: Optional[PlanPolicy] = None
        self.device: Optional[torch.device] = None
        self.x_dtype: Optional[torch.dtype] = None
        self._bound: dict[torch.dtype, _Bound] = {}
        self.handle = register_moe_layer(self)

    @property
    def planned(self) -> bool:
        return bool(self._bound)

    def runtimes(self) -> list[MoERuntime]:
        """The runtimes this layer is bound to (one per route-id dtype it has seen)."""
        return [b.runtime for b in self._bound.values()]

    def _resolve(self, device: torch.device) -> PlanPolicy:
        if self.policy is None:
            facts = self.cache.device_facts(device)
            self.policy = resolve_policy(self.geometry, self.settings, facts, block_policy=self.block_policy)
            if self.policy.prefill is not None:
                pre = self.policy.prefill
                log.info("%s: prefill block_m=%d (%s)", self.name, pre.block_m,
                         "explicit" if self.policy.prefill_block_explicit else
                         "automatic policy; from row count " + ", ".join(f"{r}: {m}" for r, m in pre.block_steps))
        return self.policy

    def plan(self, device: torch.device | str, x_dtype: torch.dtype,
             ids_dtype: torch.dtype = torch.int32) -> MoERuntime:
        """Plan (or join) the runtime for these inputs and bind this layer to its launches."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if ids_dtype not in ID_DTYPES:
            raise TypeError(f"{self.name}: topk_ids dtype {ids_dtype} is not int32 or int64")
        if self.device is not None and (self.device != device or self.x_dtype != x_dtype):
            raise RuntimeError(
                f"{self.name}: EXL3 MoE runtime geometry changed after planning: planned for "
                f"{self.device}/{self.x_dtype}, called with {device}/{x_dtype}; keep the layer on one device "
                f"and dtype, or build a new layer runtime")
        bound = self._bound.get(ids_dtype)
        if bound is not None:
            return bound.runtime
        policy = self._resolve(device)
        key = RuntimeKey.make(self.owner, device, x_dtype, ids_dtype, policy)
        runtime = self.cache.get(key, policy, layer=self.name)
        bindings = {kind: launch.bind(self) for kind, launch in runtime.launches.items()}
        self.device, self.x_dtype = device, x_dtype
        self._bound[ids_dtype] = _Bound(runtime, bindings)
        return runtime

    def _check_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        g = self.geometry
        if topk_ids.dtype not in ID_DTYPES:
            raise TypeError(f"{self.name}: topk_ids dtype {topk_ids.dtype} is not int32 or int64")
        if x.dim() != 2 or x.shape[1] != g.hidden:
            raise ValueError(f"{self.name}: x must be [rows, {g.hidden}], got {tuple(x.shape)}")
        want = (x.shape[0], g.top_k)
        for label, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tuple(t.shape) != want:
                raise ValueError(f"{self.name}: {label} must be {list(want)} for x {tuple(x.shape)} "
                                 f"(top_k={g.top_k}), got {tuple(t.shape)}")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self._check_inputs(x, topk_ids, topk_weights)
        m = int(x.shape[0])
        self._resolve(x.device).check_rows(m, layer=self.name)  # before planning anything new
        runtime = self.plan(x.device, x.dtype, topk_ids.dtype)
        bound = self._bound[topk_ids.dtype]
        out = torch.empty_like(x)
        for s in runtime.policy.slices(m, layer=self.name):
            rows = slice(s.start, s.start + s.rows)
            runtime.launch_for(s.plan).run(bound.bindings[s.plan.kind], x[rows], topk_ids[rows],
                                           topk_weights[rows], out[rows])
        return out

    moe_forward = forward

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return call_moe(x, topk_ids, topk_weights, self.handle)

    def __repr__(self) -> str:
        return f"MoELayerRuntime({self.name}, {self.layout!r}, planned={self.planned})"


def attach(module: torch.nn.Module, layer: MoELayerRuntime) -> MoELayerRuntime:
    """Mark ``module`` as an EXL3 MoE layer run by ``layer`` (what :func:`~exl3rt.moe.prewarm.prewarm` looks for)."""
    object.__setattr__(module, MOE_ATTR, layer)
    return layer


__all__ = ["Launch", "LaunchFactory", "MOE_ATTR", "MoELayerRuntime", "MoERuntime", "MoERuntimeCache", "Owner",
           "RuntimeKey", "ScratchArena", "attach", "is_capturing", "is_draft_name", "scope_token"]
