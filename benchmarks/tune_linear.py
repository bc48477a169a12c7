"""Launch-configuration sweep of the EXL3 linear kernels on one layer (GPU): which path and
configuration is fastest per row count, checked for correctness before timing.

    python benchmarks/tune_linear.py [--shape 4096 14336] [--bits 4] [--rows 1 16 256 2048]
                                     [--out benchmarks/results/tune_linear.json]

For each row count: the warp-level mma GEMV under several
``MmaConfig``s, and decode-to-fp16 + cuBLAS; every candidate is a CUDA-graph replay of a whole
``exl3_linear`` call rotating ``--copies`` weight copies (as ``bench_linear.py``), with bf16
``torch.matmul`` timed in the same run. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_linear import make_codes, rel, time_graphs  # noqa: E402
from common import commit, write_json  # noqa: E402
from exl3rt.format.reconstruct import reconstruct  # noqa: E402
from exl3rt.kernels import linear as kl  # noqa: E402

M = kl.MmaConfig
CANDIDATES = {
    "small": [("mma", M(4, 1, 4224)), ("mma", M(2, 1, 8448)), ("mma", M(4, 1, 8448)),
              ("mma", M(2, 2, 4224)), ("mma", M(4, 2, 2112)), ("mma", M(2, 4, 2112)), ("mma", M(8, 1, 2112)),
              ("mma", M(2, 1, 4224)), ("mma", M(4, 1, 3584)), ("mma", M(4, 1, 4224, swap=True))],
    "large": [("decode_mm", None), ("mma", M(8, 1, 2112)), ("mma", M(4, 1, 4224))],
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=2, default=[4096, 14336])
    ap.add_argument("--bits", type=float, default=4)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", default="benchmarks/results/tune_linear.json")
    args = ap.parse_args(argv)
    dev, cb = "cuda", args.codebook
    bits = int(args.bits) if args.bits == int(args.bits) else args.bits
    in_p, out_p = args.shape
    codes = make_codes(in_p, out_p, bits, args.copies, dev, seed=1)
    tr, suh, svh = codes[0]
    w = reconstruct(tr, suh, svh, cb, dtype=torch.float64)
    dense = [torch.randn(in_p, out_p, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.copies)]
    res = {"commit": commit(), "device": torch.cuda.get_device_name(0), "shape": [in_p, out_p], "K": bits,
           "codebook": cb, "rows": []}
    for r in args.rows:
        x = torch.randn(r, in_p, device=dev, dtype=torch.bfloat16)
        bf16 = time_graphs([lambda d=d: torch.matmul(x, d) for d in dense], args.iters)
        ref = x.double() @ w
        for path, cfg in CANDIDATES["small" if r <= 16 else "large"]:
            if path == "mma" and r > 64:
                continue
            if cfg is not None and cfg.swap and r > 8:     # the swapped operands take at most 8 rows
                continue
            kw = {"path": path, "mma_cfg": cfg}
            t0 = time.time()
            try:
                e = rel(kl.exl3_linear(x, tr, suh, svh, cb, **kw), ref)
                us = time_graphs([lambda c=c: kl.exl3_linear(x, c[0], c[1], c[2], cb, **kw) for c in codes],
                                 args.iters)
                err = None
            except Exception as exc:  # a configuration Triton cannot build (registers, shared memory)
                e, us, err = float("nan"), float("nan"), f"{type(exc).__name__}: {str(exc)[:200]}"
            row = {"rows": r, "path": path, "cfg": None if cfg is None else vars(cfg), "us": us, "bf16_us": bf16,
                   "rel": e, "s": time.time() - t0, "error": err}
            res["rows"].append(row)
            print(f"rows={r:5d} {path:9s} {cfg}: {us:8.1f} us  bf16 {bf16:7.1f}  ratio {us / bf16:5.2f}  "
                  f"rel {e:.1e}  ({row['s']:.0f} s){'  ' + err if err else ''}", flush=True)
    write_json(args.out, res)
    print("\n| rows | best path | config | µs | bf16 µs | ratio |")
    print("|---|---|---|---|---|---|")
    for r in args.rows:
        cands = [x for x in res["rows"] if x["rows"] == r and x["us"] == x["us"]]
        b = min(cands, key=lambda x: x["us"])
        print(f"| {r} | {b['path']} | {b['cfg']} | {b['us']:.1f} | {b['bf16_us']:.1f} | {b['us'] / b['bf16_us']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
