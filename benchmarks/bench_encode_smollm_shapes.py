"""Whole-layer CPU encode speed on SmolLM2-135M's linear shapes, optionally beside a baseline tree.

quantize_weight(w, K, "mcg") (uncalibrated: regularization, g search, Viterbi, packing) of
i.i.d. Gaussian weights in EXL3 orientation [in, out] (the HF weight transposed):

    q_proj, o_proj  576 x 576    (padded 640 x 640)     x2 per decoder layer
    k_proj, v_proj  576 x 192    (padded 640 x 256)     x2
    gate, up        576 x 1536   (padded 640 x 1536)    x2
    down_proj      1536 x 576    (padded 1536 x 640)    x1

A whole decoder layer is 3,538,944 logical weights; SmolLM2-135M has 30 (106.2 M). Each round runs
one worker process per tree (the trees alternate, so both see the same machine load); every shape
is timed ``--reps`` times per worker after a JIT warm-up, and the best over all rounds is kept.

    # baseline = the committed tree, candidate = the working tree
    mkdir -p /tmp/base && git archive HEAD src | tar -x -C /tmp/base
    PYTHONPATH=src python benchmarks/bench_encode_smollm_shapes.py --baseline /tmp/base/src

Prints a table (logical weights/s per shape, the layer-weighted figure, the projected 30-layer
time, dB over the 2^(-2K) floor) and writes benchmarks/results/encode_smollm_shapes.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {"q/o": ((576, 576), 2), "k/v": ((576, 192), 2), "gate/up": ((576, 1536), 2), "down": ((1536, 576), 1)}
LAYERS = 30


def worker(args) -> None:
    import torch

    from exl3rt.encode.quantize import quantize_weight

    quantize_weight(torch.randn(256, 256), args.bits, "mcg", backend="numba")  # JIT / kernel cache
    out = {}
    for name, ((n_in, n_out), _) in SHAPES.items():
        w = torch.randn(n_in, n_out, generator=torch.Generator().manual_seed(n_in * 7 + n_out))
        best = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            enc = quantize_weight(w, args.bits, "mcg", backend="numba")
            best = min(best, time.perf_counter() - t0)
        mse = float((enc.reconstruct() - w).double().square().sum() / w.double().square().sum())
        out[name] = {"seconds": best, "db_over_floor": 10 * math.log10(mse / 2 ** (-2 * args.bits)),
                     "g_scale": enc.info["g_scale"], "encoder_version": enc.info.get("encoder_version")}
    Path(args.json).write_text(json.dumps(out))


def layer_stats(res: dict) -> dict:
    n_layer = sum(i * o * c for (i, o), c in SHAPES.values())
    t_layer = sum(res[name]["seconds"] * c for name, (_, c) in SHAPES.items())
    return {"layer_seconds": t_layer, "layer_weights_per_s": n_layer / t_layer,
            "model_minutes": LAYERS * t_layer / 60}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=1, help="timed encodes per shape per worker")
    ap.add_argument("--src", default="src", help="candidate tree's src/ (default: this checkout)")
    ap.add_argument("--baseline", default=None, help="baseline tree's src/ (e.g. from git archive HEAD)")
    ap.add_argument("--out", default="benchmarks/results/encode_smollm_shapes.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import commit, write_json

    trees = {"candidate": str(Path(args.src).resolve())}
    if args.baseline:
        trees = {"baseline": str(Path(args.baseline).resolve()), **trees}
    best: dict[str, dict] = {k: {} for k in trees}
    loads = []
    for r in range(args.rounds):
        for label, src in trees.items():
            with tempfile.TemporaryDirectory() as tmp:
                jpath = os.path.join(tmp, "r.json")
                env = {**os.environ, "PYTHONPATH": src}
                loads.append(os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
                subprocess.run([sys.executable, __file__, "--worker", "--json", jpath, "--bits", str(args.bits),
                                "--reps", str(args.reps)], env=env, check=True)
                res = json.loads(Path(jpath).read_text())
            for name, row in res.items():
                if name not in best[label] or row["seconds"] < best[label][name]["seconds"]:
                    best[label][name] = row
            print(f"round {r + 1}/{args.rounds} {label}: "
                  + ", ".join(f"{n} {row['seconds']:.2f}s" for n, row in res.items()), flush=True)

    print(f"\nSmolLM2-135M shapes, K={args.bits} mcg, uncalibrated, numba, best of {args.rounds} rounds x "
          f"{args.reps}; {dt.date.today()}, commit {commit()} + working tree; load avg {loads}")
    hdr = f"{'layer':>8} {'in x out':>11} " + " ".join(f"{k + ' kw/s':>16} {k[:4] + ' dB':>9}" for k in trees)
    print(hdr + (f" {'speedup':>8}" if args.baseline else ""))
    rows = []
    for name, ((i, o), c) in SHAPES.items():
        line = f"{name:>8} {f'{i}x{o}':>11} "
        row = {"layer": name, "shape": [i, o], "count_per_block": c}
        for label in trees:
            b = best[label][name]
            kws = i * o / b["seconds"] / 1e3
            row[label] = {**b, "weights_per_s": i * o / b["seconds"]}
            line += f"{kws:>16.1f} {b['db_over_floor']:>9.3f} "
        if args.baseline:
            row["speedup"] = best["baseline"][name]["seconds"] / best["candidate"][name]["seconds"]
            line += f"{row['speedup']:>8.2f}x"
        rows.append(row)
        print(line)
    summary = {label: layer_stats(best[label]) for label in trees}
    for label, s in summary.items():
        print(f"{label}: whole decoder layer {s['layer_seconds']:.2f} s = {s['layer_weights_per_s'] / 1e3:.1f} k "
              f"logical weights/s; {LAYERS} layers (106.2 M weights) = {s['model_minutes']:.1f} min")
    if args.baseline:
        print(f"layer speedup {summary['baseline']['layer_seconds'] / summary['candidate']['layer_seconds']:.2f}x")
    write_json(args.out, {
        "what": "quantize_weight on SmolLM2-135M linear shapes, uncalibrated, Gaussian weights, numba",
        "bits": args.bits, "codebook": "mcg", "rounds": args.rounds, "reps": args.reps,
        "date": dt.date.today().isoformat(), "commit": commit() + " + working tree", "loadavg_1m": loads,
        "trees": trees, "rows": rows, "summary": summary,
    })


if __name__ == "__main__":
    main()
