"""CPU reference decode throughput: the baseline that later kernels beat.

Times exl3rt.format on one random in x out layer (default 4096 x 4096, K = 4) for each codebook:
  unpack       trellis -> 16-bit states
  decode       trellis -> Q (fp16, rotated basis)
  reconstruct  trellis, suh, svh -> W (fp32, original basis, both 128-block Hadamards)
Prints a table and writes JSON (median of --repeats runs, weights per second).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import time

import torch
from common import commit, write_json

from exl3rt.format import decode, reconstruct, unpack_states
from exl3rt.format.random import random_linear


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (index tables, LUTs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=2, default=[4096, 4096], metavar=("IN", "OUT"))
    ap.add_argument("--bits", type=float, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/decode_cpu.json")
    args = ap.parse_args()
    bits = int(args.bits) if float(args.bits).is_integer() else args.bits
    n_in, n_out = args.shape
    rows = []
    for cb in ("3inst", "mcg", "mul1"):
        if cb != "mul1" and not float(bits).is_integer():
            continue
        lin = random_linear(n_in, n_out, bits, cb, seed=1)
        n = lin.num_weights
        for op, fn in (("unpack", lambda: unpack_states(lin.trellis, bits)),
                       ("decode", lambda: decode(lin.trellis, bits, cb)),
                       ("reconstruct", lambda: reconstruct(lin.trellis, lin.suh, lin.svh, cb))):
            sec = timed(fn, args.repeats)
            rows.append({"codebook": cb, "op": op, "seconds": sec, "weights_per_s": n / sec})
    result = {
        "what": "CPU reference decode (exl3rt.format, torch)", "shape": [n_in, n_out], "bits": bits,
        "date": dt.date.today().isoformat(), "commit": commit(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(), "rows": rows,
    }
    print(f"{n_in} x {n_out}, K = {bits}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'codebook':<8} {'op':<12} {'ms':>9} {'Mweights/s':>11}")
    for r in rows:
        print(f"{r['codebook']:<8} {r['op']:<12} {1e3 * r['seconds']:>9.1f} {r['weights_per_s'] / 1e6:>11.1f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
