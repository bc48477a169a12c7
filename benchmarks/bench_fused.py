"""Fused sibling layers on the GPU: one ``exl3_linear(..., bounds=...)`` call against the layers called apart.

    python benchmarks/bench_fused.py [--bits 2 4 6] [--rows 1 4 16 64] [--out benchmarks/results/fused_cuda.json]

Groups with Llama-3-8B's widths (4096 inputs): q/k/v (4096 + 1024 + 1024 outputs) and gate/up (2 × 14336). First
a check: at 1–2048 rows and K 2, 3, 4, 6, every segment of the fused call against its layer called alone (the
relative difference), and at K4 against ``x · W`` in fp32 from ``format.reconstruct``. Then the timings per call
(bf16 activations, planned calls): "graph" is one CUDA graph of 20 calls (median of 5 replays, per call), "eager"
64 eager calls between two events (the host's cost shows where it exceeds the GPU's); "apart" calls each layer
of the group once per call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit, write_json  # noqa: E402
from exl3rt.format.bits import words16_per_tile  # noqa: E402
from exl3rt.format.reconstruct import reconstruct  # noqa: E402
from exl3rt.kernels import linear as kl  # noqa: E402

GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336))}
CHECK_ROWS = (1, 3, 8, 12, 16, 24, 40, 64, 100, 300, 2048)


def codes(in_p, out_p, bits, seed):
    g = torch.Generator().manual_seed(seed)
    tr = torch.randint(-32768, 32768, (in_p // 16, out_p // 16, words16_per_tile(bits)), dtype=torch.int16, generator=g)

    def scales(n):
        return ((torch.rand(n, generator=g) + 0.5) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)).half()
    return tr.cuda(), scales(in_p).cuda(), scales(out_p).cuda()


def group(in_p, widths, bits):
    """The layers and their fused form: (layers, (trellis, suh, svh), bounds, starts)."""
    layers = [codes(in_p, w, bits, 7 * i + int(bits * 3)) for i, w in enumerate(widths)]
    fused = (torch.cat([t for t, _, _ in layers], dim=1).contiguous(), torch.stack([s for _, s, _ in layers]),
             torch.cat([v for _, _, v in layers]))
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return layers, fused, tuple(starts[1:]), starts


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check(bits_list) -> dict:
    out = {}
    for name, (in_p, widths) in GROUPS.items():
        for bits in bits_list:
            layers, fused, bounds, starts = group(in_p, widths, bits)
            dense = [reconstruct(*m, "mcg") for m in layers] if bits == 4 else None
            for rows in CHECK_ROWS:
                x = torch.randn(rows, in_p, device="cuda", dtype=torch.bfloat16)
                for _ in range(2):      # the first call records the plan, the second replays it
                    y = kl.exl3_linear(x, *fused, "mcg", bounds=bounds)
                apart = max(rel(y[:, a:a + w], kl.exl3_linear(x, *m, "mcg")) for m, a, w in zip(layers, starts, widths))
                fp32 = (max(rel(y[:, a:a + w], x.float() @ W) for W, a, w in zip(dense, starts, widths))
                        if dense else None)
                out[f"{name} K{bits} rows {rows}"] = {"vs apart": apart, "vs fp32": fp32,
                                                      "path": kl.choose_path(rows, wgmma=True, bits=bits)}
    return out


def graph_us(fn, calls: int = 20) -> float:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return sorted(times)[2]


def eager_us(fn, calls: int = 64) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return sorted(times)[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=float, nargs="+", default=[2, 4, 6])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "fused_cuda.json"))
    args = ap.parse_args()
    bits_list = [int(b) if b == int(b) else b for b in args.bits]
    checks = check(sorted(set(bits_list) | {4}))
    worst_apart = max(v["vs apart"] for v in checks.values())
    worst_fp32 = max(v["vs fp32"] for v in checks.values() if v["vs fp32"] is not None)
    print(f"check: every segment vs its layer alone <= {worst_apart:.1e}, vs fp32 x·W (K4) <= {worst_fp32:.1e}")
    rows_out = []
    print(f"\n{'group':<9}{'K':>4}{'rows':>6}{'graph fused':>13}{'apart':>9}{'eager fused':>13}{'apart':>9}  (µs per call)")
    for name, (in_p, widths) in GROUPS.items():
        for bits in bits_list:
            layers, fused, bounds, _ = group(in_p, widths, bits)
            for rows in args.rows:
                x = torch.randn(rows, in_p, device="cuda", dtype=torch.bfloat16)
                kl.prewarm([(in_p, sum(widths), bits, "mcg", bounds)] + [(in_p, w, bits, "mcg") for w in widths],
                           rows=[rows], dtype=torch.bfloat16)

                def one():
                    kl.exl3_linear(x, *fused, "mcg", bounds=bounds)

                def apart():
                    for m in layers:
                        kl.exl3_linear(x, *m, "mcg")
                r = dict(group=name, bits=bits, rows=rows, graph_fused=graph_us(one), graph_apart=graph_us(apart),
                         eager_fused=eager_us(one), eager_apart=eager_us(apart))
                rows_out.append(r)
                print(f"{name:<9}{bits:>4}{rows:>6}{r['graph_fused']:>13.1f}{r['graph_apart']:>9.1f}"
                      f"{r['eager_fused']:>13.1f}{r['eager_apart']:>9.1f}", flush=True)
    write_json(args.out, {"device": torch.cuda.get_device_name(), "commit": commit(), "checks": checks,
                          "timings_us": rows_out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
