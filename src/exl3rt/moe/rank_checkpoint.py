"""Rank-sliced EXL3 MoE checkpoints: each TP rank's expert slices stored under their own names.

Tensor names (``<prefix>`` is the MoE module, e.g. ``model.layers.3.mlp``; ``E`` expert, ``r`` rank)::

    <prefix>.experts.{E}.{proj}.rank{r}.trellis      int16 [in/16, out/16, 16K]   the rank's tile sub-block
    <prefix>.experts.{E}.{proj}.rank{r}.suh|svh      fp16                         scale vectors (see below)
    <prefix>.experts.{E}.{proj}.rank{r}.mcg|mul1     int32 []                     codebook marker (none: 3inst)
    <prefix>.experts.shared_h.{proj}.rank{r}.suh     fp16 [H]   gate_proj / up_proj  (rotation_layout "shared_h")
    <prefix>.experts.shared_h.down_proj.rank{r}.svh  fp16 [H]

``proj`` is ``gate_proj`` (optional), ``up_proj`` or ``down_proj``. The intermediate-side vectors
(gate/up ``svh``, down ``suh``) are per expert and sliced with the rank. The hidden-side vectors
(gate/up ``suh``, down ``svh``) are whole on every rank: with ``"per_expert"`` each expert stores
its own; with ``"shared_h"`` every expert of the layer has the same ones, stored once per layer
and rank under ``experts.shared_h`` (``(E-1)·3·H·2`` bytes saved per layer and rank).

The checkpoint is a directory written by :class:`~exl3rt.format.checkpoint_write.CheckpointWriter`
(safetensors shards, index, ``config.json``; each file published atomically, rank-major order so a
rank's tensors sit together). ``config.json``'s ``quantization_config.moe_tp`` holds the metadata::

    {"format": "exl3rt-moe-tp", "version": 1, "tp_size": 2, "granularity": 128,
     "rotation_layout": "per_expert" | "shared_h", "tensor_schema": ..., "shared_h_tensor_schema": ...,
     "layers": {"<prefix>": {"num_experts": E, "hidden_size": H, "intermediate_size": I, "gated": true,
                             "bits_per_expert": [3, 4, ...], "codebooks": ["mcg", ...]}}}

:func:`load_rank_sliced` checks every expert tensor name and header shape of the whole checkpoint
(headers only) and then reads **only** rank ``r``'s tensors.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from ..format.bits import Bits, normalize_bits, words16_per_tile
from ..format.checkpoint_write import DEFAULT_SHARD_BYTES, CheckpointWriter
from ..format.codebooks import MARKERS, check_codebook
from ..format.encoded import EncodedLinear
from ..format.errors import FormatError
from ..format.hadamard import HAD_BLOCK
from ..util.tensorfiles import CONFIG_NAME, TensorFileError, TensorFiles, natural_key
from .tiers import TierLayout, TierRotations, tier_rotations
from .tp import COLUMN_PROJS, PROJS, EncodedExpert, TPError, expert_shape, rank_bounds, slice_expert

FORMAT = "exl3rt-moe-tp"
VERSION = 1
METADATA_KEY = "moe_tp"
LAYOUTS = ("per_expert", "shared_h")
TENSOR_SCHEMA = "{prefix}.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg|mul1}"
SHARED_H_SCHEMA = "{prefix}.experts.shared_h.{proj}.rank{r}.{suh|svh}"

_NAME = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<expert>\d+|shared_h)\.(?P<proj>[^.]+)\.rank(?P<rank>\d+)"
                   r"\.(?P<field>[^.]+)$")


class RankCheckpointError(ValueError):
    """A rank-sliced checkpoint that is malformed or does not fit the runtime; names the tensor and the fix."""


def hidden_field(proj: str) -> str:
    """The hidden-side vector of ``proj``: ``suh`` for gate/up (input H), ``svh`` for down (output H)."""
    return "suh" if proj in COLUMN_PROJS else "svh"


def inter_field(proj: str) -> str:
    """The intermediate-side vector of ``proj`` (sliced per rank)."""
    return "svh" if proj in COLUMN_PROJS else "suh"


def expert_key(prefix: str, expert: int, proj: str, rank: int) -> str:
    return f"{prefix}.experts.{expert}.{proj}.rank{rank}"


def shared_key(prefix: str, proj: str, rank: int) -> str:
    return f"{prefix}.experts.shared_h.{proj}.rank{rank}.{hidden_field(proj)}"


# ---- metadata --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerMeta:
    """One MoE layer of a rank-sliced checkpoint (``hidden_size``/``intermediate_size`` padded, unsliced)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    gated: bool
    bits_per_expert: tuple[Bits, ...]
    codebooks: tuple[str, ...]

    @property
    def projs(self) -> tuple[str, ...]:
        return PROJS if self.gated else PROJS[1:]

    def to_json(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "gated": self.gated,
                "bits_per_expert": list(self.bits_per_expert), "codebooks": list(self.codebooks)}


