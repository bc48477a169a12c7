"""Map a vLLM linear layer (class, TP rank, fused shards) to its :class:`ShardSpec` list. Imports vLLM."""

from __future__ import annotations

from typing import Sequence

import torch

from ._compat import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                      RowParallelLinear)
from .shards import ShardError, ShardSpec, column_shards, row_shard


def plan_shards(layer: torch.nn.Module, prefix: str, names: Sequence[str], input_size_per_partition: int,
                output_partition_sizes: Sequence[int]) -> list[ShardSpec]:
    """The EXL3 matrices of ``layer`` on its rank, in the order of ``output_partition_sizes``.

    ``names``: HF names of the logical shards (one per output partition; ``[prefix]`` if unfused).
    """
    ops = [int(w) for w in output_partition_sizes]
    ipp = int(input_size_per_partition)
    tp_size, tp_rank = int(getattr(layer, "tp_size", 1)), int(getattr(layer, "tp_rank", 0))
    if len(names) != len(ops):
        raise ShardError(f"{prefix}: vLLM splits this layer into {len(ops)} output partitions {ops} but the "
                         f"model's packed_modules_mapping names {len(names)} checkpoint linears {list(names)}")
    if isinstance(layer, RowParallelLinear):
        return [row_shard(names[0], ops[0], int(layer.input_size), ipp, tp_size, tp_rank)]
    if isinstance(layer, QKVParallelLinear):
        rep = int(layer.num_kv_head_replicas)
        kv = int(layer.total_num_kv_heads)
        full = [int(layer.total_num_heads) * int(layer.head_size), kv * int(layer.head_size),
                kv * int(layer.v_head_size)]
        ranks = [tp_rank, tp_rank // rep, tp_rank // rep]
        ids: list[object] = ["q", "k", "v"]
    elif isinstance(layer, MergedColumnParallelLinear):
        full = [int(s) for s in layer.output_sizes]
        ranks = [tp_rank] * len(ops)
        ids = list(range(len(ops)))
    elif isinstance(layer, ColumnParallelLinear):
        full, ranks, ids = [int(layer.output_size)], [tp_rank], [None]
    elif isinstance(layer, ReplicatedLinear):
        full, ranks, ids = list(ops), [0] * len(ops), list(range(len(ops))) if len(ops) > 1 else [None]
        tp_size, tp_rank = 1, 0
    else:
        raise ShardError(f"{prefix}: {type(layer).__name__} is a linear layout the exl3 plugin does not know; "
                         f"keep it unquantized with quantization_config ignore=[{prefix!r}]")
    return column_shards(names, ids, full, ops, ranks, ipp, tp_size, tp_rank)


__all__ = ["plan_shards"]
