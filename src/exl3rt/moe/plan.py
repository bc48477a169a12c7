"""Decode and prefill plans: which launch runs ``m`` rows, with which route block, in which slices.

A MoE layer is planned once for a declared maximum batch ``max_batched`` (the most rows one
forward may carry, e.g. a server's max batched tokens):

- the **decode plan** runs ``m ≤ max_decode_m`` rows (default 32, capped at ``max_batched``) with a
  small route block (``decode_block_m``, default 8): few routes per expert, little padding;
- the **prefill plan** (only when ``max_batched > max_decode_m``) has an arena of
  ``prefill_capacity`` rows (default ``max_batched``) and route block ``prefill_block_m``;
  ``m > prefill_capacity`` runs in capacity-sized slices with an exact tail
  (capacity 128, m = 200 → slices of 128 and 72 rows, both on the prefill plan);
- ``m > max_batched`` is an error (the arenas were sized for ``max_batched``).

The prefill block is 64 unless set. When it is not set, an automatic policy (a hook,
:func:`auto_prefill_block_m` by default) chooses the block from the layer's geometry, the device and
a row count: for the arena (``capacity``: the plan's ``block_m``, which sizes its route capacity)
and for each call's own row count (``Plan.block_for``: the steps of the policy over the plan's rows,
found by bisection when the layer is planned — a call of 100 rows in an arena of 8192 runs with the
block for 100 rows, not the arena's); an explicit setting (argument or ``EXL3RT_MOE_PREFILL_BLOCK_M``)
always wins, for every call, and the hook is not consulted. Everything here is resolved once per layer
(:func:`resolve_policy`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, Mapping, Optional

import torch

from .. import env
from ..format.bits import Bits
from ..util.ints import next_pow2
from ..kernels.routing import max_route_blocks, route_capacity

DEFAULT_MAX_DECODE_M = 32
DEFAULT_DECODE_BLOCK_M = 8
DEFAULT_PREFILL_BLOCK_M = 64
LARGE_PREFILL_BLOCK_M = 128   # only where the wgmma tiered launch runs (DeviceFacts.wgmma)
SMALL_PREFILL_BLOCK_M = 32
TINY_PREFILL_BLOCK_M = 16

PlanKind = Literal["decode", "prefill"]


class PlanError(ValueError):
    """A plan cannot be made or cannot run ``m`` rows; the message names the values and the fix."""


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """What the caller declares for planning. ``None`` fields take their defaults.

    ``max_batched``: most rows one forward may carry (required). ``max_decode_m``: rows of the
    decode plan (32). ``prefill_capacity``: prefill arena rows (``max_batched``). ``prefill_block_m``:
    ``None`` = automatic, an int = explicit. ``decode_block_m``: 8.
    """

    max_batched: int
    max_decode_m: int = DEFAULT_MAX_DECODE_M
    prefill_capacity: Optional[int] = None
    prefill_block_m: Optional[int] = None
    decode_block_m: int = DEFAULT_DECODE_BLOCK_M

    def __post_init__(self) -> None:
        for name in ("max_batched", "max_decode_m", "prefill_capacity", "prefill_block_m", "decode_block_m"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise PlanError(f"MoE settings: {name} must be a positive integer, got {value!r}")
        if self.prefill_capacity is not None and self.prefill_capacity > self.max_batched:
            raise PlanError(
                f"MoE settings: prefill capacity cannot exceed max_batched: capacity={self.prefill_capacity}, "
                f"max_batched={self.max_batched}; lower EXL3RT_MOE_PREFILL_CAPACITY or declare a larger max batch")

    @classmethod
    def from_env(cls, max_batched: int, *, environ: Optional[Mapping[str, str]] = None,
                 max_decode_m: Optional[int] = None, prefill_capacity: Optional[int] = None,
                 prefill_block_m: Optional[int] = None,
                 decode_block_m: int = DEFAULT_DECODE_BLOCK_M) -> "MoESettings":
        """Settings with the ``EXL3RT_MOE_*`` variables filling what the arguments leave ``None``."""
        e = None if environ is None else dict(environ)
        return cls(
            max_batched=max_batched,
            max_decode_m=max_decode_m if max_decode_m is not None else env.MOE_MAX_DECODE_M.get(e),
            prefill_capacity=prefill_capacity if prefill_capacity is not None else env.MOE_PREFILL_CAPACITY.get(e),
            prefill_block_m=prefill_block_m if prefill_block_m is not None else env.MOE_PREFILL_BLOCK_M.get(e),
            decode_block_m=decode_block_m,
        )


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """What a plan depends on besides the settings (all part of the runtime key)."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    tier_signature: tuple[tuple[Bits, int], ...]
    codebooks: tuple[Optional[str], ...] = ()
    broadcast_suh: bool = False
    broadcast_svh: bool = False


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """Device properties a block policy or a kernel may use (zeros where unknown, e.g. CPU)."""

    type: str
    index: Optional[int] = None
    capability: tuple[int, int] = (0, 0)
    sms: int = 0
    shared_mem: int = 0
    #: the wgmma tiered launch runs here (``exl3rt.kernels.wgmma.available``: Hopper, Gluon, not turned off)
    wgmma: bool = False


