"""EXL3 linear kernels on the GPU: exl3rt.kernels.exl3_linear vs bf16 torch.matmul.

    python benchmarks/bench_linear.py [--quick] [--codebook mcg] [--shapes 4096x14336,14336x4096] [--bits 2 4]
                                      [--rows 1 16 256] [--out benchmarks/results/linear_cuda.json]

Per (layer in×out, K): ``--copies`` (default 8) independent random weight copies, rotated call by
call so that no copy is served from the 60 MB L2; each timed call is a CUDA-graph replay of one
whole ``exl3_linear`` (input rotation, the path ``choose_path`` picks — mma GEMV, the Hopper
wgmma kernel or decode + cuBLAS — output rotation), bracketed by CUDA events; the median over ``--iters``
calls is reported, with the other paths at rows 1/4/16/64/256/2048 for the dispatch thresholds; "batched" columns
time one CUDA graph of 32 calls (per call: the per-replay launch cost amortized). ``torch.matmul``
in bf16 on the same number of dense copies is timed the same way in the same run. "eager" columns time 64 eager
calls between two events (copies rotated; the host's launch cost shows where it exceeds the GPU time):
the planned call (``exl3_linear``), the full unplanned call (``kl._linear``: every decision and a JIT launch
each time) and bf16 ``torch.matmul``; "module eager" times ``Exl3Linear`` against ``nn.Linear``. Before timing,
every (shape, K) is checked against ``format.reconstruct`` in float64 (fp32 inputs, rows 1/4/16/64/200)
and the Triton decode against ``format.decode`` bit for bit. Also times the mma GEMV kernel alone
(rows 1 and 16) and reports decoded weights/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit, write_json  # noqa: E402
from exl3rt.format.bits import words16_per_tile  # noqa: E402
from exl3rt.format.reconstruct import decode, reconstruct  # noqa: E402
from exl3rt.kernels import linear as kl  # noqa: E402

SHAPES = [(4096, 14336), (14336, 4096), (8192, 8192)]
BITS = [2, 3, 4, 6]
ROWS = [1, 4, 16, 64, 256, 2048]
ANCHORS = {  # exllamav3 1.6.5 (MCG) on the H200, issue 5: (in, out, K, rows) -> µs
    (4096, 14336, 4, 1): 32.9, (4096, 14336, 2, 1): 34.3, (4096, 14336, 6, 1): 42.7,
    (14336, 4096, 4, 1): 37.0, (8192, 8192, 4, 1): 46.3, (4096, 14336, 4, 16): 43.0,
    (4096, 14336, 4, 256): 145.0, (4096, 14336, 4, 2048): 476.0,
}


def _warm(fns, warmup: int) -> None:
    """Run each call ``warmup`` times on a side stream (compiles, allocator pools) before capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            for _ in range(warmup):
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def time_graphs(fns, iters: int, warmup: int = 3) -> float:
    """Median µs of one call, rotating over ``fns`` (one per weight copy), each captured in a CUDA graph."""
    graphs = []
    _warm(fns, warmup)
    for f in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        graphs.append(g)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (a, b) in enumerate(ev):
        a.record()
        graphs[i % len(graphs)].replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1000.0


