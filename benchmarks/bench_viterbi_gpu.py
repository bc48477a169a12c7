"""GPU (Triton) tail-biting Viterbi encoder: time and quality for one 4096 x 4096 layer.

Encodes --tiles (default 65536 = one 4096 x 4096 layer) tiles of Gaussian targets scaled to the
codebook RMS (1.2437) with ``exl3rt.encode.viterbi_triton.encode_tiles`` for each K (default
2, 3, 4, 6; mcg codebook). Prints a table (K, seconds for the tiles, weights/s, relative MSE
and its dB over the rate-distortion floor 2^(-2K)) and writes JSON (--out).

--check   also verifies that every result is a valid tail-biting ring whose values are the
          codebook values of its states, and compares --check-tiles tiles' squared error with
          the CPU numba backend (exl3rt.encode.viterbi_numba) when it can be imported.
--sweep   first times the launch variants of SWEEP on --sweep-tiles tiles (compiled in
          parallel processes), then runs the full layer with the fastest variant per K.

Times are wall-clock seconds around the whole ``encode_tiles`` call (after a warm-up call that
compiles), median of --repeats runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

import torch

CODEBOOK_RMS = 1.24371088

#: launch variants timed by --sweep: K -> [(name, encode_tiles launch options)]
#: (bp = uint8 backpointers, rc = recompute argmins from stored costs, f2 = two positions per
#: step, t = tiles per program, c = chunk, l32/l16 = fp32/fp16 codebook table, w = warps,
#: pps = programs per SM)
# (every variant sets all of these explicitly: unset options take the per-K defaults)
_RC = dict(recomp=True, fuse2=False, lut=False)
_BP = dict(recomp=False, fuse2=False, lut=False)
_F2 = dict(recomp=False, fuse2=True, lut=False)
SWEEP = {
    2: [("bp-t2-c1024", dict(_BP, tpp=2, chunk=1024)),
        ("bp-t2-c1024-pps2", dict(_BP, tpp=2, chunk=1024, progs_per_sm=2)),
        ("f2-t2-c1024", dict(_F2, tpp=2, chunk=1024)),
        ("f2-t2-c512", dict(_F2, tpp=2, chunk=512)),
        ("f2-t1-c1024", dict(_F2, tpp=1, chunk=1024)),
        ("f2-t2-c1024-pps2", dict(_F2, tpp=2, chunk=1024, progs_per_sm=2))],
    3: [("rc-t4-c1024", dict(_RC, tpp=4, chunk=1024)),
        ("rc-t4-c1024-l32", dict(_RC, tpp=4, chunk=1024, lut="fp32")),
        ("rc-t4-c1024-l16", dict(_RC, tpp=4, chunk=1024, lut="fp16")),
        ("f2-t2-c1024", dict(_F2, tpp=2, chunk=1024))],
    4: [("rc-t4-c1024-l32", dict(_RC, tpp=4, chunk=1024, lut="fp32")),
        ("rc-t4-c1024-l16", dict(_RC, tpp=4, chunk=1024, lut="fp16")),
        ("rc-t4-c512-l16", dict(_RC, tpp=4, chunk=512, lut="fp16"))],
    6: [("rc-t4-c1024-l32", dict(_RC, tpp=4, chunk=1024, lut="fp32")),
        ("rc-t4-c1024-l16", dict(_RC, tpp=4, chunk=1024, lut="fp16"))],
}
# (not in the sweep: fuse2 at K >= 4 unrolls 2^(2K) candidates per edge chunk and takes minutes
# to compile; rc-t4-c1024 with k_static at K = 6 takes ~2 min)


def log(*a) -> None:
    print(*a, flush=True)


def _precompile_job(job):
    """Worker process: compile one variant into Triton's on-disk cache."""
    K, codebook, kw = job
    t0 = time.perf_counter()
    try:
        from exl3rt.encode import viterbi_triton as vt
        k = vt.precompile(K, codebook, "cuda", **{k: v for k, v in kw.items() if k in vt.CONFIG_KEYS})
        k._init_handles()
        return dict(ok=True, regs=int(k.n_regs), spills=int(k.n_spills),
                    smem=int(k.metadata.shared), compile_s=time.perf_counter() - t0)
    except Exception as exc:  # report, don't die
        return dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])


