"""EXL3 MoE experts for vLLM's fused-MoE layers (pure: no vLLM import).

vLLM holds a MoE layer's experts as ``RoutedExperts`` with ``w13_weight [E, 2·I_r, H]`` (gate rows,
then up rows) and ``w2_weight [E, H, I_r]``, ``I_r`` = this rank's share of the intermediate size.
exl3rt keeps **one EXL3 matrix per expert projection**, named like a per-expert checkpoint and like
the transformers path (:class:`~exl3rt.runtime.experts.Exl3Experts`)::

    <experts>.{e}.gate_proj  [H -> I_r]    rows [i0, i1) of the HF [I, H] weight
    <experts>.{e}.up_proj    [H -> I_r]
    <experts>.{e}.down_proj  [I_r -> H]    columns [i0, i1) of the HF [H, I] weight

so seeds, ``bits_for``/``expert_bits``/``ignore`` patterns and, at TP=1, cache keys are those of
``quantize_model`` / ``from_pretrained``. With TP the rank's slice is its own cache entry (bounds in
the key, as for dense layers).

Pre-quantized experts (checkpoint mode) arrive as stored codes under the same names
(``<experts>.{e}.{proj}.trellis/suh/svh/mcg|mul1``): :class:`StoredExperts` keeps this rank's piece of
each (:func:`expert_piece`, 128-block cuts only — a split inside a block keeps the covering blocks, down's
scales zeroed outside the rank's columns —, nothing re-encoded) in a dict per expert, so experts
may differ in K; :func:`rank_layer_experts` takes a rank-sliced checkpoint's layer instead.

The layer runs through an :class:`~exl3rt.moe.MoELayerRuntime` (tiers from the codes, decode/prefill
plans with ``max_batched`` = vLLM's ``max_num_batched_tokens``, launches from the config's one
:class:`~exl3rt.moe.MoERuntimeCache`, by default :func:`~exl3rt.moe.auto_launch_factory`): the fused
Triton launch on CUDA where it computes the layer exactly, the torch reference launch otherwise.
Experts that cannot be tiered (an expert mixing K across projections) run the per-expert loop, as in
the transformers path (``Exl3Config.moe_runtime`` decides the same way).

vLLM computes the routing (its router: softmax/sigmoid, grouped top-k, renormalization, scaling) and
hands ``topk_ids``/``topk_weights`` to the method; the method returns this rank's partial sum and
vLLM's MoE runner all-reduces it over the TP group (the method has no modular kernel, so the runner
never assumes the output is reduced).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from ...format.bits import Bits
from ...format.codebooks import MARKERS
from ...format.encoded import EncodedLinear
from ...format.errors import FormatError
from ...format.hadamard import HAD_BLOCK
from ...moe import (MoELayerRuntime, MoERuntimeCache, MoESettings, Owner, attach, is_capturing, rank_bounds,
                    tier_rotations, tiers_from_experts)
from ...moe.prewarm import warm_layer as _warm_layer
from ...moe.tp import moe_partial
from ...runtime.config import Exl3Config
from ...runtime.policy import PolicyError, expert_overrides
from .shards import ShardError, ShardSpec
from .slicing import PARTS, rank_piece

log = logging.getLogger("exl3rt.vllm")

GATED = ("gate_proj", "up_proj", "down_proj")
UNGATED = ("up_proj", "down_proj")


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


#: vLLM MoEActivation value -> (gated, elementwise activation)
ACTIVATIONS: dict[str, tuple[bool, Callable[[torch.Tensor], torch.Tensor]]] = {
    "silu": (True, F.silu),
    "gelu": (True, F.gelu),
    "gelu_tanh": (True, lambda x: F.gelu(x, approximate="tanh")),
    "silu_no_mul": (False, F.silu),
    "gelu_no_mul": (False, F.gelu),
    "gelu_tanh_no_mul": (False, lambda x: F.gelu(x, approximate="tanh")),
    "relu2_no_mul": (False, _relu2),
}


def activation(name: str, layer: str) -> tuple[bool, Callable[[torch.Tensor], torch.Tensor]]:
    """``(gated, act)`` of vLLM activation ``name``; ShardError naming the layer for one exl3rt does not run."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ShardError(f"{layer}: MoE activation {name!r} is not supported by the exl3 plugin (supported: "
                         f"{', '.join(ACTIVATIONS)}); keep these experts unquantized with quantization_config "
                         f"ignore=[{layer!r}]") from None


