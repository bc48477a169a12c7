"""Throughput and quality of the CPU tail-biting Viterbi encoder (numba backend).

    PYTHONPATH=src python benchmarks/bench_viterbi_cpu.py [--out benchmarks/results/viterbi_cpu.json]

For each bit width: Gaussian target tiles scaled to the codebook RMS (1.2437), encoded with
``exl3rt.encode.viterbi_numba.encode_tiles`` on 1 and 2 threads (best of ``--repeats`` timed
runs after a warm-up that also compiles / loads the kernels). Quality: relative MSE
``mean((q - w)^2) / mean(w^2)`` against the rate-distortion floor ``2^(-2K)`` of a Gaussian
source, in dB, at RMS 1.2437 and at the best of a few target RMS values (the quantizer's
global-scale search does that job). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

CODEBOOK_RMS = 1.24371088
SCALES = (0.9, 1.0, 1.1, 1.24371088, 1.35)  # target RMS values of the quality sweep


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _bits(s: str):
    x = float(s)
    return int(x) if x == int(x) else x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/viterbi_cpu.json")
    ap.add_argument("--bits", default="2,3,4,6,2.5", help="comma list; half-integers use mul1")
    ap.add_argument("--codebook", default="mcg", help="codebook for integer bit widths")
    ap.add_argument("--tiles", type=int, default=128, help="tiles per timed run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale-tiles", type=int, default=32, help="tiles per point of the target-RMS sweep")
    ap.add_argument("--ref", action="store_true", help="also time the torch reference (slow) at the first bit width")
    args = ap.parse_args()

    import numba
    import torch

    from exl3rt.encode.viterbi_numba import encode_tiles
    from exl3rt.encode.viterbi_ref import encode_tiles_ref

    threads = [int(t) for t in args.threads.split(",")]
    max_threads = numba.config.NUMBA_NUM_THREADS
    rng = np.random.default_rng(args.seed)
    rows = []
    for bits in [_bits(b) for b in args.bits.split(",")]:
        codebook = "mul1" if bits != int(bits) else args.codebook
        w = (rng.standard_normal((args.tiles, 256)) * CODEBOOK_RMS).astype(np.float32)
        t0 = time.perf_counter()
        encode_tiles(w[:2], bits, codebook, num_threads=1)
        warm_s = time.perf_counter() - t0
        row = {"bits": bits, "codebook": codebook, "tiles": args.tiles, "first_call_s": round(warm_s, 3),
               "loadavg_1m_before": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
        values = None
        for nt in threads:
            if nt > max_threads:
                continue
            numba.set_num_threads(nt)
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                _, values = encode_tiles(w, bits, codebook)
                best = min(best, time.perf_counter() - t0)
            row[f"weights_per_s_{nt}t"] = round(w.size / best)
        numba.set_num_threads(max_threads)
        rel_mse = float(((values - w) ** 2).mean() / (w ** 2).mean())
        row["rel_mse"] = rel_mse
        row["db_over_floor"] = round(10 * np.log10(rel_mse / 2.0 ** (-2 * bits)), 3)
        # the same at other target scales (the quantizer's global-scale search picks the best)
        u = w[: args.scale_tiles] / CODEBOOK_RMS
        sweep = {}
        for scale in SCALES:
            _, v = encode_tiles(u * scale, bits, codebook)
            rel = float(((v / scale - u) ** 2).mean() / (u ** 2).mean())
            sweep[str(scale)] = round(10 * np.log10(rel / 2.0 ** (-2 * bits)), 3)
        best_scale = min(sweep, key=sweep.get)
        row["db_over_floor_by_rms"] = sweep
        row["best_rms"] = float(best_scale)
        row["db_over_floor_best_rms"] = sweep[best_scale]
        rows.append(row)
        print(f"K={bits!s:<4} {codebook:<5} " + "  ".join(
            f"{nt}t {row.get(f'weights_per_s_{nt}t', float('nan')):>9,.0f} w/s" for nt in threads)
            + f"   {row['db_over_floor']:+.3f} dB over 2^-2K at RMS 1.24,"
            f" {row['db_over_floor_best_rms']:+.3f} dB at RMS {float(best_scale):.2f}"
            f"   (first call {warm_s:.1f} s)", flush=True)

    ref_row = None
    if args.ref:
        bits = _bits(args.bits.split(",")[0])
        codebook = "mul1" if bits != int(bits) else args.codebook
        w = torch.from_numpy((rng.standard_normal((4, 256)) * CODEBOOK_RMS).astype(np.float32))
        t0 = time.perf_counter()
        encode_tiles_ref(w, bits, codebook)
        dt = time.perf_counter() - t0
        ref_row = {"bits": bits, "codebook": codebook, "tiles": 4, "weights_per_s": round(w.numel() / dt),
                   "torch_threads": torch.get_num_threads()}
        print(f"torch reference K={bits}: {ref_row['weights_per_s']:,} w/s ({torch.get_num_threads()} torch threads)")

    result = {
        "benchmark": "viterbi_cpu",
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "numba": numba.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "target_rms": CODEBOOK_RMS,
        "repeats": args.repeats,
        "results": rows,
        "torch_reference": ref_row,
        "load_avg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
