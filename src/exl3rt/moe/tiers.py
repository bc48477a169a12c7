"""Expert tiers: the experts of one MoE layer grouped by bitrate, in one tier-ordered namespace.

A mixed-bitrate layer (e.g. 192 experts at K=3 and 64 at K=4) runs as one fused launch over all
experts; the launch sees each tier's weights stacked as one slab, so experts are renumbered:

- **tiers** are sorted by ascending K; inside a tier, experts keep ascending global id;
- the **combined** id of an expert is its position in that order (tier 0 first);
- ``global_to_combined[g]`` maps a router's expert id to the combined id, ``combined_to_global``
  is its inverse (the "tier order": ``index_select`` by it turns per-expert tables into combined order);
- a **descriptor** word tells the kernel where a combined expert lives:
  ``descriptor = (tier << shift) | local`` with ``local`` the index inside the tier's slab.
  ``shift`` is 8 when every tier holds at most 256 experts (the b12x convention, e.g. words
  ``[0, 1, 256, 257]``) and 16 otherwise; it follows from the tier signature, so runtimes keyed by
  the signature agree on it. :meth:`TierLayout.decode_descriptor` inverts it.

Example: bitrates ``[4, 3, 4, 3]`` → tiers ``K3: (1, 3)``, ``K4: (0, 2)``; combined order
``[1, 3, 0, 2]``; ``global_to_combined = [2, 0, 3, 1]``; descriptors ``[0, 1, 256, 257]``;
signature ``((3, 2), (4, 2))``.

Rotation tables (the Hadamard-side scale vectors) are per expert (``E`` rows) or broadcast (one
row shared by every expert, e.g. a shared-H checkpoint); :meth:`TierLayout.reorder_rows` puts a
per-expert table in combined order and leaves a broadcast one as it is. :func:`tier_rotations`
builds the whole set for a layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from ..format.bits import Bits, bits_from_width, normalize_bits, words16_per_tile
from ..format.errors import FormatError

#: descriptor shifts: narrow while every tier has at most 256 experts, wide otherwise
DESCRIPTOR_NARROW_SHIFT = 8
DESCRIPTOR_WIDE_SHIFT = 16


class TierError(ValueError):
    """Experts cannot be tiered as given; the message names the layer, the expert and the fix."""


def _where(layer: str) -> str:
    return layer or "MoE layer"


@dataclasses.dataclass(frozen=True)
class Tier:
    """One bitrate group: ``expert_ids`` (global, ascending) occupy combined slots ``offset …``."""

    index: int
    bits: Bits
    expert_ids: tuple[int, ...]
    offset: int
    codebook: Optional[str] = None

    @property
    def count(self) -> int:
        return len(self.expert_ids)


class TierLayout:
    """The tiers of one layer and the maps between global, combined and (tier, local) expert ids.

    Build with :func:`tiers_from_bitrates`, :func:`tiers_from_partition` or :func:`tiers_from_experts`.
    Maps are held as Python tuples; ``*_tensor(device)`` give int32 tensors for kernels.
    """

    def __init__(self, tiers: Sequence[Tier], num_experts: int, layer: str = ""):
        self.layer = layer
        self.num_experts = int(num_experts)
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        order = [g for t in self.tiers for g in t.expert_ids]
        self.combined_to_global: tuple[int, ...] = tuple(order)
        g2c = [0] * self.num_experts
        for c, g in enumerate(order):
            g2c[g] = c
        self.global_to_combined: tuple[int, ...] = tuple(g2c)
        self.combined_tier: tuple[int, ...] = tuple(t.index for t in self.tiers for _ in t.expert_ids)
        self.combined_local: tuple[int, ...] = tuple(i for t in self.tiers for i in range(t.count))
        widest = max((t.count for t in self.tiers), default=0)
        self.descriptor_shift = DESCRIPTOR_NARROW_SHIFT if widest <= (1 << DESCRIPTOR_NARROW_SHIFT) \
            else DESCRIPTOR_WIDE_SHIFT
        self.descriptors: tuple[int, ...] = tuple(
            (t << self.descriptor_shift) | loc for t, loc in zip(self.combined_tier, self.combined_local))

    # ---- facts -------------------------------------------------------------------------------
    @property
    def signature(self) -> tuple[tuple[Bits, int], ...]:
        """``((K, count), …)`` in tier order: part of every runtime key (counts included, see docs/moe.md)."""
        return tuple((t.bits, t.count) for t in self.tiers)

    @property
    def bits(self) -> tuple[Bits, ...]:
        return tuple(t.bits for t in self.tiers)

    @property
    def codebooks(self) -> tuple[Optional[str], ...]:
        return tuple(t.codebook for t in self.tiers)

    def bits_of(self, expert: int) -> Bits:
        """K of global expert ``expert``."""
        return self.tiers[self.combined_tier[self.global_to_combined[expert]]].bits

    def locate(self, combined: int) -> tuple[int, int]:
        """Combined id -> ``(tier index, local index inside the tier)``."""
        return self.combined_tier[combined], self.combined_local[combined]

    def decode_descriptor(self, word: int) -> tuple[int, int]:
        """Descriptor word -> ``(tier, local)``."""
        return word >> self.descriptor_shift, word & ((1 << self.descriptor_shift) - 1)

    def __repr__(self) -> str:
        tiers = ", ".join(f"K{t.bits}x{t.count}" for t in self.tiers)
        return f"TierLayout({_where(self.layer)}: {tiers}; E={self.num_experts})"

    # ---- tensors -------------------------------------------------------------------------------
    def tier_order_tensor(self, device: Union[torch.device, str, None] = None) -> torch.Tensor:
        """int64 ``[E]``: combined slot -> global id (the ``index_select`` order)."""
        return torch.tensor(self.combined_to_global, dtype=torch.int64, device=device)

    def global_to_combined_tensor(self, device: Union[torch.device, str, None] = None) -> torch.Tensor:
        """int32 ``[E]``: global id -> combined id (the expert map given to route packing)."""
        return torch.tensor(self.global_to_combined, dtype=torch.int32, device=device)

    def descriptor_tensor(self, device: Union[torch.device, str, None] = None) -> torch.Tensor:
        """int32 ``[E]``: combined id -> ``(tier << shift) | local``."""
        return torch.tensor(self.descriptors, dtype=torch.int32, device=device)

    # ---- per-expert tables -----------------------------------------------------------------------
    def reorder_rows(self, table: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
        """A per-expert table ``[E, …]`` in combined order, or a broadcast ``[1, …]`` unchanged.

        Returns ``(table, broadcast)``. Any other row count raises TierError naming ``name``.
        """
        rows = int(table.shape[0]) if table.dim() else 0
        if table.dim() >= 1 and rows == 1:
            return table, True
        if table.dim() >= 1 and rows == self.num_experts:
            return table.index_select(0, self.tier_order_tensor(table.device)), False
        raise TierError(
            f"{_where(self.layer)}.{name}: table of shape {tuple(table.shape)} has {rows} rows; expected 1 "
            f"(broadcast, one row shared by every expert) or {self.num_experts} (one row per expert); "
            f"store the vector once per layer or once per expert"
        )

    def check_geometry(self, shapes: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, tuple[int, int]]:
        """Check trellis shapes ``shapes[proj][global expert] = (in/16, out/16, 16·K)``.

        Inside a tier every expert must have the same shape and a width matching the tier's K;
        across tiers the tile grid ``(in/16, out/16)`` must agree (one H and I per layer).
        Returns ``{proj: (in/16, out/16)}``; raises TierError naming the layer, projection and expert.
        """
        grid: dict[str, tuple[int, int]] = {}
        where = _where(self.layer)
        for proj, per_expert in shapes.items():
            if len(per_expert) != self.num_experts:
                raise TierError(f"{where}.{proj}: {len(per_expert)} trellis shapes for {self.num_experts} experts; "
                                f"give one shape per expert")
            for tier in self.tiers:
                first = tier.expert_ids[0]
                ref = tuple(int(s) for s in per_expert[first])
                for g in tier.expert_ids:
                    shape = tuple(int(s) for s in per_expert[g])
                    if len(shape) != 3:
                        raise TierError(f"{where}: expert {g} {proj} trellis has shape {shape}; "
                                        f"expected [in/16, out/16, 16*K]")
                    if shape[-1] != words16_per_tile(tier.bits):
                        raise TierError(
                            f"{where}: expert {g} {proj} trellis width {shape[-1]} does not encode the tier's "
                            f"K={tier.bits} (expected {words16_per_tile(tier.bits)}); declare the bitrate the "
                            f"trellis was encoded with")
                    if shape != ref:
                        raise TierError(
                            f"{where}: geometry mismatch in tier K={tier.bits}: expert {g} {proj} trellis "
                            f"{shape} differs from expert {first} {ref}; every expert of a layer must have "
                            f"the same hidden and intermediate widths")
                if proj in grid and grid[proj] != ref[:2]:
                    raise TierError(
                        f"{where}: geometry mismatch between tiers: {proj} tile grid {ref[:2]} in tier "
                        f"K={tier.bits} (expert {first}) vs {grid[proj]} in an earlier tier; every expert of a "
                        f"layer must have the same hidden and intermediate widths")
                grid[proj] = ref[:2]
        return grid


# ---- construction --------------------------------------------------------------------------------
def _bits(value: Any, layer: str, what: str) -> Bits:
    try:
        return normalize_bits(value, name=what)
    except FormatError as exc:
        raise TierError(f"{_where(layer)}: {exc}") from None


def _layout(groups: Mapping[Bits, list[int]], num_experts: int, layer: str,
            codebooks: Optional[Mapping[Bits, Optional[str]]] = None) -> TierLayout:
    tiers, offset = [], 0
    for i, k in enumerate(sorted(groups)):
        ids = tuple(sorted(groups[k]))
        tiers.append(Tier(index=i, bits=k, expert_ids=ids, offset=offset,
                          codebook=(codebooks or {}).get(k)))
        offset += len(ids)
    return TierLayout(tiers, num_experts, layer)


def tiers_from_bitrates(bits_per_expert: Sequence[Bits], *, layer: str = "",
                        codebooks: Optional[Sequence[Optional[str]]] = None) -> TierLayout:
    """Tiers from one K per global expert (``bits_per_expert[g]``); any number of distinct K.

    ``codebooks[g]`` (optional) must agree inside a tier. Raises TierError for an invalid K.
    """
    if len(bits_per_expert) == 0:
        raise TierError(f"{_where(layer)}: no experts; a MoE layer needs at least one expert")
    groups: dict[Bits, list[int]] = {}
    books: dict[Bits, Optional[str]] = {}
    for g, raw in enumerate(bits_per_expert):
        k = _bits(raw, layer, f"expert {g} bitrate")
        groups.setdefault(k, []).append(g)
        if codebooks is not None:
            cb = codebooks[g]
            if k in books and books[k] != cb:
                raise TierError(f"{_where(layer)}: expert {g} uses codebook {cb!r} but tier K={k} uses "
                                f"{books[k]!r}; experts of one bitrate must share a codebook")
            books[k] = cb
    return _layout(groups, len(bits_per_expert), layer, books)


def tiers_from_partition(partition: Union[Mapping[Bits, Iterable[int]], Iterable[tuple[Bits, Iterable[int]]]],
                         num_experts: int, *, layer: str = "") -> TierLayout:
    """Tiers from ``{K: expert ids}`` (or ``[(K, ids), …]``); entries with equal K are merged.

    The ids must cover ``0 … num_experts-1`` exactly once; TierError lists missing, repeated or
    out-of-range ids otherwise.
    """
    items = partition.items() if isinstance(partition, Mapping) else partition
    groups: dict[Bits, list[int]] = {}
    seen: dict[int, Bits] = {}
    where = _where(layer)
    for raw, ids in items:
        k = _bits(raw, layer, f"tier bitrate {raw!r}")
        for g in ids:
            g = int(g)
            if not 0 <= g < num_experts:
                raise TierError(f"{where}: expert {g} (tier K={k}) is out of range for {num_experts} experts; "
                                f"expert ids are 0..{num_experts - 1}")
            if g in seen:
                raise TierError(f"{where}: expert {g} is listed twice (K={seen[g]} and K={k}); "
                                f"each expert belongs to exactly one tier")
            seen[g] = k
            groups.setdefault(k, []).append(g)
    missing = [g for g in range(num_experts) if g not in seen]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" …" if len(missing) > 8 else "")
        raise TierError(f"{where}: {len(missing)} expert(s) are in no tier ({shown}); the partition must "
                        f"cover all {num_experts} experts exactly once")
    return _layout(groups, num_experts, layer)


def _trellis_of(obj: Any) -> torch.Tensor:
    return obj if isinstance(obj, torch.Tensor) else obj.trellis


def tiers_from_experts(experts: Sequence[Mapping[str, Any]], *, layer: str = "") -> TierLayout:
    """Tiers from the experts' own codes: ``experts[g][proj]`` is an EncodedLinear, Exl3Linear or trellis.

    K follows from each trellis shape; all projections of an expert must share K (and codebook,
    when the objects carry one); geometry is checked with :meth:`TierLayout.check_geometry`.
    """
    bits, books = [], []
    shapes: dict[str, list[tuple[int, ...]]] = {}
    where = _where(layer)
    for g, projs in enumerate(experts):
        ks = {}
        cbs = set()
        for proj, obj in projs.items():
            tr = _trellis_of(obj)
            if tr.dim() != 3:
                raise TierError(f"{where}: expert {g} {proj} trellis has shape {tuple(tr.shape)}; "
                                f"expected [in/16, out/16, 16*K]")
            try:
                ks[proj] = bits_from_width(int(tr.shape[-1]), name=f"{where}: expert {g} {proj} trellis")
            except FormatError as exc:
                raise TierError(str(exc)) from None
            shapes.setdefault(proj, []).append(tuple(tr.shape))
            if getattr(obj, "codebook", None) is not None:
                cbs.add(obj.codebook)
        if len(set(ks.values())) != 1:
            raise TierError(f"{where}: expert {g} mixes bitrates across projections ({ks}); the mixed-bitrate "
                            f"MoE tiers whole experts: encode gate, up and down of one expert at one K")
        if len(cbs) > 1:
            raise TierError(f"{where}: expert {g} mixes codebooks {sorted(cbs)}; use one codebook per expert")
        bits.append(next(iter(ks.values())))
        books.append(next(iter(cbs)) if cbs else None)
    layout = tiers_from_bitrates(bits, layer=layer, codebooks=books)
    layout.check_geometry(shapes)
    return layout


# ---- rotations -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TierRotations:
    """A layer's scale vectors in combined order.

    ``gate_suh`` / ``up_suh`` ``[1|E, H]`` (input side of gate/up; ``gate_suh`` None when ungated),
    ``intermediate`` ``[E, n·I]`` = per expert ``[gate_svh | up_svh | down_suh]`` (``n`` = 3, or 2
    ungated), ``down_svh`` ``[1|E, H]``. ``broadcast_suh`` / ``broadcast_svh``: the H-side tables
    hold one shared row.
    """

    gate_suh: Optional[torch.Tensor]
    up_suh: torch.Tensor
    intermediate: torch.Tensor
    down_svh: torch.Tensor
    broadcast_suh: bool
    broadcast_svh: bool


def tier_rotations(layout: TierLayout, *, up_suh: torch.Tensor, up_svh: torch.Tensor, down_suh: torch.Tensor,
                   down_svh: torch.Tensor, gate_suh: Optional[torch.Tensor] = None,
                   gate_svh: Optional[torch.Tensor] = None) -> TierRotations:
    """Reorder a layer's scale tables (each ``[1|E, n]``, indexed by global expert) into combined order.

    gate and up must be both broadcast or both per expert. The intermediate-side vectors are
    concatenated per expert (a broadcast one is repeated for every expert).
    """
    if (gate_suh is None) != (gate_svh is None):
        raise TierError(f"{_where(layout.layer)}: give both gate_suh and gate_svh, or neither (ungated experts)")
    up_t, b_up = layout.reorder_rows(up_suh, "up_proj.suh")
    gate_t = None
    if gate_suh is not None:
        gate_t, b_gate = layout.reorder_rows(gate_suh, "gate_proj.suh")
        if b_gate != b_up:
            raise TierError(
                f"{_where(layout.layer)}: gate_proj.suh is {'broadcast' if b_gate else 'per expert'} but "
                f"up_proj.suh is {'broadcast' if b_up else 'per expert'}; store both once per layer or both "
                f"once per expert")
    down_t, b_down = layout.reorder_rows(down_svh, "down_proj.svh")
    parts = []
    for name, table in (("gate_proj.svh", gate_svh), ("up_proj.svh", up_svh), ("down_proj.suh", down_suh)):
        if table is None:
            continue
        t, b = layout.reorder_rows(table, name)
        parts.append(t.expand(layout.num_experts, -1) if b else t)
    return TierRotations(gate_suh=gate_t, up_suh=up_t, intermediate=torch.cat(parts, dim=1).contiguous(),
                         down_svh=down_t, broadcast_suh=b_up, broadcast_svh=b_down)


__all__ = ["DESCRIPTOR_NARROW_SHIFT", "DESCRIPTOR_WIDE_SHIFT", "Tier", "TierError", "TierLayout",
           "TierRotations", "tier_rotations", "tiers_from_bitrates", "tiers_from_experts", "tiers_from_partition"]