# ---- this rank's slice of every expert --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExpertSlice:
    """This rank's intermediate columns ``[i0, i1)`` of every expert (vLLM splits I evenly over TP ranks)."""

    hidden: int
    intermediate: int      # I of the whole expert
    i0: int
    i1: int
    tp_size: int = 1
    tp_rank: int = 0
    #: the intermediate columns this rank's stored pieces span (pre-quantized codes are cut on whole 128-blocks:
    #: a split inside a block serves the covering blocks, the columns outside [i0, i1) zeroed in down's suh);
    #: None: [i0, i1) itself
    cover: Optional[tuple[int, int]] = None

    @property
    def local(self) -> int:
        return self.i1 - self.i0

    @property
    def served(self) -> tuple[int, int]:
        """The intermediate columns the rank's expert matrices span: ``cover``, or ``[i0, i1)``."""
        return self.cover if self.cover is not None else (self.i0, self.i1)

    @property
    def width(self) -> int:
        """The intermediate width of the rank's expert matrices (``local`` unless covered)."""
        c0, c1 = self.served
        return c1 - c0

    @property
    def is_whole(self) -> bool:
        return (self.i0, self.i1) == (0, self.intermediate)

    @property
    def block_aligned(self) -> bool:
        return self.is_whole or (self.i0 % HAD_BLOCK == 0 and self.i1 % HAD_BLOCK == 0)

    def tp(self, proj: str) -> Optional[tuple[int, int, tuple[int, int, int, int]]]:
        """``(tp_size, tp_rank, bounds)`` for :meth:`OnlineEncoder.encode` (None: the whole matrix).

        ``bounds = (row0, row1, col0, col1)`` of the HF ``[out, in]`` weight: gate/up hold rows
        ``[i0, i1)``, down holds columns ``[i0, i1)``.
        """
        if self.is_whole:
            return None
        if proj == "down_proj":
            return self.tp_size, self.tp_rank, (0, self.hidden, self.i0, self.i1)
        return self.tp_size, self.tp_rank, (self.i0, self.i1, 0, self.hidden)