def query_device_facts(device: torch.device) -> DeviceFacts:
    """Facts of ``device`` (queries CUDA properties for a CUDA device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceFacts(type=device.type, index=device.index)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    try:
        from ..kernels.wgmma import available
        wgmma = available(torch.device("cuda", index))
    except ImportError:  # pragma: no cover - no Triton
        wgmma = False
    return DeviceFacts(type="cuda", index=index, capability=(props.major, props.minor),
                       sms=props.multi_processor_count,
                       shared_mem=int(getattr(props, "shared_memory_per_block_optin", 0)), wgmma=wgmma)


#: ``(geometry, facts, rows) -> prefill block_m`` (rows: the arena's capacity, or a call's row count; it must not
#: decrease with the rows); consulted only when no block is set
BlockPolicy = Callable[[LayerGeometry, DeviceFacts, int], int]


def auto_prefill_block_m(geometry: LayerGeometry, facts: DeviceFacts, capacity: int) -> int:
    """The automatic prefill block from the routes an average expert gets in a call of ``capacity`` rows
    (``capacity·top_k / E``; asked for the arena and, by bisection, for the calls' row counts): 16 below 16
    routes, 32 below 32,
    64 below 64, else 128 where the wgmma tiered launch runs (``facts.wgmma``) and 64 elsewhere. The block
    just above the average count holds most experts' routes in one block: each weight tile is decoded once
    per expert instead of twice, for some padding (the measured crossovers: docs/moe.md, "Tuned constants").
    """
    routes_per_expert = capacity * geometry.top_k / geometry.num_experts
    if routes_per_expert < TINY_PREFILL_BLOCK_M:
        return TINY_PREFILL_BLOCK_M
    if routes_per_expert < SMALL_PREFILL_BLOCK_M:
        return SMALL_PREFILL_BLOCK_M
    if routes_per_expert < DEFAULT_PREFILL_BLOCK_M or not facts.wgmma:
        return DEFAULT_PREFILL_BLOCK_M
    return LARGE_PREFILL_BLOCK_M


@dataclasses.dataclass(frozen=True)
class Plan:
    """One launch specialization: up to ``max_rows`` rows with route block ``block_m``."""

    kind: PlanKind
    max_rows: int
    block_m: int
    top_k: int
    num_experts: int
    #: smallest row count this plan receives (decode: 1; prefill: max_decode_m + 1, or 1 when it slices)
    min_rows: int = 1
    #: automatic prefill blocks: ``(first row count, block_m)`` ascending from ``min_rows`` (empty: ``block_m``
    #: for every call); a call runs with the block of the last step at or below its row count
    block_steps: tuple[tuple[int, int], ...] = ()

    def block_for(self, rows: int) -> int:
        """The route block a call of ``rows`` rows runs with: the policy's block for that row count (its step),
        else ``block_m``."""
        return next((m for first, m in reversed(self.block_steps) if first <= rows), self.block_m)

    def warm_rows(self) -> tuple[int, ...]:
        """Row counts that together meet every specialization of calls of ``min_rows … max_rows`` rows: the
        first and the last row count of each route block's range inside each row bucket. The kernels
        specialize on the route block and, through the packer's sort width, on the route count (rows·top_k
        against fixed thresholds); both ends of a range at most a factor of two wide meet every sort width in
        it, whatever the top-k (with top-6 the width changes between 10 and 11 rows)."""
        out, lo = [], self.min_rows
        for b in self.row_buckets():
            starts = [lo] + [first for first, _ in self.block_steps if lo < first <= b]
            ends = [s - 1 for s in starts[1:]] + [b]
            for first, last in zip(starts, ends):
                out += [first] if first == last else [first, last]
            lo = b + 1
        return tuple(out)

    @property
    def route_capacity(self) -> int:
        """Padded-route slots of the arena (:func:`~exl3rt.kernels.routing.route_capacity` at ``max_rows``)."""
        return route_capacity(self.max_rows * self.top_k, self.num_experts, self.block_m)

    @property
    def max_blocks(self) -> int:
        return max_route_blocks(self.max_rows * self.top_k, self.num_experts, self.block_m)

    def bucket(self, rows: int) -> int:
        """Row bucket of a call with ``rows`` rows: the next power of two, capped at ``max_rows``."""
        return min(next_pow2(rows), self.max_rows)

    def row_buckets(self) -> tuple[int, ...]:
        """Every bucket a call of ``min_rows … max_rows`` rows falls into (what prewarm compiles)."""
        out, b = [], next_pow2(self.min_rows)
        while True:
            out.append(min(b, self.max_rows))
            if b >= self.max_rows:
                return tuple(out)
            b *= 2


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows ``start … start+rows`` of a forward, run by ``plan``."""

    start: int
    rows: int
    plan: Plan