@dataclasses.dataclass(frozen=True)
class RankMetadata:
    """The ``quantization_config.moe_tp`` block: TP size, rotation layout and the layers."""

    tp_size: int
    rotation_layout: str
    layers: dict[str, LayerMeta]
    granularity: int = HAD_BLOCK

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION, "tp_size": self.tp_size,
                               "granularity": self.granularity, "rotation_layout": self.rotation_layout,
                               "tensor_schema": TENSOR_SCHEMA}
        if self.rotation_layout == "shared_h":
            out["shared_h_tensor_schema"] = SHARED_H_SCHEMA
        out["layers"] = {p: m.to_json() for p, m in self.layers.items()}
        return out

    @classmethod
    def from_json(cls, block: Any, where: str) -> "RankMetadata":
        def bad(what: str) -> RankCheckpointError:
            return RankCheckpointError(f"{where}: quantization_config.{METADATA_KEY}: {what}; re-write the "
                                       f"checkpoint with exl3rt.moe.rank_checkpoint.save_rank_sliced")
        if not isinstance(block, dict):
            raise bad("missing or not an object (this is not a rank-sliced MoE checkpoint)")
        if block.get("format") != FORMAT or block.get("version") != VERSION:
            raise bad(f"format {block.get('format')!r} version {block.get('version')!r}; expected {FORMAT!r} "
                      f"version {VERSION}")
        layout = block.get("rotation_layout")
        if layout not in LAYOUTS:
            raise bad(f"rotation_layout={layout!r}; expected one of {LAYOUTS}")
        tp, gran = block.get("tp_size"), block.get("granularity", HAD_BLOCK)
        if not isinstance(tp, int) or tp < 1 or not isinstance(gran, int):
            raise bad(f"tp_size={tp!r} / granularity={gran!r} must be integers, tp_size >= 1")
        layers = block.get("layers")
        if not isinstance(layers, dict) or not layers:
            raise bad("'layers' is missing or empty")
        out = {}
        for prefix, m in layers.items():
            try:
                n = int(m["num_experts"])
                bits = tuple(normalize_bits(b, name=f"{prefix} bits_per_expert") for b in m["bits_per_expert"])
                cbs = tuple(check_codebook(c) for c in m["codebooks"])
                meta = LayerMeta(n, int(m["hidden_size"]), int(m["intermediate_size"]), bool(m["gated"]), bits, cbs)
            except (KeyError, TypeError, ValueError) as exc:
                raise bad(f"layer {prefix!r}: {exc}") from None
            if n < 1 or len(bits) != n or len(cbs) != n:
                raise bad(f"layer {prefix!r}: num_experts={n} but {len(bits)} bits and {len(cbs)} codebooks")
            if meta.hidden_size <= 0 or meta.hidden_size % HAD_BLOCK:
                raise bad(f"layer {prefix!r}: hidden_size={meta.hidden_size} is not a positive multiple of {HAD_BLOCK}")
            try:
                rank_bounds(meta.intermediate_size, tp, 0, gran)
            except TPError as exc:
                raise bad(f"layer {prefix!r}: {exc}") from None
            out[prefix] = meta
        return cls(tp, layout, out, gran)


