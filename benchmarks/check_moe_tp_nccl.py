"""Check tensor-parallel EXL3 MoE experts over NCCL: the all-reduced TP=N output equals the TP=1 output.

What it does (the GPU twin of ``tests/test_moe_tp.py::test_gloo_two_ranks_equal_tp1``):

1. builds random EXL3 experts on the CPU (mixed K3/K4, mcg), one layer, and writes a rank-sliced
   checkpoint for each rotation layout (``per_expert``, ``shared_h``) with ``save_rank_sliced``;
2. computes the TP=1 reference in float64 on the CPU from the full experts (``format.reconstruct``);
3. spawns one process per GPU (``torch.multiprocessing.spawn``), NCCL, file:// rendezvous; each
   rank loads only its slices onto ``cuda:<rank>``, reconstructs them in fp64 and fp32, runs
   ``tp_moe_forward`` (all-reduce SUM over NCCL) and saves its output;
4. compares: every rank holds the same sum, and it matches the reference (fp64 rel. error < 1e-10,
   fp32 < 1e-5). Prints a table, ``OK`` or ``FAIL`` with the max error, writes JSON, exits 0 / 1.

Run from the repository root on a machine with >= 2 GPUs::

    python benchmarks/check_moe_tp_nccl.py                     # TP 2
    python benchmarks/check_moe_tp_nccl.py --tp 4 --json benchmarks/results/moe_tp_nccl_tp4.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import finish_tp_check  # noqa: E402
from exl3rt.format import EncodedLinear, reconstruct  # noqa: E402
from exl3rt.format.bits import words16_per_tile  # noqa: E402
from exl3rt.moe.rank_checkpoint import load_rank_sliced, save_rank_sliced  # noqa: E402
from exl3rt.moe.tp import dense_experts, tp_moe_forward  # noqa: E402

PREFIX = "model.layers.0.mlp"
LAYOUTS = ("per_expert", "shared_h")
TOL = {"float64": 1e-10, "float32": 1e-5}


def make_experts(args: argparse.Namespace, shared_h: bool) -> list[dict[str, EncodedLinear]]:
    """Random valid experts (any int16 trellis decodes); K alternates 3, 4 (mixed bitrates)."""
    g = torch.Generator().manual_seed(args.seed)

    def vec(n: int, scale: float) -> torch.Tensor:
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        return (sign * (0.5 + torch.rand(n, generator=g)) * scale).to(torch.float16)

    def lin(rows: int, cols: int, k: int, suh=None, svh=None) -> EncodedLinear:
        tr = torch.randint(-32768, 32768, (rows // 16, cols // 16, words16_per_tile(k)), generator=g,
                           dtype=torch.int32).to(torch.int16)
        return EncodedLinear(tr, vec(rows, 0.05) if suh is None else suh, vec(cols, 1.0) if svh is None else svh,
                             codebook="mcg")

    h, i = args.hidden, args.intermediate
    shared = {"gate_proj": vec(h, 0.05), "up_proj": vec(h, 0.05), "down_proj": vec(h, 1.0)} if shared_h else {}
    out = []
    for e in range(args.experts):
        k = 3 if e % 2 == 0 else 4
        out.append({"gate_proj": lin(h, i, k, suh=shared.get("gate_proj")),
                    "up_proj": lin(h, i, k, suh=shared.get("up_proj")),
                    "down_proj": lin(i, h, k, svh=shared.get("down_proj"))})
    return out


def reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts) -> torch.Tensor:
    """TP=1 in float64 on the CPU, straight from format.reconstruct (independent of exl3rt.moe.tp)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e, ex in enumerate(experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        wt = {p: reconstruct(lin.trellis, lin.suh, lin.svh, lin.codebook, dtype=torch.float64) for p, lin in ex.items()}
        xe = x[tok]
        y = (F.silu(xe @ wt["gate_proj"]) * (xe @ wt["up_proj"])) @ wt["down_proj"]
        out.index_add_(0, tok, y * w[tok, slot][:, None])
    return out


def worker(rank: int, tp: int, backend: str, init: str, paths: dict, x: torch.Tensor, ids: torch.Tensor,
           w: torch.Tensor, out_dir: str) -> None:
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=tp)
    try:
        results = {}
        for layout, path in paths.items():
            layer = load_rank_sliced(path, rank, tp, device=dev)[PREFIX]
            for dtype in (torch.float64, torch.float32):
                experts = dense_experts(layer.experts, dtype=dtype)
                y = tp_moe_forward(x.to(dev, dtype), ids.to(dev), w.to(dev, dtype), experts)
                assert y.device == dev
                results[f"{layout}.{str(dtype).replace('torch.', '')}"] = y.cpu()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=640)
    ap.add_argument("--tokens", type=int, default=37)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                    help="gloo runs the same check on the CPU (a smoke test of this script without GPUs)")
    ap.add_argument("--json", default="benchmarks/results/moe_tp_nccl.json")
    args = ap.parse_args()
    if args.backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < args.tp):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"FAIL: need {args.tp} CUDA devices, found {found} (or run --backend gloo on the CPU)")
        return 2
    import torch.multiprocessing as mp

    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.tokens, args.hidden, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(args.experts, generator=g)[:args.topk] for _ in range(args.tokens)])
    w = torch.rand(args.tokens, args.topk, generator=g, dtype=torch.float64)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        paths, truth = {}, {}
        for layout in LAYOUTS:
            experts = make_experts(args, layout == "shared_h")
            paths[layout] = str(save_rank_sliced(Path(tmp) / layout, {PREFIX: experts}, args.tp,
                                                 rotation_layout=layout))
            truth[layout] = reference(x, ids, w, experts)
        init = f"file://{tmp}/rendezvous"
        mp.spawn(worker, args=(args.tp, args.backend, init, paths, x, ids, w, tmp), nprocs=args.tp, join=True)
        res = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(args.tp)]
    for key, y in res[0].items():
        layout, dtype = key.split(".")
        same = all(torch.equal(r[key], y) for r in res[1:])
        ref = truth[layout]
        max_abs = float((y.double() - ref).abs().max())
        rel = max_abs / float(ref.abs().max())
        good = same and rel < TOL[dtype]
        ok &= good
        rows.append({"layout": layout, "dtype": dtype, "ranks_agree": same, "max_abs_err": max_abs,
                     "rel_err": rel, "tol": TOL[dtype], "ok": good})
    print(f"{'layout':<11} {'dtype':<8} {'ranks agree':>11} {'max abs err':>12} {'rel err':>10} {'tol':>7}  result")
    for r in rows:
        print(f"{r['layout']:<11} {r['dtype']:<8} {str(r['ranks_agree']):>11} {r['max_abs_err']:>12.3e} "
              f"{r['rel_err']:>10.3e} {r['tol']:>7.0e}  {'ok' if r['ok'] else 'FAIL'}")
    worst = max(r["rel_err"] for r in rows)
    return finish_tp_check(args, rows, ok, f"max relative error {worst:.3e} (TP={args.tp}, {args.backend}, "
                           f"{args.experts} experts K3/K4, H={args.hidden}, I={args.intermediate})")


if __name__ == "__main__":
    sys.exit(main())