@dataclasses.dataclass(frozen=True)
class PlanPolicy:
    """A layer's resolved plans. ``prefill`` is None when every allowed batch fits the decode plan."""

    geometry: LayerGeometry
    facts: DeviceFacts
    max_batched: int
    decode: Plan
    prefill: Optional[Plan]
    prefill_block_explicit: bool

    @property
    def max_decode_m(self) -> int:
        return self.decode.max_rows

    @property
    def prefill_capacity(self) -> int:
        return self.prefill.max_rows if self.prefill is not None else self.decode.max_rows

    @property
    def plans(self) -> tuple[Plan, ...]:
        return (self.decode,) if self.prefill is None else (self.decode, self.prefill)

    def check_rows(self, m: int, *, layer: str = "") -> None:
        """Raise PlanError if ``m`` rows cannot run (negative, or above the declared maximum)."""
        if m < 0:
            raise PlanError(f"{layer or 'MoE layer'}: negative row count m={m}")
        if m > self.max_batched:
            raise PlanError(
                f"{layer or 'MoE layer'}: batch exceeds the planned capacity: m={m}, capacity={self.max_batched} "
                f"(the declared max batch); split the batch or declare a larger max_batched")

    def slices(self, m: int, *, layer: str = "") -> list[Slice]:
        """How ``m`` rows run: one decode slice, one prefill slice, or capacity-sized prefill slices + tail."""
        self.check_rows(m, layer=layer)
        if m == 0:
            return []
        if m <= self.decode.max_rows or self.prefill is None:
            return [Slice(0, m, self.decode)]
        cap = self.prefill.max_rows
        return [Slice(s, min(cap, m - s), self.prefill) for s in range(0, m, cap)]


def resolve_policy(geometry: LayerGeometry, settings: MoESettings, facts: DeviceFacts, *,
                   block_policy: BlockPolicy = auto_prefill_block_m) -> PlanPolicy:
    """Plans for one layer. ``block_policy`` runs only when ``settings.prefill_block_m`` is None."""
    max_batched = settings.max_batched
    max_decode_m = min(settings.max_decode_m, max_batched)
    decode = Plan("decode", max_decode_m, settings.decode_block_m, geometry.top_k, geometry.num_experts)
    prefill = None
    explicit = settings.prefill_block_m is not None
    if max_batched > max_decode_m:
        capacity = settings.prefill_capacity or max_batched
        if explicit:
            block_m = settings.prefill_block_m
        else:
            block_m = int(block_policy(geometry, facts, capacity))
            if block_m <= 0:
                raise PlanError(f"prefill block policy returned block_m={block_m}; it must be positive")
        min_rows = 1 if max_batched > capacity else max_decode_m + 1
        prefill = Plan("prefill", capacity, block_m, geometry.top_k, geometry.num_experts, min_rows=min_rows)
        if not explicit:    # each call gets the block the policy picks for its row count
            prefill = dataclasses.replace(prefill, block_steps=_block_steps(
                lambda rows: block_m if rows == capacity else int(block_policy(geometry, facts, rows)),
                prefill.min_rows, capacity, prefill.row_buckets(), block_m))
    return PlanPolicy(geometry=geometry, facts=facts, max_batched=max_batched, decode=decode, prefill=prefill,
                      prefill_block_explicit=explicit)


def _block_steps(policy: Callable[[int], int], lo: int, hi: int, samples: tuple[int, ...],
                 arena_block: int) -> tuple[tuple[int, int], ...]:
    """``(first row count, block)`` steps of a block policy over ``lo … hi`` rows, found by bisection (the
    policy must not decrease with the row count; checked at ``samples``, the plan's row buckets)."""
    seen: dict[int, int] = {}

    def at(rows: int) -> int:
        if rows not in seen:
            bm = seen[rows] = policy(rows)
            if bm <= 0 or bm > arena_block:
                raise PlanError(f"prefill block policy returned block_m={bm} for {rows} rows; it must be positive "
                                f"and at most the arena's block ({arena_block} at {hi} rows)")
        return seen[rows]

    blocks = [at(r) for r in (lo,) + tuple(samples)]
    if any(b < a for a, b in zip(blocks, blocks[1:])):
        raise PlanError(f"prefill block policy is not non-decreasing in the row count: "
                        f"{dict(zip((lo,) + tuple(samples), blocks))}")
    steps, cur = [(lo, at(lo))], lo
    while at(hi) != steps[-1][1]:
        a, left, right = steps[-1][1], cur, hi          # at(left) == a != at(right)
        while right - left > 1:
            mid = (left + right) // 2
            left, right = (mid, right) if at(mid) == a else (left, mid)
        steps.append((right, at(right)))
        cur = right
    return tuple(steps)


__all__ = ["BlockPolicy", "DEFAULT_DECODE_BLOCK_M", "DEFAULT_MAX_DECODE_M", "DEFAULT_PREFILL_BLOCK_M", "DeviceFacts",
           "LARGE_PREFILL_BLOCK_M", "LayerGeometry", "MoESettings", "Plan", "PlanError", "PlanKind", "PlanPolicy",
           "SMALL_PREFILL_BLOCK_M", "TINY_PREFILL_BLOCK_M", "Slice", "auto_prefill_block_m", "next_pow2",
           "query_device_facts", "resolve_policy"]