def expert_slice(layer: str, hidden: int, intermediate: int, tp_size: int, tp_rank: int, *,
                 require_blocks: bool = False) -> ExpertSlice:
    """The slice vLLM's expert weight loader gives rank ``tp_rank`` (``I/tp`` columns each).

    ``require_blocks`` (pre-quantized experts, whose codes can only be cut on 128-column blocks): a split
    inside a block gets ``cover``, the whole blocks covering ``[i0, i1)`` (:attr:`ExpertSlice.cover`); an
    aligned one equals :func:`exl3rt.moe.rank_bounds`. Online encoding encodes each rank's slice on its
    own and accepts any split.
    """
    hidden, intermediate, tp_size, tp_rank = int(hidden), int(intermediate), int(tp_size), int(tp_rank)
    if tp_size <= 1:
        return ExpertSlice(hidden, intermediate, 0, intermediate)
    if intermediate % tp_size:
        raise ShardError(f"{layer}: expert intermediate size {intermediate} does not split evenly over "
                         f"{tp_size} tensor-parallel ranks; use a tensor-parallel size that divides it")
    per = intermediate // tp_size
    sl = ExpertSlice(hidden, intermediate, per * tp_rank, per * (tp_rank + 1), tp_size, tp_rank)
    if require_blocks:
        if not sl.block_aligned:
            c0 = sl.i0 // HAD_BLOCK * HAD_BLOCK
            c1 = min(-(-sl.i1 // HAD_BLOCK) * HAD_BLOCK, intermediate)
            return dataclasses.replace(sl, cover=(c0, c1))
        assert (sl.i0, sl.i1) == rank_bounds(intermediate, tp_size, tp_rank)
    return sl


# ---- stored (pre-quantized) experts: this rank's codes ------------------------------------------------
#: vLLM's expert shard ids -> exl3rt projection (gated experts: w1 gate, w3 up, w2 down; ungated: w1 is up)
SHARD_PROJS = {True: {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
               False: {"w1": "up_proj", "w2": "down_proj"}}
#: stored tensor fields of one expert matrix the checkpoint loader accepts (trellis/scales + codebook markers)
FIELDS = PARTS + tuple(MARKERS)


def expert_spec(sl: ExpertSlice, name: str, proj: str) -> ShardSpec:
    """The :class:`ShardSpec` of expert matrix ``name`` (projection ``proj``) on ``sl``'s rank.

    gate/up (``H -> I``) keep output rows ``[i0, i1)``; down (``I -> H``) keeps input columns ``[i0, i1)``.
    """
    h, i = sl.hidden, sl.intermediate
    c0, c1 = sl.served
    if proj == "down_proj":
        bounds = (0, 0, 0, 0) if sl.is_whole else (0, h, c0, c1)
        return ShardSpec(name, "w2", 0, h, sl.width, h, i, sl.tp_size, sl.tp_rank, bounds)
    bounds = (0, 0, 0, 0) if sl.is_whole else (c0, c1, 0, h)
    return ShardSpec(name, proj, 0, sl.width, h, i, h, sl.tp_size, sl.tp_rank, bounds)


def expert_piece(field: str, tensor: torch.Tensor, sl: ExpertSlice, name: str, proj: str) -> tuple[str, torch.Tensor]:
    """``(field, this rank's piece)`` of stored tensor ``<name>.<field>`` (legacy ``su``/``sv`` come back as
    ``suh``/``svh``; codebook markers unchanged). The cut is on 128-blocks (``sl`` was made with
    ``require_blocks``), so the piece is the stored codes of the rank's sub-matrix, nothing re-encoded."""
    if field in MARKERS:
        return field, tensor
    if field not in PARTS:
        raise FormatError(f"{name}.{field}: not an EXL3 tensor the exl3 plugin loads for MoE experts (expected "
                          f"{', '.join(FIELDS)}); remove it from the checkpoint")
    out = {"su": "suh", "sv": "svh"}.get(field, field)
    piece = rank_piece(field, tensor, expert_spec(sl, name, proj))
    if sl.cover is not None and proj == "down_proj" and out == "suh":
        # the covering blocks' columns this rank does not own: zero input scales zero those rows of W_down,
        # so they add nothing to the rank's partial sum (vLLM all-reduces the ranks' partial sums)
        lo, n = sl.i0 - sl.cover[0], sl.local
        keep = torch.zeros_like(piece)
        keep[lo: lo + n] = piece[lo: lo + n]
        piece = keep
    return out, piece


class StoredExperts:
    """Collects a MoE layer's stored expert codes as vLLM's loader hands them over, one tensor at a time.

    ``add(expert, proj, field, tensor)`` keeps this rank's piece; :meth:`encoded` builds each expert
    matrix's :class:`EncodedLinear` (K from its own trellis, so every expert may have its own bitrate).
    Experts are a dict per expert, never a stacked tensor: trellis widths differ between K.
    """

    def __init__(self, layer: str, num_experts: int, projs: Sequence[str], sl: ExpertSlice):
        self.layer, self.num_experts, self.projs, self.slice = layer, int(num_experts), tuple(projs), sl
        self.parts: list[dict[str, dict[str, torch.Tensor]]] = [{p: {} for p in self.projs}
                                                                for _ in range(self.num_experts)]

    def name(self, expert: int, proj: str) -> str:
        return f"{self.layer}.{expert}.{proj}"

    def add(self, expert: int, proj: str, field: str, tensor: torch.Tensor,
            device: Optional[torch.device | str] = None) -> None:
        expert = int(expert)
        if not 0 <= expert < self.num_experts or proj not in self.projs:
            raise FormatError(f"{self.layer}.{expert}.{proj}.{field}: expert {expert} / projection {proj!r} is not "
                              f"one of this layer's {self.num_experts} experts x {self.projs}; the checkpoint does "
                              f"not match the model config")
        name = self.name(expert, proj)
        key, piece = expert_piece(field, tensor, self.slice, name, proj)
        self.parts[expert][proj][key] = piece.to(device) if device is not None else piece

    def missing(self) -> list[str]:
        """Names of the expert matrices with no trellis loaded (the checkpoint does not store them as EXL3)."""
        return [self.name(e, p) for e in range(self.num_experts) for p in self.projs
                if "trellis" not in self.parts[e][p]]

    def encoded(self) -> list[dict[str, EncodedLinear]]:
        """``[expert][proj] -> EncodedLinear`` of this rank (logical widths of the rank's slice)."""
        missing = self.missing()
        if missing:
            raise FormatError(f"{missing[0]}.trellis: not in the checkpoint ({len(missing)} expert matrices of "
                              f"{self.layer} missing); store every expert of a MoE layer as EXL3 (or none: vLLM "
                              f"then serves BF16 experts unquantized)")
        out = []
        for e in range(self.num_experts):
            ex = {}
            for p in self.projs:
                spec = expert_spec(self.slice, self.name(e, p), p)
                ex[p] = EncodedLinear.from_state_dict(self.parts[e][p], spec.name, in_features=spec.in_features,
                                                      out_features=spec.out_features)
                if ex[p].in_padded < spec.in_features or ex[p].out_padded < spec.out_features:
                    raise FormatError(f"{spec.name}.trellis: codes a [{ex[p].in_padded}, {ex[p].out_padded}] matrix, "
                                      f"this rank needs [{spec.in_features}, {spec.out_features}] of it; the "
                                      f"checkpoint does not match the model config (hidden / moe intermediate size)")
            out.append(ex)
        return out

    def clear(self) -> None:
        self.parts = []


def rank_layer_experts(rank_layer: Any, sl: ExpertSlice, projs: Sequence[str]) -> list[dict[str, EncodedLinear]]:
    """A rank-sliced checkpoint's layer (:class:`exl3rt.moe.rank_checkpoint.RankLayer`) as ``[expert][proj]``,
    checked against the slice vLLM gives this rank (names are the per-expert names ``<experts>.<e>.<proj>``)."""
    meta = rank_layer.meta
    where = f"{rank_layer.prefix}.experts"
    if (rank_layer.tp_size, rank_layer.rank) != (sl.tp_size, sl.tp_rank) or tuple(rank_layer.bounds) != (sl.i0, sl.i1):
        raise ShardError(f"{where}: the rank-sliced checkpoint gives rank {rank_layer.rank} of {rank_layer.tp_size} "
                         f"intermediate columns {list(rank_layer.bounds)}, vLLM gives rank {sl.tp_rank} of "
                         f"{sl.tp_size} [{sl.i0}, {sl.i1}); serve it with tensor_parallel_size={rank_layer.tp_size}")
    if (meta.hidden_size, meta.intermediate_size) != (sl.hidden, sl.intermediate) or tuple(meta.projs) != tuple(projs):
        raise ShardError(f"{where}: the rank-sliced checkpoint has H={meta.hidden_size} I={meta.intermediate_size} "
                         f"projections {meta.projs}, the model config H={sl.hidden} I={sl.intermediate} "
                         f"{tuple(projs)}; the checkpoint was written for another model")
    return [{p: dataclasses.replace(ex[p], name=f"{where}.{e}.{p}") for p in projs}
            for e, ex in enumerate(rank_layer.experts)]


# ---- bitrates --------------------------------------------------------------------------------------
def expert_bits(config: Exl3Config, name: str, num_experts: int,
                projs: Sequence[str] = GATED) -> Optional[list[dict[str, Bits]]]:
    """K of every expert matrix of experts module ``name`` (the transformers path's rule), or None when
    the whole module stays unquantized.

    Precedence as in :func:`exl3rt.runtime.policy.select_targets`: ``bits`` → ``bits_for`` (per
    matrix) → ``expert_bits`` default → ``expert_bits`` per expert. ``expert_bits_rule`` needs router
    statistics, which a load cannot have (Exl3ConfigError). Ignoring only some matrices is a
    ShardError: vLLM's experts are one fused layer.
    """
    if config.is_ignored(name):
        return None
    ignored = [f"{name}.{e}.{p}" for e in range(num_experts) for p in projs if config.is_ignored(f"{name}.{e}.{p}")]
    if ignored:
        if len(ignored) == num_experts * len(projs):
            return None
        raise ShardError(f"{name}: quantization_config ignore patterns keep {ignored[:3]}"
                         f"{' …' if len(ignored) > 3 else ''} dense but not the other experts; vLLM runs a MoE "
                         f"layer's experts as one fused layer: ignore all of them ({name!r}) or none")
    over = expert_overrides(config, name, num_experts)
    return [{p: over[e] if over[e] is not None else config.bits_for_module(f"{name}.{e}.{p}") for p in projs}
            for e in range(num_experts)]


# ---- one expert ------------------------------------------------------------------------------------
class VllmExpert(dict):
    """Expert ``e``: ``{proj: Exl3Linear}`` that is also callable ``[n, H] -> [n, H]`` (unweighted).

    ``down(act(gate(x)) · up(x))`` (``down(act(up(x)))`` ungated), what the reference launch binds; as
    a dict of EXL3 linears it is what the Triton launch binds (``fused_ok``: it computes exactly this).
    """

    def __init__(self, linears: Mapping[str, Any], act_name: str = "silu", *, layer: str = "", expert: int = 0):
        super().__init__(linears)
        self.gated, self.act = activation(act_name, layer)
        self.act_name = act_name
        self.expert = int(expert)
        self.fused_ok = (act_name == "silu" and set(self) == set(GATED)
                         and all(m.in_features % HAD_BLOCK == 0 and m.out_features % HAD_BLOCK == 0
                                 for m in self.values()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = self.act(self["gate_proj"](x)) * self["up_proj"](x)
        else:
            h = self.act(self["up_proj"](x))
        return self["down_proj"](h)

    def __repr__(self) -> str:
        return f"VllmExpert({self.expert}, {', '.join(f'{p}@K{m.bits}' for p, m in self.items())})"


def tier_reason(experts: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """Why the experts cannot be tiered (None: they can): an expert mixing K across projections."""
    for e, ex in enumerate(experts):
        ks = {p: m.bits for p, m in ex.items()}
        if len(set(ks.values())) > 1:
            return f"expert {e} mixes bitrates across projections ({ks}); the MoE runtime tiers whole experts"
    return None


# ---- the layer -------------------------------------------------------------------------------------
class Exl3VllmMoE:
    """One vLLM MoE layer's EXL3 experts and how they run (layer runtime, or the per-expert loop).

    ``forward(x [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]``: this rank's partial sum
    (vLLM's MoE runner all-reduces it when TP > 1). Route ids are run as int32, so each layer plans
    one runtime; rows above ``settings.max_batched`` run in chunks.

    Planning happens on the first forward (vLLM's eager profile run, before the KV cache is sized);
    right after planning, every specialization of the layer's runtimes that was not warmed yet is
    warmed (:func:`warm_layer`), so nothing compiles or allocates lazily under traffic. Planning or a
    host-syncing path (reference launch, loop) under CUDA graph capture raises with the fix.
    """

    def __init__(self, name: str, experts: Sequence[VllmExpert], *, hidden: int, intermediate: int, top_k: int,
                 settings: MoESettings, cache: MoERuntimeCache, owner: Owner, moe_runtime: Optional[bool] = None,
                 warmed: Optional[set[int]] = None):
        self.name = name
        self.experts = list(experts)
        self.hidden, self.intermediate, self.top_k = int(hidden), int(intermediate), int(top_k)
        self.settings = settings
        self.warmed_runtimes = warmed if warmed is not None else set()
        self.warmed = 0
        reason = tier_reason(self.experts)
        if reason is None and moe_runtime is False:
            reason = "Exl3Config.moe_runtime=False"
        if reason is not None and moe_runtime:
            raise PolicyError(f"{name}: cannot run through the EXL3 MoE runtime: {reason}; encode every matrix of "
                              f"an expert at one K, or set moe_runtime=None to fall back to the per-expert loop")
        self.reason = reason
        self.layer: Optional[MoELayerRuntime] = None
        if reason is None:
            layout = tiers_from_experts(self.experts, layer=name)

            def table(proj: str, side: str) -> torch.Tensor:
                return torch.stack([getattr(ex[proj], side) for ex in self.experts])

            gated = "gate_proj" in self.experts[0]
            rotations = tier_rotations(layout, up_suh=table("up_proj", "suh"), up_svh=table("up_proj", "svh"),
                                       down_suh=table("down_proj", "suh"), down_svh=table("down_proj", "svh"),
                                       gate_suh=table("gate_proj", "suh") if gated else None,
                                       gate_svh=table("gate_proj", "svh") if gated else None)
            self.layer = MoELayerRuntime(name, layout, self.experts, hidden=self.hidden,
                                         intermediate=self.intermediate, top_k=self.top_k, settings=settings,
                                         cache=cache, owner=owner, rotations=rotations)
        else:
            log.info("%s: per-expert loop instead of the MoE runtime: %s", name, reason)

    @property
    def path(self) -> str:
        """``"runtime <tier signature>"`` or ``"loop: <reason>"`` (as ``summary()["moe"]`` of the transformers path)."""
        return f"runtime {self.layer.layout.signature}" if self.layer is not None else f"loop: {self.reason}"

    def launch_kinds(self) -> dict[str, str]:
        """Per plan, the launch this layer is bound to (``"triton"``/``"reference"``; empty before planning)."""
        out: dict[str, str] = {}
        if self.layer is None:
            return out
        for rt in self.layer.runtimes():
            for kind, launch in rt.launches.items():
                k = getattr(launch, "kinds", {}).get(self.name)
                out[kind] = k if k is not None else type(launch).__name__
        return out

    def attach_to(self, module: torch.nn.Module) -> None:
        """Mark ``module`` for :func:`exl3rt.moe.prewarm` (no-op for the loop)."""
        if self.layer is not None:
            attach(module, self.layer)

    def plan(self, device: torch.device | str, x_dtype: torch.dtype) -> int:
        """Plan this layer (int32 route ids) and warm what is new; returns the specializations warmed."""
        if self.layer is None or self.layer.planned:
            return 0
        self.layer.plan(device, x_dtype, torch.int32)
        n = warm_layer(self.layer, self.warmed_runtimes)
        self.warmed += n
        return n

    def _check_capture(self) -> None:
        if not is_capturing():
            return
        kinds = self.launch_kinds()
        if self.layer is None or any(k != "triton" for k in kinds.values()):
            why = self.path if self.layer is None else f"launches {kinds}"
            raise RuntimeError(
                f"{self.name}: this EXL3 MoE layer cannot be captured in a CUDA graph ({why}: the torch reference "
                f"launch and the per-expert loop read route counts back to the host); serve with "
                f"enforce_eager=True, or use experts the fused Triton launch runs (silu, widths multiples of "
                f"{HAD_BLOCK}, one K per expert)")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        if self.layer is not None and not self.layer.planned:
            self.plan(x.device, x.dtype)
        self._check_capture()
        if self.layer is None:
            return moe_partial(x, topk_ids, topk_weights, self.experts).to(x.dtype)
        step = self.settings.max_batched
        if x.shape[0] <= step:
            return self.layer(x, topk_ids, topk_weights)
        return torch.cat([self.layer(x[s:s + step], topk_ids[s:s + step], topk_weights[s:s + step])
                          for s in range(0, x.shape[0], step)])

    __call__ = forward


def warm_layer(layer: MoELayerRuntime, done: set[int]) -> int:
    """:func:`exl3rt.moe.prewarm.warm_layer` for one layer, logged."""
    n = _warm_layer(layer, done)
    if n:
        log.info("%s: EXL3 MoE runtime warmed (%d specializations)", layer.name, n)
    return n


__all__ = ["ACTIVATIONS", "FIELDS", "GATED", "SHARD_PROJS", "UNGATED", "ExpertSlice", "Exl3VllmMoE", "StoredExperts",
           "VllmExpert", "activation", "expert_bits", "expert_piece", "expert_slice", "expert_spec",
           "rank_layer_experts", "tier_reason", "warm_layer"]