def precompile_all(jobs, workers: int, timeout: float) -> list:
    """Compile the distinct jobs in parallel processes; a job still compiling after ``timeout``
    seconds is reported as failed (and its worker killed)."""
    if not jobs:
        return []
    key = lambda j: (j[0], j[1], json.dumps(j[2], sort_keys=True))  # noqa: E731
    distinct = list({key(j): j for j in jobs}.values())
    ctx = get_context("spawn")
    ex = ProcessPoolExecutor(max_workers=max(1, min(workers, len(distinct))), mp_context=ctx)
    futs = {key(j): ex.submit(_precompile_job, j) for j in distinct}
    done, _ = wait(list(futs.values()), timeout=timeout)
    res = {}
    for k, f in futs.items():
        res[k] = f.result() if f in done else dict(ok=False, error=f"compile > {timeout:.0f} s")
    for p in list(getattr(ex, "_processes", {}).values()):
        if p.is_alive():
            p.kill()
    ex.shutdown(wait=False, cancel_futures=True)
    return [res[key(j)] for j in jobs]


def make_targets(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn((T, 256), generator=g, device="cuda") * CODEBOOK_RMS


def timed_encode(targets, K, codebook, kw, repeats):
    from exl3rt.encode.viterbi_triton import encode_tiles
    times, out = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = encode_tiles(targets, K, codebook, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def quality(targets, values, K):
    err = (values.double() - targets.double()).pow(2).mean().item()
    rel = err / targets.double().pow(2).mean().item()
    return rel, 10 * math.log10(rel / 2.0 ** (-2 * K))


def check_result(targets, states, values, K, codebook, check_tiles):
    from exl3rt.format.bitstream import tail_biting_violations
    from exl3rt.format.codebooks import codebook_values
    res = {}
    bad = tail_biting_violations(states, K).any(dim=1)
    res["invalid_rings"] = int(bad.sum())
    table = codebook_values(codebook).to(states.device)
    res["values_match_states"] = bool(torch.equal(table[states.to(torch.int64) & 0xFFFF], values))
    n = min(check_tiles, targets.shape[0])
    try:
        from exl3rt.encode.viterbi_numba import encode_tiles as cpu_encode
    except Exception as exc:  # numba missing
        res["cpu_compare"] = f"skipped: {type(exc).__name__}: {exc}"
        return res
    t0 = time.perf_counter()
    tc = targets[:n].cpu()
    cs, cv = cpu_encode(tc, K, codebook)
    cs, cv = torch.as_tensor(cs), torch.as_tensor(cv)
    gv, gs = values[:n].cpu(), states[:n].cpu()
    c_gpu = (gv.double() - tc.double()).pow(2).sum(1)
    c_cpu = (cv.double() - tc.double()).pow(2).sum(1)
    rel = (c_gpu - c_cpu) / c_cpu
    res["cpu_compare"] = dict(
        tiles=n, seconds_cpu=time.perf_counter() - t0,
        same_states_frac=float((gs == cs.to(gs.dtype)).all(1).double().mean()),
        cost_rel_diff_max=float(rel.abs().max()), cost_rel_diff_mean=float(rel.mean()),
        gpu_better_frac=float((rel < -1e-12).double().mean()),
        cpu_better_frac=float((rel > 1e-12).double().mean()),
        cost_ratio_total=float(c_gpu.sum() / c_cpu.sum()))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", type=int, default=65536)
    ap.add_argument("--bits", default="2,3,4,6")
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--check-tiles", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-tiles", type=int, default=8192)
    ap.add_argument("--sweep-repeats", type=int, default=1)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--compile-timeout", type=float, default=60.0)
    ap.add_argument("--extra-bits", default="",
                    help="K values run afterwards with the default config only (1 timed run)")
    ap.add_argument("--config", default=None,
                    help="JSON {K: {encode_tiles overrides}} used instead of the defaults")
    ap.add_argument("--out", default="benchmarks/results/viterbi_gpu.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_viterbi_gpu needs a CUDA device")
    import triton
    from exl3rt.encode import viterbi_triton as vt

    bits = [int(b) for b in args.bits.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(
        benchmark="viterbi_gpu", date=dt.datetime.now().isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), tiles=args.tiles, codebook=args.codebook,
        target_rms=CODEBOOK_RMS, repeats=args.repeats, default_config=vt.DEFAULT_CONFIG,
        sweep={}, results=[])

    def save():
        out.write_text(json.dumps(report, indent=1, default=str))

    chosen = {K: {} for K in bits}
    if args.config:
        chosen.update({int(k): v for k, v in json.loads(args.config).items()})

    # ---- compile everything first (parallel processes fill Triton's on-disk cache) ----
    jobs, names = [], []
    for K in bits:
        for name, kw in (SWEEP.get(K, []) if args.sweep else []):
            jobs.append((K, args.codebook, kw))
            names.append((K, name))
        jobs.append((K, args.codebook, chosen[K]))
        names.append((K, "main"))
    t0 = time.perf_counter()
    extra = [int(b) for b in args.extra_bits.split(",") if b]
    for K in extra:
        jobs.append((K, args.codebook, {}))
        names.append((K, "main"))
    comp = precompile_all(jobs, args.workers, args.compile_timeout)
    report["precompile_s"] = time.perf_counter() - t0
    info = {n: c for n, c in zip(names, comp)}
    log(f"precompiled {len(jobs)} kernels in {report['precompile_s']:.1f} s")
    for (K, name), c in info.items():
        log(f"  K={K} {name:22s} {c}")

    # ---- sweep: fastest variant per K on a subset ----
    if args.sweep:
        sub = make_targets(args.sweep_tiles, args.seed + 1)
        for K in bits:
            rows = []
            for name, kw in SWEEP.get(K, []):
                c = info[(K, name)]
                row = dict(name=name, config=kw, compile=c)
                if c.get("ok"):
                    try:
                        timed_encode(sub[:1024], K, args.codebook, kw, 1)  # warm-up
                        sec, times, (st, vals) = timed_encode(sub, K, args.codebook, kw, args.sweep_repeats)
                        rel, db = quality(sub, vals, K)
                        bad = int(vt_bad(st, K))
                        row.update(seconds=sec, times=times, full_layer_est_s=sec * args.tiles / args.sweep_tiles,
                                   rel_mse=rel, db_over_floor=db, invalid_rings=bad)
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                        traceback.print_exc()
                rows.append(row)
                log(f"sweep K={K} {name:22s} " + (f"{row['seconds']:.4f} s  (~{row['full_layer_est_s']:.3f} s/layer) "
                    f"{row['db_over_floor']:.3f} dB  bad={row['invalid_rings']}  regs={c.get('regs')} "
                    f"spills={c.get('spills')}" if "seconds" in row else f"FAILED {row.get('error') or c.get('error')}"))
                report["sweep"].setdefault(str(K), []).append(row)
                save()
            ok = [r for r in rows if "seconds" in r and r["invalid_rings"] == 0]
            if ok and not args.config:
                best = min(ok, key=lambda r: r["seconds"])
                chosen[K] = best["config"]
                log(f"sweep K={K}: best {best['name']}")
        del sub

    # ---- the full layer ----
    targets = make_targets(args.tiles, args.seed)
    for K in bits + extra:
        kw = chosen.get(K, {})
        reps = args.repeats if K in bits else 1
        row = dict(K=K, config=kw)
        try:
            timed_encode(targets[:1024], K, args.codebook, kw, 1)  # warm-up / compile
            sec, times, (states, values) = timed_encode(targets, K, args.codebook, kw, reps)
            rel, db = quality(targets, values, K)
            row.update(seconds=sec, times=times, weights_per_s=args.tiles * 256 / sec,
                       rel_mse=rel, db_over_floor=db)
            if args.check:
                row["check"] = check_result(targets, states, values, K, args.codebook, args.check_tiles)
            del states, values
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
            traceback.print_exc()
        report["results"].append(row)
        log(f"K={K}: {row}")
        save()

    log(f"\n{args.tiles} tiles ({args.tiles * 256 / 2**20:.0f} Mi weights), codebook {args.codebook}, "
        f"{report['device']}")
    log(f"{'K':>2} {'seconds':>9} {'weights/s':>11} {'rel MSE':>10} {'dB>floor':>9}  config")
    for r in report["results"]:
        if "seconds" in r:
            log(f"{r['K']:>2} {r['seconds']:>9.3f} {r['weights_per_s']:>11.3e} {r['rel_mse']:>10.5f} "
                f"{r['db_over_floor']:>9.3f}  {r['config']}")
        else:
            log(f"{r['K']:>2}  FAILED: {r['error'][:200]}")
    save()
    log(f"wrote {out}")


def vt_bad(states, K) -> int:
    from exl3rt.format.bitstream import tail_biting_violations
    return int(tail_biting_violations(states, K).any(dim=1).sum())


if __name__ == "__main__":
    main()
