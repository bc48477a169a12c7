"""Whole-layer encode speed and quality: quantize_weight on a Gaussian layer, per K.

Measures the full uncalibrated encode (regularization, g search, Viterbi, packing) of one
in x out layer with i.i.d. Gaussian weights, and reports relative MSE and its distance to the
2^(-2K) floor in dB. The first K is run once untimed to exclude JIT compilation.

  python benchmarks/bench_encode.py --device cpu  --shape 1024 1024 --bits 2 3 4 6
  python benchmarks/bench_encode.py --device cuda --shape 4096 4096 --bits 2 3 4 6
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import platform
import time

import torch
from common import commit, write_json

from exl3rt.encode.quantize import quantize_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", type=int, nargs=2, default=[1024, 1024], metavar=("IN", "OUT"))
    ap.add_argument("--bits", type=float, nargs="+", default=[2, 3, 4, 6])
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch/numba threads (0: default)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/encode_<device>.json)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        try:
            import numba
            numba.set_num_threads(args.threads)
        except ImportError:
            pass
    dev = torch.device(args.device)
    n_in, n_out = args.shape
    w = torch.randn(n_in, n_out, generator=torch.Generator().manual_seed(0)).to(dev)
    small = w[:256, :256].contiguous()
    rows = []
    for b in args.bits:
        bits = int(b) if float(b).is_integer() else b
        cb = args.codebook if float(bits).is_integer() else "mul1"
        quantize_weight(small, bits, cb, backend=args.backend)  # warm-up: JIT / autotune
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        enc = quantize_weight(w, bits, cb, backend=args.backend)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        mse = float((enc.reconstruct() - w).square().sum() / w.square().sum())
        rows.append({"bits": bits, "codebook": cb, "seconds": sec, "weights_per_s": w.numel() / sec,
                     "rel_mse": mse, "db_over_floor": 10 * math.log10(mse / 2 ** (-2 * bits)),
                     "backend": enc.info["backend"], "g_scale": enc.info["g_scale"]})
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    threads = torch.get_num_threads()
    result = {"what": "quantize_weight, uncalibrated, Gaussian weights", "shape": [n_in, n_out],
              "device": dev_name, "threads": threads, "date": dt.date.today().isoformat(), "commit": commit(),
              "torch": torch.__version__, "rows": rows}
    print(f"{n_in} x {n_out} on {dev_name} ({threads} threads), {dt.date.today()}, commit {result['commit']}")
    print(f"{'K':>4} {'cb':>5} {'backend':>8} {'seconds':>9} {'kweights/s':>11} {'rel MSE':>9} {'dB>floor':>9}")
    for r in rows:
        print(f"{r['bits']!s:>4} {r['codebook']:>5} {r['backend']:>8} {r['seconds']:>9.2f} "
              f"{r['weights_per_s'] / 1e3:>11.1f} {r['rel_mse']:>9.5f} {r['db_over_floor']:>9.2f}")
    write_json(args.out or f"benchmarks/results/encode_{dev.type}.json", result)


if __name__ == "__main__":
    main()