def time_batched(fns, iters: int, calls: int = 32, warmup: int = 2) -> float:
    """Median µs per call of one CUDA graph holding ``calls`` calls (cycling over ``fns``): the
    per-replay launch cost (~9 µs event to event on the H200 for a one-kernel graph) is spread over
    the calls, as in a model's decode step, where one graph holds hundreds of kernels."""
    _warm(fns, warmup)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    n = max(5, iters // 10)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1000.0 / calls


def time_eager(fns, iters: int, calls: int = 64) -> tuple[float, float]:
    """(µs per call, host µs per call) of ``calls`` eager calls (cycling over ``fns``) between two events, the
    median of a few rounds: the host's launch cost or the GPU time, whichever bounds, as ``model.generate``
    meets it; the host figure is the wall time from the first call to the last launch returned."""
    for f in fns:      # compile, plan, fill the allocator
        f()
    torch.cuda.synchronize()
    dev_t, host_t = [], []
    for _ in range(max(5, iters // 20)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        t1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize()
        dev_t.append(a.elapsed_time(b) * 1000.0 / calls)
        host_t.append((t1 - t0) * 1e6 / calls)
    return statistics.median(dev_t), statistics.median(host_t)


def make_codes(in_p, out_p, bits, copies, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    w = words16_per_tile(bits)
    out = []
    for _ in range(copies):
        tr = torch.randint(-32768, 32768, (in_p // 16, out_p // 16, w), dtype=torch.int16, device=dev, generator=g)
        suh = ((torch.rand(in_p, device=dev, generator=g) + 0.5) * 0.05).half()
        svh = ((torch.rand(out_p, device=dev, generator=g) + 0.5) * 0.05).half()
        out.append((tr, suh, svh))
    return out


def rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


TOL = {"mma": 1e-3, "wgmma": 1e-3, "decode_mm": 3e-3}  # x' rounded to fp16


def wgmma_here() -> bool:
    """The path choice of this device (the wgmma kernel on Hopper)."""
    from exl3rt.kernels import wgmma
    return wgmma.available(torch.device("cuda"))


def check(codes, codebook, bits, dev):
    tr, suh, svh = codes
    res = {}
    q = kl.decode_fp16(tr, codebook)
    res["decode_exact"] = bool(torch.equal(q, decode(tr, bits, codebook)))
    del q
    w = reconstruct(tr, suh, svh, codebook, dtype=torch.float64)
    ok = res["decode_exact"]
    for rows in (1, 4, 16, 64, 200):
        x = torch.randn(rows, tr.shape[0] * 16, device=dev)
        y = kl.exl3_linear(x, tr, suh, svh, codebook)
        path = kl.choose_path(rows, wgmma=wgmma_here(), bits=bits)
        res[f"rel_rows{rows}_{path}"] = e = rel(y, x.double() @ w)
        ok = ok and bool(torch.isfinite(y).all()) and e < TOL[path]
    del w
    res["ok"] = ok
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4096x14336 only, K 2/4, rows 1/16/256")
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--shapes", default="", help="layers as INxOUT,INxOUT (default: the issue's three)")
    ap.add_argument("--bits", type=float, nargs="+", default=None, help="K values (default 2 3 4 6)")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="row counts (default 1 4 16 64 256 2048)")
    ap.add_argument("--all-paths", action="store_true",
                    help="time every path that can run at each row count (the dispatch thresholds), not a few")
    ap.add_argument("--out", default="benchmarks/results/linear_cuda.json")
    args = ap.parse_args(argv)
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes, bits_list, rows_list = SHAPES, BITS, ROWS
    if args.quick:
        shapes, bits_list, rows_list = SHAPES[:1], [2, 4], [1, 16, 256]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.bits:
        bits_list = [int(b) if float(b).is_integer() else b for b in args.bits]
    if args.rows:
        rows_list = args.rows
    cb = args.codebook
    props = torch.cuda.get_device_properties(0)
    results = {"commit": commit(), "device": props.name, "sms": props.multi_processor_count,
               "torch": torch.__version__, "codebook": cb, "copies": args.copies, "iters": args.iters,
               "checks": [], "kernels": [], "rows": []}
    import triton
    results["triton"] = triton.__version__

    # Exl3Linear on CUDA dispatches to these kernels: check it end to end (padding, trim, bias) once
    from exl3rt.runtime.linear import Exl3Linear
    t0 = time.time()
    n_pre = kl.prewarm([(4096, 14336, 4, cb)], dtype=torch.bfloat16)
    results["prewarm"] = {"launches": n_pre, "s": time.time() - t0}
    m = Exl3Linear(4000, 14000, 4, cb, bias=True, device=dev, dtype=torch.bfloat16)
    tr, suh, svh = make_codes(4096, 14080, 4, 1, dev, seed=99)[0]
    m.trellis.copy_(tr); m.suh.copy_(suh); m.svh.copy_(svh); m.bias.data.normal_()
    w = reconstruct(m.trellis, m.suh, m.svh, cb, dtype=torch.float64)[:4000, :14000]
    for rows in (1, 3, 37):
        x = torch.randn(2, rows, 4000, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ w + m.bias.double()
        e = rel(m(x), ref)
        results["checks"].append({"module": "Exl3Linear 4000x14000 K4 bias", "rows": rows, "rel": e,
                                  "ok": e < 1e-2})
        print(f"Exl3Linear rows=2x{rows}: rel {e:.2e} (bf16 output)", flush=True)
    del w
    # the module as a model calls it, eager: Exl3Linear (4096 -> 14336, K4) against nn.Linear in bf16
    m = Exl3Linear(4096, 14336, 4, cb, device=dev, dtype=torch.bfloat16)
    m.trellis.copy_(make_codes(4096, 14336, 4, 1, dev, seed=98)[0][0])
    lin = torch.nn.Linear(4096, 14336, bias=False, device=dev, dtype=torch.bfloat16)
    results["module_eager"] = []
    with torch.inference_mode():
        for rows in (1, 4, 16):
            x = torch.randn(1, rows, 4096, device=dev, dtype=torch.bfloat16)
            e, eh = time_eager([lambda: m(x)], args.iters)
            b, bh = time_eager([lambda: lin(x)], args.iters)
            results["module_eager"].append({"rows": rows, "exl3_us": e, "exl3_host_us": eh, "bf16_us": b,
                                            "bf16_host_us": bh})
            print(f"module eager rows={rows}: Exl3Linear {e:.1f} us (host {eh:.1f}), nn.Linear bf16 {b:.1f} us "
                  f"(host {bh:.1f})", flush=True)
    del m, lin

    for in_p, out_p in shapes:
        xs_bf = {r: torch.randn(r, in_p, device=dev, dtype=torch.bfloat16) for r in rows_list}
        dense = [torch.randn(in_p, out_p, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.copies)]
        bf16, bf16_b, bf16_e = {}, {}, {}
        for r in rows_list:
            bf16[r] = time_graphs([lambda w=w, r=r: torch.matmul(xs_bf[r], w) for w in dense], args.iters)
            bf16_e[r] = time_eager([lambda w=w, r=r: torch.matmul(xs_bf[r], w) for w in dense], args.iters)
            bf16_b[r] = time_batched([lambda w=w, r=r: torch.matmul(xs_bf[r], w) for w in dense], args.iters)
        del dense
        torch.cuda.empty_cache()
        for bits in bits_list:
            codes = make_codes(in_p, out_p, bits, args.copies, dev, seed=int(bits * 2))  # half-integer K (MUL1) gives a float
            t0 = time.time()
            chk = check(codes[0], cb, bits, dev)
            chk.update({"in": in_p, "out": out_p, "K": bits, "check_s": time.time() - t0})
            results["checks"].append(chk)
            print(f"check {in_p}x{out_p} K={bits}: {'OK' if chk['ok'] else 'FAIL'} "
                  f"{ {k: v for k, v in chk.items() if k.startswith('rel')} }", flush=True)
            # x' in fragment order, as exl3_linear's pre-pass writes it (padded to whole row blocks)
            x16 = torch.randn(kl.xfrag_rows(16, kl.default_mma_config(16)), in_p, device=dev, dtype=torch.float16)
            us16 = time_graphs([lambda c=c: kl.mma_rotated(x16, c[0], cb, rows=16) for c in codes], args.iters)
            x1h = torch.randn(kl.xfrag_rows(1, kl.default_mma_config(1)), in_p, device=dev, dtype=torch.float16)
            us = time_graphs([lambda c=c: kl.mma_rotated(x1h, c[0], cb, rows=1) for c in codes], args.iters)
            ub1 = time_batched([lambda c=c: kl.mma_rotated(x1h, c[0], cb, rows=1) for c in codes], args.iters)
            ub16 = time_batched([lambda c=c: kl.mma_rotated(x16, c[0], cb, rows=16) for c in codes], args.iters)
            nweights = in_p * out_p
            results["kernels"].append({"in": in_p, "out": out_p, "K": bits, "mma1_us": us,
                                       "mma1_tweights_per_s": nweights / us / 1e6,
                                       "mma1_trellis_GBps": nweights * bits / 8 / us / 1e3,
                                       "mma16_us": us16, "mma16_tweights_per_s": nweights / us16 / 1e6,
                                           "mma1_batched_us": ub1, "mma16_batched_us": ub16,
                                           "mma1_batched_tweights_per_s": nweights / ub1 / 1e6})
            for r in rows_list:
                x = xs_bf[r]
                fns = [lambda c=c: kl.exl3_linear(x, c[0], c[1], c[2], cb) for c in codes]
                us = time_graphs(fns, args.iters)
                eager, eager_host = time_eager(fns, args.iters)
                full, full_host = time_eager([lambda c=c: kl._linear(x, c[0], c[1], c[2], cb) for c in codes],
                                             args.iters)
                row = {"in": in_p, "out": out_p, "K": bits, "rows": r, "us": us, "bf16_us": bf16[r],
                       "eager_us": eager, "eager_host_us": eager_host, "unplanned_eager_us": full,
                       "unplanned_eager_host_us": full_host, "bf16_eager_us": bf16_e[r][0],
                       "batched_us": time_batched(fns, args.iters), "bf16_batched_us": bf16_b[r],
                       "path": kl.choose_path(r, wgmma=wgmma_here(), bits=bits),
                       "exllamav3_us": ANCHORS.get((in_p, out_p, bits, r))}
                others = {4: ("decode_mm",), 16: ("decode_mm",), 64: ("mma", "decode_mm"),
                          256: ("decode_mm",), 2048: ("wgmma",) if wgmma_here() else ()}.get(r, ())
                if args.all_paths:
                    others = (("mma",) if r <= 64 else ()) + \
                        (("wgmma",) if wgmma_here() else ()) + ("decode_mm",)
                others = tuple(o for o in others if o != row["path"])
                for other in others:  # the other paths, for the dispatch thresholds
                    row[f"{other}_us"] = time_graphs(
                        [lambda c=c, o=other: kl.exl3_linear(x, c[0], c[1], c[2], cb, path=o) for c in codes],
                        args.iters)
                results["rows"].append(row)
                print(f"{in_p}x{out_p} K={bits} rows={r}: {us:.1f} us ({row['path']}; bf16 {bf16[r]:.1f}; "
                      f"batched {row['batched_us']:.1f} vs bf16 {bf16_b[r]:.1f}; eager {eager:.1f} (host {eager_host:.1f}) "
                      f"vs unplanned {full:.1f} (host {full_host:.1f}), bf16 {bf16_e[r][0]:.1f})"
                      + "".join(f", {o} {row[o + '_us']:.1f}" for o in others), flush=True)
            del codes
            torch.cuda.empty_cache()

    write_json(args.out, results)
    print("\n| layer | K | rows | path | exl3rt µs | bf16 µs | exl3rt/bf16 | batched exl3rt µs | batched bf16 µs "
          "| batched ratio | eager µs (host) | unplanned eager µs (host) | bf16 eager µs | other paths µs "
          "| exllamav3 1.6.5 µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        anc = f"{r['exllamav3_us']:.1f}" if r["exllamav3_us"] else ""
        extra = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in r.items() if k.endswith("_us") and k not in
                          ("bf16_us", "exllamav3_us", "batched_us", "bf16_batched_us") and "eager" not in k)
        print(f"| {r['in']}×{r['out']} | {r['K']} | {r['rows']} | {r['path']} | {r['us']:.1f} | {r['bf16_us']:.1f} | "
              f"{r['us'] / r['bf16_us']:.2f} | {r['batched_us']:.1f} | {r['bf16_batched_us']:.1f} | "
              f"{r['batched_us'] / r['bf16_batched_us']:.2f} | {r['eager_us']:.1f} ({r['eager_host_us']:.1f}) | "
              f"{r['unplanned_eager_us']:.1f} ({r['unplanned_eager_host_us']:.1f}) | {r['bf16_eager_us']:.1f} | "
              f"{extra} | {anc} |")
    print("\nThe mma GEMV alone (no Hadamard passes), rows 1 and 16:")
    for g in results["kernels"]:
        print(f"  {g['in']}x{g['out']} K={g['K']}: 1 row {g['mma1_us']:.1f} us ({g['mma1_tweights_per_s']:.2f} T weights/s, "
              f"{g['mma1_trellis_GBps']:.0f} GB/s); 16 rows {g['mma16_us']:.1f} us "
              f"({g['mma16_tweights_per_s']:.2f} T weights/s); batched: mma 1 row {g['mma1_batched_us']:.1f} us "
              f"({g['mma1_batched_tweights_per_s']:.2f} T weights/s), 16 rows {g['mma16_batched_us']:.1f} us")
    bad = [c for c in results["checks"] if not c["ok"]]
    print("checks:", "ALL OK" if not bad else f"{len(bad)} FAILED")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
