"""Which EXL3 matrices one vLLM linear layer holds on one rank (pure: no vLLM import).

vLLM fuses checkpoint linears (``q_proj, k_proj, v_proj -> qkv_proj``, ``gate_proj, up_proj ->
gate_up_proj``) and splits every linear over tensor-parallel ranks. EXL3 codes a 2-D matrix with
128-block Hadamard rotations on both sides, so exl3rt keeps **one EXL3 matrix per logical shard**
(the checkpoint linear) and per rank:

- the shard's Hugging Face name is kept (``model.layers.0.self_attn.q_proj``): the seed
  (``module_seed(name, seed)``), the bitrate (``bits_for`` patterns) and, at TP=1, the cache key are
  exactly those of ``exl3rt quantize`` / ``quantize_model`` / ``from_pretrained``;
- the rank's part of the source is described by ``bounds = (row0, row1, col0, col1)`` of the HF
  ``[out, in]`` source weight; ``(0, 0, 0, 0)`` when the rank holds the whole shard (TP=1, replicated
  layers), which keeps those keys independent of the TP degree.

Layouts (``rank`` = the layer's tp rank, ``w`` = rank-local width):

- column-parallel (ColumnParallel, MergedColumn, QKV): output rows ``[r·w, (r+1)·w)`` of each shard,
  ``r = rank`` (``rank // kv_head_replicas`` for k/v when kv heads are replicated), all input columns;
- row-parallel: all output rows, input columns ``[rank·w_in, (rank+1)·w_in)``;
- replicated: the whole matrix.

Pre-quantized codes can only be cut on 128-blocks; :func:`block_cover` widens a rank's share to the
blocks covering it and gives the windows of its own rows/columns inside them (the forward zero-pads the
input into the column window and keeps the row window).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ...format.encoded import PAD

WHOLE = (0, 0, 0, 0)


class ShardError(ValueError):
    """A layer cannot be split into EXL3 matrices the way vLLM splits it (message names the layer and fix)."""


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """One EXL3 matrix of a vLLM layer on this rank (widths are logical, rank-local)."""

    name: str                 # Hugging Face module name of the logical shard
    shard_id: object          # vLLM's shard id ("q"/"k"/"v", 0/1, or None for an unfused layer)
    out_offset: int           # first output column of this shard in the layer's rank-local output
    out_features: int         # rank-local output width
    in_features: int          # rank-local input width
    full_out: int             # output width of the whole (unsplit) shard
    full_in: int              # input width of the whole (unsplit) shard
    tp_size: int = 1
    tp_rank: int = 0
    bounds: tuple[int, int, int, int] = WHOLE

    @property
    def is_whole(self) -> bool:
        return self.bounds == WHOLE

    @property
    def key_tp(self) -> tuple[int, int, Optional[tuple[int, int, int, int]]]:
        """``(tp_size, tp_rank, tp_bounds)`` for the cache key: ``(1, 0, None)`` for a whole shard."""
        return (1, 0, None) if self.is_whole else (self.tp_size, self.tp_rank, self.bounds)


def shard_names(prefix: str, packed: dict[str, list[str]]) -> Optional[list[str]]:
    """HF names of the logical shards of vLLM layer ``prefix`` (None if the layer is not fused)."""
    parent, _, last = prefix.rpartition(".")
    parts = packed.get(last)
    if not parts:
        return None
    return [f"{parent}.{p}" if parent else p for p in parts]


def _bounds(rows: tuple[int, int], cols: tuple[int, int], full_out: int, full_in: int) -> tuple[int, int, int, int]:
    if rows == (0, full_out) and cols == (0, full_in):
        return WHOLE
    return (rows[0], rows[1], cols[0], cols[1])


def column_shards(names: Sequence[str], shard_ids: Sequence[object], full_out: Sequence[int],
                  local_out: Sequence[int], shard_ranks: Sequence[int], in_features: int,
                  tp_size: int, tp_rank: int) -> list[ShardSpec]:
    """Shards of a column-parallel layer: shard j holds rows ``[r_j·w_j, (r_j+1)·w_j)`` of its source."""
    out, offset = [], 0
    for name, sid, full, w, r in zip(names, shard_ids, full_out, local_out, shard_ranks):
        if (r + 1) * w > full:
            raise ShardError(f"{name}: rank {tp_rank} of {tp_size} would hold rows [{r * w}, {(r + 1) * w}) "
                             f"of a {full}-row weight")
        b = _bounds((r * w, (r + 1) * w), (0, in_features), full, in_features)
        out.append(ShardSpec(name, sid, offset, w, in_features, full, in_features, tp_size, tp_rank, b))
        offset += w
    return out


def row_shard(name: str, out_features: int, full_in: int, local_in: int, tp_size: int, tp_rank: int) -> ShardSpec:
    """The one shard of a row-parallel layer: input columns ``[rank·w, (rank+1)·w)``."""
    b = _bounds((0, out_features), (tp_rank * local_in, (tp_rank + 1) * local_in), out_features, full_in)
    return ShardSpec(name, None, 0, out_features, local_in, out_features, full_in, tp_size, tp_rank, b)


def check_block_aligned(spec: ShardSpec, layer: str) -> None:
    """A split EXL3 matrix must be cut on 128-blocks (the Hadamard block), else it is not a valid EXL3 matrix.

    A piece may end at the matrix's logical end (``hi == full``, e.g. the last rank's vocab rows of a head
    whose vocab is not a multiple of 128): it then runs to the padded end of the stored codes. Checked for
    pre-quantized checkpoints (slicing stored codes): :func:`block_cover` pieces always are. Online encoding
    encodes each rank's slice on its own, so it does not need this.
    """
    if spec.is_whole:
        return
    r0, r1, c0, c1 = spec.bounds
    for what, lo, hi, full in (("output rows", r0, r1, spec.full_out), ("input columns", c0, c1, spec.full_in)):
        if (lo, hi) == (0, full):
            continue
        if lo % PAD or (hi % PAD and hi != full):
            raise ShardError(
                f"{layer} ({spec.name}): tensor parallelism {spec.tp_size} gives rank {spec.tp_rank} {what} "
                f"[{lo}, {hi}) of {full}; a pre-quantized EXL3 matrix can only be cut on multiples of {PAD} "
                f"(its Hadamard block): take block_cover(spec) of it")


def block_cover(spec: ShardSpec) -> tuple[ShardSpec, tuple[int, int], tuple[int, int]]:
    """The piece of a stored EXL3 matrix that serves ``spec`` on any split: its bounds widened to whole
    128-blocks (the Hadamard block: an EXL3 matrix can only be cut there; a piece may end at the matrix's
    logical end), and the windows ``(lead, width)`` of the rank's own output rows and input columns inside
    that piece. The rank zero-pads its input to the piece's columns (the rows of W it does not own then add
    nothing to its partial sum) and keeps its window of the output — at most two blocks of extra rows or
    columns per split dimension, shared with the neighbouring ranks."""
    if spec.is_whole:
        return spec, (0, spec.out_features), (0, spec.in_features)
    r0, r1, c0, c1 = spec.bounds

    def widen(lo: int, hi: int, full: int) -> tuple[int, int]:
        return lo // PAD * PAD, (hi if hi == full else min(-(-hi // PAD) * PAD, full))

    w0, w1 = widen(r0, r1, spec.full_out)
    v0, v1 = widen(c0, c1, spec.full_in)
    cover = dataclasses.replace(spec, out_features=w1 - w0, in_features=v1 - v0,
                                bounds=_bounds((w0, w1), (v0, v1), spec.full_out, spec.full_in))
    return cover, (r0 - w0, r1 - r0), (c0 - v0, c1 - c0)


def head_shard(name: str, vocab: int, hidden: int, start: int, end: int, tp_size: int,
               tp_rank: int) -> Optional[ShardSpec]:
    """The EXL3 matrix of a vocab-parallel head (``ParallelLMHead``) on one rank, or None if the rank holds no row.

    ``[start, end)`` are the rank's real vocab rows (vLLM's ``shard_indices.org_vocab_start_index`` /
    ``org_vocab_end_index``, padding removed); the head is column-parallel over the vocab: rows of the HF
    ``[vocab, hidden]`` weight, all input columns. The rank's padded rows (vLLM pads the vocab per
    partition) are not part of the matrix: :func:`~exl3rt.integrations.vllm.forward.exl3_head_apply`
    returns zero logits for them, as vLLM's unquantized head (zero-filled rows) does.
    """
    start, end, vocab, hidden = int(start), int(end), int(vocab), int(hidden)
    if not 0 <= start <= end <= vocab:
        raise ShardError(f"{name}: rank {tp_rank} of {tp_size} would hold vocab rows [{start}, {end}) of a "
                         f"{vocab}-row head")
    if end == start:
        return None
    b = _bounds((start, end), (0, hidden), vocab, hidden)
    return ShardSpec(name, None, 0, end - start, hidden, vocab, hidden, tp_size, tp_rank, b)


__all__ = ["ShardSpec", "ShardError", "WHOLE", "shard_names", "column_shards", "row_shard", "head_shard",
           "block_cover", "check_block_aligned"]
