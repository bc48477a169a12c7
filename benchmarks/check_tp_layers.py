"""Tensor-parallel EXL3 layers through the custom ops, one process per GPU, against the single-GPU layer.

For ``--tp`` ranks over NCCL (``--backend gloo``: the same check on the CPU, without CUDA graphs or timings that
mean anything):

* **MoE**: a mixed K3/K4 layer whose experts share their hidden-side rotations (the shared-H layout); each rank
  holds the gate/up column slice and the down row slice of every expert (``moe.tp.slice_expert``: the same trellis
  bytes, no re-encoding) and runs the layer as one ``torch.ops.exl3rt.moe`` call (an ``MoELayerRuntime`` on its
  device: the Triton launch on a GPU), then one all-reduce.
* **dense MLP**: ``down(silu(gate(x))·up(x))`` with gate/up split by columns and down by rows, three
  ``torch.ops.exl3rt.linear`` calls, then one all-reduce.

At each ``--tokens`` count (default 1, 32, 512), in eager mode and (GPU) with each rank's forward and all-reduce
captured in one CUDA graph: every rank must hold the same sum, bit for bit, and it must equal the single-GPU
layer (the unsliced weights through the same ops on rank 0) to fp16 rounding (relative error below ``--tol``).
Timings (rank 0, median of ``--iters``, CUDA events): the single-GPU layer, the TP forward with its all-reduce,
the rank's forward alone and the all-reduce alone. Prints a table, writes JSON, exits 0 (OK) or 1.

    python benchmarks/check_tp_layers.py                        # 2 GPUs, NCCL
    python benchmarks/check_tp_layers.py --backend gloo --tokens 1 5 --hidden 256 --intermediate 512
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

# NVLink multicast stays off on shared hosts (also in the spawned ranks, which inherit the environment)
for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _val)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_moe_tp_nccl import make_experts  # noqa: E402
from common import finish_tp_check, median_ms  # noqa: E402
from exl3rt.format import EncodedLinear  # noqa: E402
from exl3rt.kernels import ops  # noqa: E402,F401  (registers torch.ops.exl3rt.linear)
from exl3rt.moe import (MoELayerRuntime, MoERuntimeCache, MoESettings, Owner, auto_launch_factory,  # noqa: E402
                        slice_expert, tiers_from_experts)

NAME = "model.layers.0.mlp.experts"


def on(lin: EncodedLinear, dev: torch.device) -> EncodedLinear:
    return EncodedLinear(lin.trellis.to(dev), lin.suh.to(dev), lin.svh.to(dev), codebook=lin.codebook)


def linear(x: torch.Tensor, lin: EncodedLinear) -> torch.Tensor:
    return torch.ops.exl3rt.linear(x, lin.trellis, lin.suh, lin.svh, None, lin.codebook, lin.trellis.shape[1] * 16)


class OpExpert(dict):
    """gate/up/down EXL3 linears of one expert: the Triton MoE launch binds their codes, the reference launch
    (CPU) calls the expert, which runs the same custom op per projection."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, self["gate_proj"])) * linear(x, self["up_proj"]), self["down_proj"])


def moe_forward(experts, dev: torch.device, args, scope) -> callable:
    """``f(x, ids, w)``: the layer as one ``exl3rt::moe`` call on ``dev``."""
    ops_experts = [OpExpert({p: on(lin, dev) for p, lin in ex.items()}) for ex in experts]
    inter = ops_experts[0]["up_proj"].trellis.shape[1] * 16
    layer = MoELayerRuntime(NAME, tiers_from_experts(ops_experts, layer=NAME), ops_experts, hidden=args.hidden,
                            intermediate=inter, top_k=args.topk, settings=MoESettings(max_batched=max(args.tokens)),
                            cache=MoERuntimeCache(auto_launch_factory), owner=Owner.of(scope, NAME))
    scope.layers.append(layer)            # the op's registry holds layers weakly
    return lambda x, ids, w: torch.ops.exl3rt.moe(x, ids, w, layer.handle)


def mlp_forward(mlp, dev: torch.device) -> callable:
    ex = OpExpert({p: on(lin, dev) for p, lin in mlp.items()})
    return lambda x, ids, w: ex(x)


def timed(fn, iters: int, dev: torch.device) -> float:
    return median_ms(fn, iters, cuda=dev.type == "cuda")


