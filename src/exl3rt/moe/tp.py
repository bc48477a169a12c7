"""Tensor parallelism for EXL3 MoE experts: slice along the intermediate dimension, sum the partials.

An expert is ``y = down(act(x·gate) * (x·up))`` with ``gate, up: [H, I]`` and ``down: [I, H]``
(EXL3 orientation ``[in, out]``). Rank ``r`` of ``tp_size`` owns the intermediate columns
``[i0, i1)`` (:func:`rank_bounds`), so it computes ``down[i0:i1] · (act(x·gate[:, i0:i1]) *
x·up[:, i0:i1])``; the activation is elementwise on I, so the sum over ranks is the whole expert.

**Why slicing an encoded expert is exact.** ``W = diag(suh)·Hk·Q·Hn·diag(svh)`` with ``Hk``/``Hn``
block-diagonal in 128-blocks aligned at multiples of 128, and ``Q`` stored as 16×16 tiles,
``trellis[a, b]`` = ``Q[16a:16a+16, 16b:16b+16]``. For ``i0, i1`` multiples of 128:

    gate/up (I = out side):  W[:, i0:i1] = diag(suh)·Hk·Q[:, i0:i1]·Hn'·diag(svh[i0:i1])
                             -> trellis[:, i0/16:i1/16, :], suh unchanged, svh[i0:i1]
    down    (I = in side):   W[i0:i1, :] = diag(suh[i0:i1])·Hk'·Q[i0:i1, :]·Hn·diag(svh)
                             -> trellis[i0/16:i1/16], suh[i0:i1], svh unchanged

(``Hk'``/``Hn'`` are the same 128-blocks, fewer of them). No weight is re-encoded: the slice's
trellis bytes are a sub-block of the original's. A granularity below 128 would cut a Hadamard block
and is refused.

The hidden-side vectors (gate/up ``suh``, down ``svh``, length H) are not sliced, so every rank
holds them whole; the intermediate-side vectors are sliced with their rank's columns.

:func:`tp_moe_forward` is the reference MoE forward of one rank followed by an all-reduce (sum).
It uses the tensors' device and the caller's process group, so the same code runs on gloo (CPU)
and NCCL (GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..format.encoded import EncodedLinear
from ..format.hadamard import HAD_BLOCK
from .reference import DenseExpert, Expert

#: projections of an expert; gate is optional (ungated experts: ``down(act(x·up))``)
PROJS = ("gate_proj", "up_proj", "down_proj")
#: projections whose output side is the intermediate dimension (sliced by columns)
COLUMN_PROJS = ("gate_proj", "up_proj")

EncodedExpert = Mapping[str, EncodedLinear]


class TPError(ValueError):
    """Experts or sizes that cannot be rank-sliced as asked; the message names the tensor and the fix."""


# ---- rank bounds -------------------------------------------------------------------------------------
def rank_bounds(intermediate: int, tp_size: int, rank: int, granularity: int = HAD_BLOCK) -> tuple[int, int]:
    """``(i0, i1)``: the intermediate columns of ``rank`` when ``intermediate`` is split over ``tp_size`` ranks.

    The ``intermediate / granularity`` blocks are dealt out as evenly as possible, the first
    ``blocks % tp_size`` ranks taking one more (I = 640, TP 2: ``(0, 384)``, ``(384, 640)``).
    ``granularity`` must be a positive multiple of 128 so that no Hadamard block is cut.
    """
    granularity, intermediate, tp_size, rank = int(granularity), int(intermediate), int(tp_size), int(rank)
    if granularity <= 0 or granularity % HAD_BLOCK:
        raise TPError(f"granularity={granularity}: must be a positive multiple of {HAD_BLOCK} "
                      f"(a smaller slice would cut a Hadamard block and change the weights)")
    if intermediate <= 0 or intermediate % granularity:
        raise TPError(f"intermediate size {intermediate} is not a positive multiple of {granularity}; "
                      f"EXL3 experts can only be rank-sliced at {granularity}-column boundaries "
                      f"(use tensor parallelism on another dimension, or expert parallelism)")
    if tp_size < 1:
        raise TPError(f"tp_size={tp_size}: must be at least 1")
    blocks = intermediate // granularity
    if tp_size > blocks:
        raise TPError(f"tp_size={tp_size} exceeds the {blocks} blocks of {granularity} columns in intermediate "
                      f"size {intermediate}: some rank would get no columns; use tp_size <= {blocks}")
    if not 0 <= rank < tp_size:
        raise TPError(f"rank={rank}: must be in [0, tp_size={tp_size})")
    base, extra = divmod(blocks, tp_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start * granularity, stop * granularity


# ---- slicing -----------------------------------------------------------------------------------------
def _label(lin: EncodedLinear, tensor: str) -> str:
    return f"{lin.name}.{tensor}" if lin.name else tensor


def slice_encoded(lin: EncodedLinear, dim: int, start: int, stop: int, *, keep_bias: bool = True,
                  name: Optional[str] = None) -> EncodedLinear:
    """The rows (``dim=0``, input side) or columns (``dim=1``, output side) ``[start, stop)`` of ``lin``.

    Bit-exact: the trellis is the tile sub-block ``[start/16:stop/16]`` along ``dim``, the scale
    vector of that side is cut to ``[start:stop]``, the other side's vector is kept whole.
    ``start``/``stop`` must be multiples of 128 inside the (unpadded) width of that side.
    A column slice cuts the bias too. A row slice's bias would be added once per rank after the
    reduction: pass ``keep_bias=(rank == 0)``.
    """
    if dim not in (0, 1):
        raise TPError(f"{_label(lin, 'trellis')}: dim={dim}; use 0 (input rows) or 1 (output columns)")
    side, vec = ("in", "suh") if dim == 0 else ("out", "svh")
    padded = lin.in_padded if dim == 0 else lin.out_padded
    logical = lin.in_features if dim == 0 else lin.out_features
    start, stop = int(start), int(stop)
    if logical != padded:
        raise TPError(f"{_label(lin, 'trellis')}: {side}_features={logical} is padded to {padded}; a padded side "
                      f"cannot be rank-sliced (the slice of the padding has no logical width)")
    if start % HAD_BLOCK or stop % HAD_BLOCK or not 0 <= start < stop <= padded:
        raise TPError(f"{_label(lin, 'trellis')}: slice [{start}, {stop}) of the {side} side (width {padded}) must "
                      f"be non-empty, inside the width and aligned to {HAD_BLOCK} (whole Hadamard blocks)")
    # clones, not views: a rank must not keep the whole expert's storage alive
    t0, t1 = start // 16, stop // 16
    trellis = (lin.trellis[t0:t1] if dim == 0 else lin.trellis[:, t0:t1]).clone(memory_format=torch.contiguous_format)
    suh = lin.suh[start:stop].clone() if dim == 0 else lin.suh
    svh = lin.svh[start:stop].clone() if dim == 1 else lin.svh
    bias = lin.bias
    if bias is not None:
        bias = bias[start:stop].clone() if dim == 1 else (bias if keep_bias else None)
    width = stop - start
    return EncodedLinear(trellis=trellis, suh=suh, svh=svh, codebook=lin.codebook, bias=bias,
                         in_features=width if dim == 0 else lin.in_features,
                         out_features=width if dim == 1 else lin.out_features,
                         name=lin.name if name is None else name)


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    """Hidden size ``H`` (padded), intermediate size ``I`` and whether the expert has a gate."""

    hidden: int
    intermediate: int
    gated: bool


def expert_shape(expert: EncodedExpert, *, where: str = "expert") -> ExpertShape:
    """Check that ``expert``'s projections fit together (gate/up ``[H, I]``, down ``[I, H]``); return H, I."""
    unknown = sorted(set(expert) - set(PROJS))
    if unknown:
        raise TPError(f"{where}.{unknown[0]}: not an expert projection; expected {', '.join(PROJS)} (gate optional)")
    for p in ("up_proj", "down_proj"):
        if p not in expert:
            raise TPError(f"{where}.{p}: missing; an expert needs up_proj and down_proj (and optionally gate_proj)")
    hidden, inter = expert["up_proj"].in_padded, expert["up_proj"].out_padded
    want = {"up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    if "gate_proj" in expert:
        want["gate_proj"] = (hidden, inter)
    for p, (i, o) in want.items():
        lin = expert[p]
        if (lin.in_padded, lin.out_padded) != (i, o):
            raise TPError(f"{where}.{p}.trellis: codes a [{lin.in_padded}, {lin.out_padded}] weight, expected "
                          f"[{i}, {o}] from up_proj (gate/up [H, I], down [I, H])")
    return ExpertShape(hidden, inter, "gate_proj" in expert)


def slice_expert(expert: EncodedExpert, tp_size: int, rank: int, *, granularity: int = HAD_BLOCK,
                 where: str = "expert") -> dict[str, EncodedLinear]:
    """Rank ``rank``'s part of one encoded expert: gate/up columns and down rows ``rank_bounds(I, …)``.

    Biases are not supported (MoE experts have none; a down bias would need adding once after the
    reduction) and raise.
    """
    shape = expert_shape(expert, where=where)
    for p, lin in expert.items():
        if lin.bias is not None:
            raise TPError(f"{where}.{p}.bias: rank-sliced experts have no bias; fold it elsewhere or run without TP")
    i0, i1 = rank_bounds(shape.intermediate, tp_size, rank, granularity)
    return {p: slice_encoded(lin, 1 if p in COLUMN_PROJS else 0, i0, i1) for p, lin in expert.items()}


# ---- reference forward -------------------------------------------------------------------------------
def dense_experts(experts: Sequence[EncodedExpert], *, dtype: torch.dtype = torch.float32,
                  act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> list[DenseExpert]:
    """Reconstruct each (rank-local) expert's weights with :func:`exl3rt.format.reconstruct` in ``dtype``.

    Weights land on the trellis' device. Do this once per rank; :func:`tp_moe_forward` takes the result.
    """
    out = []
    for e, ex in enumerate(experts):
        expert_shape(ex, where=f"experts.{e}")
        w = {p: lin.reconstruct(dtype=dtype) for p, lin in ex.items()}
        out.append(DenseExpert(up=w["up_proj"], down=w["down_proj"], gate=w.get("gate_proj"), act=act))
    return out


def moe_partial(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: Sequence[Expert]) -> torch.Tensor:
    """``out[t] = Σ_s topk_weights[t, s] · experts[topk_ids[t, s]](x[t])`` in fp32 (fp64 if ``x`` is fp64).

    Ids outside ``[0, E)`` contribute nothing (the expert-parallel sentinel, as in
    :func:`~exl3rt.kernels.routing.pack_routes`). Returns the accumulator (not cast back to ``x``'s dtype).
    """
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise TPError(f"tp_moe_forward: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)} and topk_weights "
                      f"{tuple(topk_weights.shape)} must be [T, H], [T, k], [T, k]")
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc = torch.zeros(x.shape, dtype=acc_dtype, device=x.device)
    for e in torch.unique(topk_ids).tolist():  # one host sync: this is the reference, not the fast path
        if not 0 <= e < len(experts):
            continue
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        y = experts[e](x[tok]).to(acc_dtype) * topk_weights[tok, slot].to(acc_dtype)[:, None]
        acc.index_add_(0, tok, y)
    return acc


def tp_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   experts: Sequence[Union[Expert, EncodedExpert]], *, group: Optional[object] = None,
                   reduce: bool = True) -> torch.Tensor:
    """This rank's MoE output ``Σ_routes w · expert_r(x)``, all-reduced (sum) over ``group``; ``[T, H]`` in x's dtype.

    ``experts`` are this rank's slices, all ``E`` of them (TP slices every expert), either as
    callables (:func:`dense_experts`) or as ``{proj: EncodedLinear}`` (reconstructed here on each
    call: convenient, slow). The partial sum is reduced in fp32 (fp64 for fp64 ``x``) on ``x``'s
    device, so the backend (gloo, NCCL) is the caller's choice via ``torch.distributed``.
    ``reduce=False`` returns the un-reduced partial (also the TP=1 result on full experts).
    """
    if experts and isinstance(experts[0], Mapping):
        experts = dense_experts(experts, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    acc = moe_partial(x, topk_ids, topk_weights, experts)
    if reduce:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("tp_moe_forward: torch.distributed is not initialized; call "
                               "dist.init_process_group(backend, ...) first, or pass reduce=False for TP=1")
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)
    return acc.to(x.dtype)


__all__ = ["COLUMN_PROJS", "EncodedExpert", "ExpertShape", "PROJS", "TPError", "dense_experts", "expert_shape",
           "moe_partial", "rank_bounds", "slice_encoded", "slice_expert", "tp_moe_forward"]