def read_rank_metadata(path: Union[str, os.PathLike[str]]) -> RankMetadata:
    """The metadata of a rank-sliced checkpoint directory (reads ``config.json`` only)."""
    files = _open(path)
    return _metadata(files)


def _open(path: Union[str, os.PathLike[str]]) -> TensorFiles:
    try:
        return TensorFiles(path)
    except TensorFileError as exc:
        raise RankCheckpointError(str(exc)) from None


def _metadata(files: TensorFiles) -> RankMetadata:
    where = str(files.root / CONFIG_NAME)
    qc = (files.config or {}).get("quantization_config")
    return RankMetadata.from_json((qc or {}).get(METADATA_KEY) if isinstance(qc, dict) else None, where)


# ---- expected tensors ------------------------------------------------------------------------------
def expected_tensors(meta: RankMetadata, prefix: str, rank: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor rank ``rank`` of layer ``prefix`` must have: name -> (safetensors dtype, shape)."""
    lm = meta.layers[prefix]
    i0, i1 = rank_bounds(lm.intermediate_size, meta.tp_size, rank, meta.granularity)
    h, w = lm.hidden_size, i1 - i0
    shared = meta.rotation_layout == "shared_h"
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for e in range(lm.num_experts):
        width = words16_per_tile(lm.bits_per_expert[e])
        for p in lm.projs:
            key = expert_key(prefix, e, p, rank)
            col = p in COLUMN_PROJS
            out[f"{key}.trellis"] = ("I16", (h // 16, w // 16, width) if col else (w // 16, h // 16, width))
            out[f"{key}.{inter_field(p)}"] = ("F16", (w,))
            if not shared:
                out[f"{key}.{hidden_field(p)}"] = ("F16", (h,))
            if lm.codebooks[e] in MARKERS:
                out[f"{key}.{lm.codebooks[e]}"] = ("I32", ())
    if shared:
        for p in lm.projs:
            out[shared_key(prefix, p, rank)] = ("F16", (h,))
    return out


def _unexpected(name: str, meta: RankMetadata) -> RankCheckpointError:
    """Why ``name`` (under a declared layer) is not one of the expected tensors."""
    m = _NAME.match(name)
    if m is None:
        return RankCheckpointError(f"{name}: not a rank-sliced expert tensor; names must follow {TENSOR_SCHEMA} "
                                   f"(or {SHARED_H_SCHEMA}); remove or rename it")
    prefix, expert, proj, rank, field = m.group("prefix", "expert", "proj", "rank", "field")
    lm = meta.layers.get(prefix)
    if lm is None:
        return RankCheckpointError(f"{name}: layer {prefix!r} is not declared in the metadata; add it to "
                                   f"quantization_config.{METADATA_KEY}.layers or remove its tensors")
    if proj not in lm.projs:
        return RankCheckpointError(f"{name}: projection {proj!r} is not one of {lm.projs} for this layer "
                                   f"(gated={lm.gated}); rename or remove it")
    if int(rank) >= meta.tp_size:
        return RankCheckpointError(f"{name}: rank {rank} is outside tp_size={meta.tp_size}; the checkpoint holds "
                                   f"tensors of another slicing; re-write it with save_rank_sliced")
    if expert == "shared_h":
        if meta.rotation_layout != "shared_h":
            return RankCheckpointError(
                f"{name}: a shared_h tensor in a checkpoint whose rotation_layout is 'per_expert'; declare "
                f"rotation_layout='shared_h' (save_rank_sliced(..., rotation_layout='shared_h')) or store the "
                f"vector under each expert id")
        return RankCheckpointError(
            f"{name}: {proj} shares its hidden-side {hidden_field(proj)!r} only ({SHARED_H_SCHEMA}: gate/up -> suh, "
            f"down -> svh); {field!r} is per expert and belongs under {prefix}.experts.<E>.{proj}.rank{rank}")
    if int(expert) >= lm.num_experts:
        return RankCheckpointError(f"{name}: expert {expert} is outside num_experts={lm.num_experts}; remove it "
                                   f"or fix the metadata")
    if field == hidden_field(proj) and meta.rotation_layout == "shared_h":
        return RankCheckpointError(
            f"{name}: a hidden-side rotation under an expert id in a shared_h checkpoint; shared_h stores it "
            f"once per layer as {shared_key(prefix, proj, int(rank))} (or declare rotation_layout='per_expert')")
    if field in MARKERS:
        return RankCheckpointError(f"{name}: codebook marker for {field!r}, but the metadata says expert {expert} "
                                   f"uses {lm.codebooks[int(expert)]!r}; fix the metadata or the marker")
    return RankCheckpointError(f"{name}: unknown field {field!r}; expected trellis, suh, svh or a codebook "
                               f"marker ({TENSOR_SCHEMA}); remove it")


def _check_names(files: TensorFiles, meta: RankMetadata) -> None:
    """Every expert tensor of every declared layer and rank is present, expected and has the header it should."""
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for prefix in meta.layers:
        for r in range(meta.tp_size):
            expected.update(expected_tensors(meta, prefix, r))
    roots = tuple(f"{p}.experts." for p in meta.layers)
    for name in files.names():
        if not name.startswith(roots):
            if _NAME.match(name):
                raise _unexpected(name, meta)
            continue  # another module's tensor (attention, norms, router, …)
        if name not in expected:
            raise _unexpected(name, meta)
        info = files.info(name)
        dtype, shape = expected[name]
        if (info.dtype, tuple(info.shape)) != (dtype, shape):
            raise RankCheckpointError(
                f"{name}: stored as {info.dtype} {list(info.shape)}, expected {dtype} {list(shape)} from the "
                f"metadata (tp_size, hidden/intermediate size, bits_per_expert); the metadata and tensors disagree")
    missing = sorted(set(expected) - set(files.names()), key=natural_key)
    if missing:
        raise RankCheckpointError(f"{missing[0]}: missing ({len(missing)} expected tensor(s) missing); the checkpoint "
                                  f"is incomplete: re-write it with save_rank_sliced")


# ---- loading -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class RankLayer:
    """One MoE layer as rank ``rank`` holds it: ``experts[e][proj]`` = the rank's :class:`EncodedLinear` slice.

    With ``"shared_h"`` every expert's hidden-side vector is the same tensor object (loaded once).
    """

    prefix: str
    rank: int
    tp_size: int
    bounds: tuple[int, int]
    meta: LayerMeta
    rotation_layout: str
    experts: list[dict[str, EncodedLinear]]

    def rotation_tables(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of :func:`~exl3rt.moe.tiers.tier_rotations`: ``[1|E, n]`` tables in global order.

        Hidden-side tables have one row with ``"shared_h"`` (broadcast), ``E`` rows otherwise.
        """
        out = {}
        for p in self.meta.projs:
            short = p.split("_")[0]
            for field in ("suh", "svh"):
                rows = [ex[p] for ex in self.experts]
                if field == hidden_field(p) and self.rotation_layout == "shared_h":
                    rows = rows[:1]
                out[f"{short}_{field}"] = torch.stack([getattr(lin, field) for lin in rows])
        return out

    def tier_rotations(self, layout: TierLayout) -> TierRotations:
        """This rank's rotations in the layout's combined (tier) order."""
        return tier_rotations(layout, **self.rotation_tables())


def load_rank_sliced(path: Union[str, os.PathLike[str]], rank: int, tp_size: int, *,
                     device: Union[torch.device, str] = "cpu") -> dict[str, RankLayer]:
    """Rank ``rank``'s expert slices of every layer: ``{prefix: RankLayer}``, tensors on ``device``.

    ``tp_size`` is the runtime's TP size and must equal the checkpoint's. All names and header
    shapes are checked first (no tensor data is read for that); then only rank ``rank``'s tensors
    are read. Raises :class:`RankCheckpointError` naming the offending tensor and the fix.
    """
    files = _open(path)
    meta = _metadata(files)
    if int(tp_size) != meta.tp_size:
        raise RankCheckpointError(
            f"{files.root / CONFIG_NAME}: the checkpoint is sliced for tp_size={meta.tp_size}, the runtime runs "
            f"tp_size={tp_size}; run with tensor_parallel_size={meta.tp_size} or re-slice the full experts with "
            f"save_rank_sliced(..., tp_size={tp_size})")
    if not 0 <= int(rank) < meta.tp_size:
        raise RankCheckpointError(f"rank={rank}: must be in [0, tp_size={meta.tp_size})")
    _check_names(files, meta)
    out = {}
    for prefix, lm in meta.layers.items():
        shared = {}
        if meta.rotation_layout == "shared_h":
            shared = {p: files.tensor(shared_key(prefix, p, rank)).to(device) for p in lm.projs}
        experts = []
        for e in range(lm.num_experts):
            ex = {}
            for p in lm.projs:
                key = expert_key(prefix, e, p, rank)
                fields = ["trellis", inter_field(p)] + ([] if shared else [hidden_field(p)])
                if lm.codebooks[e] in MARKERS:
                    fields.append(lm.codebooks[e])
                tensors = {f: files.tensor(f"{key}.{f}").to(device) for f in fields}
                if shared:
                    tensors[hidden_field(p)] = shared[p]
                try:
                    ex[p] = EncodedLinear.from_state_dict(tensors, key)
                except FormatError as exc:
                    raise RankCheckpointError(str(exc)) from None
            experts.append(ex)
        bounds = rank_bounds(lm.intermediate_size, meta.tp_size, rank, meta.granularity)
        out[prefix] = RankLayer(prefix, int(rank), meta.tp_size, bounds, lm, meta.rotation_layout, experts)
    return out


# ---- writing ------------------------------------------------------------------------------------------
def _layer_meta(prefix: str, experts: Sequence[EncodedExpert], tp_size: int, layout: str,
                granularity: int) -> LayerMeta:
    """Validate one layer's full experts for slicing and ``layout``; nothing is written yet."""
    if not experts:
        raise RankCheckpointError(f"{prefix}: no experts given")
    first = expert_shape(experts[0], where=f"{prefix}.experts.0")
    bits, cbs = [], []
    for e, ex in enumerate(experts):
        where = f"{prefix}.experts.{e}"
        shape = expert_shape(ex, where=where)
        if shape != first:
            raise RankCheckpointError(f"{where}: H={shape.hidden} I={shape.intermediate} gated={shape.gated}, but "
                                      f"expert 0 has H={first.hidden} I={first.intermediate} gated={first.gated}; "
                                      f"all experts of a layer share one geometry")
        ks = {p: lin.bits for p, lin in ex.items()}
        cb = {p: lin.codebook for p, lin in ex.items()}
        if len(set(ks.values())) > 1 or len(set(cb.values())) > 1:
            raise RankCheckpointError(f"{where}: projections differ in bitrate {ks} or codebook {cb}; the mixed "
                                      f"kernel tiers whole experts, so encode all of an expert's projections alike")
        for p, lin in ex.items():
            if lin.bias is not None:
                raise RankCheckpointError(f"{where}.{p}.bias: rank-sliced experts have no bias")
            if p not in COLUMN_PROJS and lin.in_features != lin.in_padded or \
                    p in COLUMN_PROJS and lin.out_features != lin.out_padded:
                raise RankCheckpointError(f"{where}.{p}: the intermediate side is padded; TP needs I a multiple "
                                          f"of {HAD_BLOCK}")
        bits.append(ks["up_proj"])
        cbs.append(cb["up_proj"])
        if layout == "shared_h" and e:
            for p in (q for q in PROJS if q in ex):
                lin = ex[p]
                f = hidden_field(p)
                if not torch.equal(getattr(lin, f), getattr(experts[0][p], f)):
                    raise RankCheckpointError(
                        f"{where}.{p}.{f}: differs from {prefix}.experts.0.{p}.{f}; rotation_layout='shared_h' "
                        f"needs one hidden-side rotation per layer: use rotation_layout='per_expert' or encode "
                        f"the experts with a shared H-side rotation")
    try:
        rank_bounds(first.intermediate, tp_size, 0, granularity)
    except TPError as exc:
        raise RankCheckpointError(f"{prefix}: {exc}") from None
    return LayerMeta(len(experts), first.hidden, first.intermediate, first.gated, tuple(bits), tuple(cbs))


def _own(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy with its own storage (safetensors refuses tensors that share memory, e.g. an unsliced vector)."""
    return t.detach().to("cpu", copy=True).contiguous()


def save_rank_sliced(out_dir: Union[str, os.PathLike[str]], layers: Mapping[str, Sequence[EncodedExpert]],
                     tp_size: int, *, rotation_layout: str = "per_expert", granularity: int = HAD_BLOCK,
                     config: Optional[dict[str, Any]] = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     overwrite: bool = False) -> Path:
    """Slice full encoded experts for ``tp_size`` ranks and write a rank-sliced checkpoint to ``out_dir``.

    ``layers`` maps a MoE module prefix (``model.layers.3.mlp``) to its experts, each
    ``{"gate_proj"?, "up_proj", "down_proj": EncodedLinear}``. Everything is validated before
    anything touches the disk (an error leaves ``out_dir`` as it was); shards are written under
    temporary names and renamed, the index and ``config.json`` last. Returns ``out_dir``.
    """
    if rotation_layout not in LAYOUTS:
        raise RankCheckpointError(f"rotation_layout={rotation_layout!r}: use one of {LAYOUTS}")
    if not layers:
        raise RankCheckpointError("save_rank_sliced: no layers given")
    try:
        metas = {prefix: _layer_meta(prefix, exs, int(tp_size), rotation_layout, granularity)
                 for prefix, exs in layers.items()}
    except TPError as exc:
        raise RankCheckpointError(str(exc)) from None
    meta = RankMetadata(int(tp_size), rotation_layout, metas, int(granularity))
    weights = sum(lm.num_experts * lm.hidden_size * lm.intermediate_size * len(lm.projs) for lm in metas.values())
    tbits = sum(k * lm.hidden_size * lm.intermediate_size * len(lm.projs)
                for lm in metas.values() for k in lm.bits_per_expert)
    codebooks = sorted({c for lm in metas.values() for c in lm.codebooks})
    shared = rotation_layout == "shared_h"
    with CheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as w:
        for r in range(meta.tp_size):  # rank-major: a rank's tensors sit together in the shards
            for prefix, experts in layers.items():
                for e, ex in enumerate(experts):
                    part = slice_expert(ex, meta.tp_size, r, granularity=meta.granularity,
                                        where=f"{prefix}.experts.{e}")
                    for p, lin in part.items():
                        key = expert_key(prefix, e, p, r)
                        for name, t in lin.state_dict(key).items():
                            if not (shared and name == f"{key}.{hidden_field(p)}"):
                                w.add_tensor(name, _own(t))
                if shared:
                    for p in metas[prefix].projs:
                        w.add_tensor(shared_key(prefix, p, r), _own(getattr(experts[0][p], hidden_field(p))))
        qc = {"bits": round(tbits / weights, 2), "codebook": codebooks[0] if len(codebooks) == 1 else "mixed",
              METADATA_KEY: meta.to_json()}
        return w.finish(config, quantization_config=qc)


__all__ = ["FORMAT", "LAYOUTS", "LayerMeta", "METADATA_KEY", "RankCheckpointError", "RankLayer", "RankMetadata",
           "SHARED_H_SCHEMA", "TENSOR_SCHEMA", "VERSION", "expected_tensors", "expert_key", "hidden_field",
           "inter_field", "load_rank_sliced", "read_rank_metadata", "save_rank_sliced", "shared_key"]
