"""The Triton MoE launch: :class:`~exl3rt.moe.launches.Launch` hooks around :func:`exl3rt.kernels.moe.exl3_moe`.

``bind(layer)`` turns the layer's experts into :class:`~exl3rt.kernels.moe.MoEWeights` once (tier
stacks of the trellis, rotation tables in combined order, descriptors): ``layer.weights`` is either a
``MoEWeights`` or one ``{"gate_proj", "up_proj", "down_proj"} -> EXL3 linear`` dict per global expert.
``run`` packs the routes with the plan's ``block_m`` and runs :func:`~exl3rt.kernels.moe.exl3_moe` (fused
passes: pack, pre, gate+up, mid, down, post) into the runtime's output rows, through its launch plan
(:func:`~exl3rt.kernels.moe.planned_moe`: recorded once per call shape, then replayed).
``warmup(rows, ids_dtype)`` compiles the launch's kernel specializations on a dummy layer of the same
geometry (K per tier, H, I, expert count, descriptor width, block_m; every expert of a tier shares one
stack entry) — no specialization depends on the row count within a bucket or on the weights — and returns
how many kernel launches it made (``tests/test_moe_kernel.py`` records every launch's specialization key
and checks that real calls at every row count meet only warmed ones).
"""

from __future__ import annotations

from typing import Any

import torch

from ..format.bits import words16_per_tile
from .plan import Plan
from .launches import MoELayerRuntime, RuntimeKey, ScratchArena
from .tiers import DESCRIPTOR_NARROW_SHIFT, DESCRIPTOR_WIDE_SHIFT