def inputs(args, tokens: int, dev: torch.device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(args.seed + tokens)         # the same on every rank
    x = torch.randn(tokens, args.hidden, generator=g).to(dev, dtype)
    ids = torch.stack([torch.randperm(args.experts, generator=g)[:args.topk] for _ in range(tokens)])
    w = torch.rand(tokens, args.topk, generator=g)
    return x, ids.to(dev, torch.int32), (w / w.sum(-1, keepdim=True)).to(dev, dtype)


def worker(rank: int, args, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    gpu = args.backend == "nccl"
    if gpu:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    dtype = torch.float16 if gpu else torch.float32
    dist.init_process_group(args.backend, init_method=init, rank=rank, world_size=args.tp)
    scope = SimpleNamespace(layers=[])
    rows = []
    try:
        experts = make_experts(args, True)
        mlp = make_experts(SimpleNamespace(**{**vars(args), "experts": 1, "seed": args.seed + 7}), False)[0]
        layers = {"moe": (moe_forward([slice_expert(e, args.tp, rank) for e in experts], dev, args, scope),
                          moe_forward(experts, dev, args, scope) if rank == 0 else None),
                  "mlp": (mlp_forward(slice_expert(mlp, args.tp, rank), dev),
                          mlp_forward(mlp, dev) if rank == 0 else None)}
        for kind, (part, whole) in layers.items():
            for tokens in args.tokens:
                x, ids, w = inputs(args, tokens, dev, dtype)

                def tp():
                    y = part(x, ids, w)
                    dist.all_reduce(y)
                    return y

                modes = {"eager": tp()}
                y_tp = modes["eager"]
                graph = None
                if gpu:
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        y_graph = tp()
                    graph.replay()
                    torch.cuda.synchronize()
                    modes["graph"] = y_graph
                gathered = {m: [torch.empty_like(y) for _ in range(args.tp)] for m, y in modes.items()}
                for m, y in modes.items():
                    dist.all_gather(gathered[m], y)
                row = {"layer": kind, "tokens": tokens}
                if rank == 0:
                    y1 = whole(x, ids, w).double()
                    for m, ys in gathered.items():
                        row[f"{m}_ranks_agree"] = all(torch.equal(ys[0], y) for y in ys[1:])
                        row[f"{m}_rel_err"] = float((ys[0].double() - y1).norm() / y1.norm())
                # timings: every rank runs the collectives in step; rank 0 alone times its single-GPU layer
                row["tp_ms"] = timed(tp, args.iters, dev)
                row["rank_forward_ms"] = timed(lambda: part(x, ids, w), args.iters, dev)
                scratch = y_tp.clone()            # (reduced again and again: not the result checked above)
                row["all_reduce_ms"] = timed(lambda: dist.all_reduce(scratch), args.iters, dev)
                if graph is not None:
                    row["tp_graph_ms"] = timed(graph.replay, args.iters, dev)
                dist.barrier()
                if rank == 0:
                    row["single_gpu_ms"] = timed(lambda: whole(x, ids, w), args.iters, dev)
                dist.barrier()
                rows.append(row)
        if rank == 0:
            torch.save(rows, os.path.join(out_dir, "rows.pt"))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768, help="per expert, and of the dense MLP")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=5e-3, help="relative error against the single-GPU layer")
    ap.add_argument("--json", default="benchmarks/results/tp_layers.json")
    args = ap.parse_args(argv)
    if args.backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < args.tp):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"FAIL: need {args.tp} CUDA devices, found {found} (or run --backend gloo on the CPU)")
        return 2
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, f"file://{tmp}/rendezvous", tmp), nprocs=args.tp, join=True)
        rows = torch.load(Path(tmp) / "rows.pt")
    ok = True
    modes = ("eager", "graph") if args.backend == "nccl" else ("eager",)
    print("| layer | tokens | " + " | ".join(f"{m}: ranks agree, rel. err" for m in modes) +
          " | single GPU ms | TP ms (graph) | rank forward ms | all-reduce ms |")
    print("|---" * (6 + len(modes)) + "|")
    for r in rows:
        good = all(r[f"{m}_ranks_agree"] and r[f"{m}_rel_err"] < args.tol for m in modes)
        r["ok"] = good
        ok &= good
        g = f" ({r['tp_graph_ms']:.3f})" if "tp_graph_ms" in r else ""
        print(f"| {r['layer']} | {r['tokens']} | " +
              " | ".join(f"{r[f'{m}_ranks_agree']}, {r[f'{m}_rel_err']:.2e}" for m in modes) +
              f" | {r['single_gpu_ms']:.3f} | {r['tp_ms']:.3f}{g} | {r['rank_forward_ms']:.3f} | "
              f"{r['all_reduce_ms']:.3f} |")
    return finish_tp_check(args, rows, ok, f"TP={args.tp} over {args.backend}, {args.experts} experts K3/K4 "
                           f"top-{args.topk}, H={args.hidden}, I={args.intermediate}")


if __name__ == "__main__":
    sys.exit(main())