class TritonMoELaunch:
    """See the module docstring."""

    def __init__(self, key: RuntimeKey, plan: Plan, arena: ScratchArena):
        self.key = key
        self.plan = plan
        self.arena = arena
        self.warmed: set[tuple[int, torch.dtype]] = set()

    def compile(self) -> None:
        """Nothing to build ahead: Triton compiles on the first launch; :meth:`warmup` forces that."""

    def bind(self, layer: MoELayerRuntime) -> Any:
        from ..kernels.moe import MoEWeights
        if isinstance(layer.weights, MoEWeights):
            return layer.weights
        experts = list(layer.weights)
        if len(experts) != layer.layout.num_experts or not all(isinstance(e, dict) for e in experts):
            raise ValueError(f"{layer.name}: the Triton MoE launch needs MoEWeights or one dict of "
                             f"gate_proj/up_proj/down_proj EXL3 linears per expert ({layer.layout.num_experts})")
        w = MoEWeights.from_experts(layer.layout, experts)
        got = (int(w.up[0].shape[1]) * 16, int(w.up[0].shape[2]) * 16)
        if got != (self.key.hidden, self.key.intermediate):
            raise ValueError(f"{layer.name}: the experts are {got[0]} -> {got[1]} (padded) but the layer was planned "
                             f"for hidden {self.key.hidden}, intermediate {self.key.intermediate}")
        return w

    def _dummy(self) -> Any:
        """A layer of this key's geometry and expert count in which every expert of a tier shares the tier's
        one stack entry (random codes, unit broadcast scales): the kernels see the real E (the packer
        specializes on it), tiers, widths and descriptor shift, at the memory of one expert per tier."""
        from ..kernels.moe import MoEWeights
        k, dev = self.key, torch.device(self.key.device)
        tiers = [bits for bits, _ in k.tier_signature]
        shift = DESCRIPTOR_NARROW_SHIFT if max(n for _, n in k.tier_signature) <= (1 << DESCRIPTOR_NARROW_SHIFT) \
            else DESCRIPTOR_WIDE_SHIFT
        desc = [t << shift for t, (_, n) in enumerate(k.tier_signature) for _ in range(n)]   # local 0 of each tier

        def stack(i: int, o: int) -> list[torch.Tensor]:
            return [torch.randint(-32768, 32768, (1, i // 16, o // 16, words16_per_tile(b)), dtype=torch.int16,
                                  device=dev) for b in tiers]
        ones = lambda n: torch.ones(1, n, device=dev)  # noqa: E731
        return MoEWeights(up=stack(k.hidden, k.intermediate), down=stack(k.intermediate, k.hidden),
                          gate=stack(k.hidden, k.intermediate),
                          up_suh=ones(k.hidden), up_svh=ones(k.intermediate), down_suh=ones(k.intermediate),
                          down_svh=ones(k.hidden), gate_suh=ones(k.hidden), gate_svh=ones(k.intermediate),
                          descriptors=torch.tensor(desc, dtype=torch.int32, device=dev),
                          shift=shift, expert_map=torch.arange(len(desc), dtype=torch.int32, device=dev),
                          codebook=next((c for c in k.codebooks if c), "mcg"))

    def warmup(self, rows: int, ids_dtype: torch.dtype) -> int:
        from ..kernels.moe import exl3_moe, fused_glue_supported, pack_max_routes
        w = self._dummy()
        n = w.num_experts
        dev = torch.device(self.key.device)
        ids = (torch.arange(rows * self.plan.top_k, device=dev) % n).reshape(rows, self.plan.top_k).to(ids_dtype)
        x = torch.zeros(rows, self.key.hidden, dtype=self.key.x_dtype, device=dev)
        exl3_moe(x, ids, torch.ones(rows, self.plan.top_k, device=dev), w, block_m=self.plan.block_for(rows))
        self.warmed.add((rows, ids_dtype))
        # fused: [pack,] pre, gate+up, mid, down, post (one pre-pass kernel serves shared and separate
        # gate/up input rotations; nothing specializes on T but the packer's sort widths) | torch glue:
        # gate, up, down
        if not fused_glue_supported(w):
            return 3
        return 6 if rows * self.plan.top_k <= pack_max_routes(dev) else 5

    def run(self, binding: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            out: torch.Tensor) -> None:
        from ..kernels.moe import planned_moe
        planned_moe(x, topk_ids, topk_weights, binding, block_m=self.plan.block_for(x.shape[0]), out=out)


def triton_launch_factory(key: RuntimeKey, plan: Plan, arena: ScratchArena) -> TritonMoELaunch:
    """The :data:`~exl3rt.moe.launches.LaunchFactory` of the Triton launch."""
    return TritonMoELaunch(key, plan, arena)


def fused_supported(layer: MoELayerRuntime) -> bool:
    """The Triton launch computes ``layer`` exactly: one ``{gate_proj, up_proj, down_proj}`` dict of
    EXL3 linears per expert, no expert object saying otherwise (``fused_ok = False``), H and I
    multiples of 128, one codebook."""
    from ..kernels.moe import MoEWeights
    if isinstance(layer.weights, MoEWeights):
        return True
    g = layer.geometry
    if g.hidden % 128 or g.intermediate % 128 or len({c for c in g.codebooks if c}) > 1:
        return False
    experts = list(layer.weights)
    return all(isinstance(e, dict) and getattr(e, "fused_ok", True) and set(e) == {"gate_proj", "up_proj", "down_proj"}
               and all(hasattr(p, "trellis") for p in e.values()) for e in experts)


class AutoLaunch:
    """Per layer, the Triton launch where it applies (:func:`fused_supported`, CUDA with Triton, or
    ``prefer_triton=True``), else the torch reference launch; :meth:`bind` records the choice in
    :attr:`kinds` (layer name -> ``"triton"`` | ``"reference"``)."""

    def __init__(self, key: RuntimeKey, plan: Plan, arena: ScratchArena, *, prefer_triton: bool | None = None):
        from ..kernels._triton import HAVE_TRITON
        from .reference import ReferenceLaunch
        self.key = key
        self.plan = plan
        if prefer_triton is None:
            prefer_triton = HAVE_TRITON and torch.device(key.device).type == "cuda"
        self.prefer_triton = bool(prefer_triton)
        self.triton = TritonMoELaunch(key, plan, arena)
        self.reference = ReferenceLaunch(key, plan, arena)
        self.kinds: dict[str, str] = {}

    def compile(self) -> None:
        self.triton.compile()
        self.reference.compile()

    def bind(self, layer: MoELayerRuntime) -> Any:
        kind = "triton" if self.prefer_triton and fused_supported(layer) else "reference"
        self.kinds[layer.name] = kind
        return kind, (self.triton if kind == "triton" else self.reference).bind(layer)

    def warmup(self, rows: int, ids_dtype: torch.dtype) -> int:
        n = self.reference.warmup(rows, ids_dtype)
        if self.prefer_triton and "triton" in self.kinds.values():
            n += self.triton.warmup(rows, ids_dtype)
        return n

    def run(self, binding: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            out: torch.Tensor) -> None:
        kind, inner = binding
        (self.triton if kind == "triton" else self.reference).run(inner, x, topk_ids, topk_weights, out)


def auto_launch_factory(key: RuntimeKey, plan: Plan, arena: ScratchArena, *,
                        prefer_triton: bool | None = None) -> AutoLaunch:
    """The default :data:`~exl3rt.moe.launches.LaunchFactory`: :class:`AutoLaunch`."""
    return AutoLaunch(key, plan, arena, prefer_triton=prefer_triton)


__all__ = ["AutoLaunch", "TritonMoELaunch", "auto_launch_factory", "fused_supported", "triton_launch_factory"]
