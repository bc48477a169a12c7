"""Mixed-bitrate EXL3 MoE layer on the GPU (issue 6): exl3rt.kernels.moe.exl3_moe.

    python benchmarks/bench_moe.py [--hidden 6144] [--inter 2048] [--experts 256] [--topk 8]
                                   [--tiers 3:192 4:64] [--rows 1 8 32 128] [--unfused] [--profile]
                                   [--out benchmarks/results/moe_cuda.json]

Random EXL3 codes (MCG) for every expert, tiers assigned to a random permutation of the experts,
random routing (top-k distinct experts per token, softmax weights). Per row count: the mixed layer
(fused passes: pre, gate+up, mid, down, post launches after route packing; ``--unfused``: the torch
glue around one tiered launch per projection), the same tiers run one after the other (one launch per tier
and projection), and an all-K4 layer of the same shape, each the median of
``--iters`` CUDA-graph replays (one graph per routing input, rotated) timed with CUDA events. Before timing, the mixed
layer is checked at 2 rows against dense float32 weights from ``format.reconstruct`` for the routed experts, with route
blocks of 8, 16, 32 and 64 (every tiered-launch layout: swapped 8-row fragments, row-major 16-row passes, 2 and 4 row
blocks per decoded tile in fragment order). bf16 anchors are issue 6's (``torch._grouped_mm``,
H200, 2026-11-30). ``--profile``: the mixed layer's device time per kernel (torch profiler over eager calls) as well.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit, write_json  # noqa: E402
from exl3rt.format.bits import words16_per_tile  # noqa: E402
from exl3rt.format.reconstruct import reconstruct  # noqa: E402
from exl3rt.kernels.moe import MoEWeights, exl3_moe  # noqa: E402
from exl3rt.moe.plan import LayerGeometry, auto_prefill_block_m, query_device_facts  # noqa: E402
from exl3rt.moe.tiers import tiers_from_bitrates  # noqa: E402

BF16_ANCHORS = {2048: {1: 278, 8: 1519, 32: 4106, 128: 6043, 512: 6313, 2048: 7327},
                512: {1: 195, 8: 442, 32: 1106, 128: 1647, 512: 1891, 2048: 2809}}


def build(h, i, bits_per_expert, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    layout = tiers_from_bitrates(bits_per_expert, layer="bench")
    e = len(bits_per_expert)

    def stack(n, a, b, k):
        return torch.randint(-32768, 32768, (n, a // 16, b // 16, words16_per_tile(k)), dtype=torch.int16,
                             device=dev, generator=g)

    def scales(n):
        return (torch.rand(e, n, device=dev, generator=g) + 0.5) * 0.05

    return MoEWeights(up=[stack(t.count, h, i, t.bits) for t in layout.tiers],
                      gate=[stack(t.count, h, i, t.bits) for t in layout.tiers],
                      down=[stack(t.count, i, h, t.bits) for t in layout.tiers],
                      up_suh=scales(h), up_svh=scales(i), gate_suh=scales(h), gate_svh=scales(i),
                      down_suh=scales(i), down_svh=scales(h),
                      descriptors=layout.descriptor_tensor(dev).to(torch.int32), shift=layout.descriptor_shift,
                      expert_map=layout.global_to_combined_tensor(dev), codebook="mcg"), layout


def split_tiers(w: MoEWeights, layout) -> list[MoEWeights]:
    """One single-tier layer per tier (routes to other tiers' experts map to -1 and are dropped):
    running them one after the other is the two-launches-per-projection baseline."""
    out = []
    for t, tier in enumerate(layout.tiers):
        g2c = torch.full_like(w.expert_map, -1)
        ids = torch.tensor(tier.expert_ids, device=w.expert_map.device)
        g2c[ids] = torch.arange(tier.count, device=ids.device, dtype=g2c.dtype)
        comb = w.expert_map[ids]
        out.append(dataclasses.replace(
            w, up=[w.up[t]], gate=[w.gate[t]], down=[w.down[t]], up_suh=w.up_suh[comb], up_svh=w.up_svh[comb],
            gate_suh=w.gate_suh[comb], gate_svh=w.gate_svh[comb], down_suh=w.down_suh[comb],
            down_svh=w.down_svh[comb], descriptors=torch.arange(tier.count, dtype=torch.int32, device=ids.device),
            shift=layout.descriptor_shift, expert_map=g2c))
    return out


def routing(rows, e, k, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.rand(rows, e, device=dev, generator=g).argsort(dim=1)[:, :k]
    w = torch.softmax(torch.randn(rows, k, device=dev, generator=g), dim=1)
    return ids, w


CHECK_BLOCKS = (8, 16, 32, 64, 128)   # the decode plan's block, and the prefill blocks (64/128: wgmma on Hopper)


def check(w, layout, h, dev, fused=True, block_m=16):
    x = torch.randn(2, h, device=dev, dtype=torch.bfloat16)
    ids, wts = routing(2, layout.num_experts, 2, dev, seed=5)
    y = exl3_moe(x, ids, wts, w, fused=fused, block_m=block_m).float()
    ref = torch.zeros(2, h, device=dev)
    c_of = layout.global_to_combined
    for t in range(2):
        for s in range(2):
            c = c_of[int(ids[t, s])]
            tier, local = layout.locate(c)

            def dense(stacks, suh, svh):
                return reconstruct(stacks[tier][local], suh[c].half(), svh[c].half(), "mcg", dtype=torch.float32)
            xx = x[t].float()
            gate = xx @ dense(w.gate, w.gate_suh, w.gate_svh)
            up = xx @ dense(w.up, w.up_suh, w.up_svh)
            ref[t] += wts[t, s] * ((F.silu(gate) * up) @ dense(w.down, w.down_suh, w.down_svh))
    return float((y - ref).norm() / ref.norm())


class Bf16MoE:
    """The bf16 baseline: ``torch._grouped_mm`` over the routed tokens (routes sorted by expert, per-expert
    offsets), gate/up, silu, down, weighted sum — dense bf16 weights [E, H, I] / [E, I, H]."""

    def __init__(self, e, h, i, dev, seed=3):
        g = torch.Generator(device=dev).manual_seed(seed)
        self.gate = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        self.up = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        self.down = torch.randn(e, i, h, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        self.e = e

    def __call__(self, x, ids, wts):
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat)
        tok = order // k
        # per-expert counts by scatter_add (torch.bincount reads its size on the host: not graph-capturable)
        counts = torch.zeros(self.e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x[tok]
        gu = F.silu(torch._grouped_mm(xs, self.gate, offs=offs)) * torch._grouped_mm(xs, self.up, offs=offs)
        yd = torch._grouped_mm(gu, self.down, offs=offs) * wts.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tok, yd)


def plan_block_m(rows: int, experts: int, topk: int, block_m: int = 0) -> int:
    """The route block the runtime's plans use (``block_m`` > 0: that one instead): the decode plan's 8 up to
    32 rows; above, the automatic prefill block for an arena of ``rows`` on this GPU (16 to 128,
    :func:`exl3rt.moe.plan.auto_prefill_block_m`)."""
    if block_m > 0:
        return block_m
    if rows <= 32:
        return 8
    geo = LayerGeometry(hidden=0, intermediate=0, num_experts=experts, top_k=topk, tier_signature=())
    return auto_prefill_block_m(geo, query_device_facts(torch.device("cuda")), rows)


def time_calls(fn, inputs, iters):
    """Median µs per call: each input's call captured in a CUDA graph and replayed in rotation
    (falls back to eager calls, reported as such, if capture fails)."""
    for a in inputs[:2]:
        fn(*a)
    torch.cuda.synchronize()
    try:
        graphs = []
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for a in inputs:
                fn(*a)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for a in inputs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(*a)
            graphs.append(g)
        run, mode = (lambda n: graphs[n % len(graphs)].replay()), "graph"
    except Exception as exc:  # noqa: BLE001 - report and time eagerly
        print(f"CUDA graph capture failed ({type(exc).__name__}: {str(exc)[:120]}); timing eager calls")
        run, mode = (lambda n: fn(*inputs[n % len(inputs)])), "eager"
    torch.cuda.synchronize()
    ts = []
    for n in range(iters):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        run(n)
        en.record()
        torch.cuda.synchronize()
        ts.append(st.elapsed_time(en) * 1000.0)
    return statistics.median(ts), mode


def kernel_times(fn, args, calls: int = 10) -> dict[str, float]:
    """Device µs per call of each kernel ``fn(*args)`` launches (torch profiler over ``calls`` eager calls), by name."""
    from collections import defaultdict
    fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name] += ev.device_time / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tiers", nargs="+", default=["3:192", "4:64"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--block-m", type=int, default=0,
                    help="route block for every row count (default: the runtime's plans, 8 up to 32 rows, "
                         "16-128 above)")
    ap.add_argument("--unfused", action="store_true", help="the torch glue instead of the fused passes")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 grouped_mm baseline (needs 6·E·H·I bytes)")
    ap.add_argument("--profile", action="store_true",
                    help="also the mixed layer's device time per kernel (torch profiler, eager calls) per row count")
    ap.add_argument("--out", default="benchmarks/results/moe_cuda.json")
    args = ap.parse_args(argv)
    dev = "cuda"
    bits = []
    for spec in args.tiers:
        k, n = spec.split(":")
        bits += [float(k) if "." in k else int(k)] * int(n)
    if len(bits) != args.experts:
        raise SystemExit(f"--tiers cover {len(bits)} experts, --experts is {args.experts}")
    perm = torch.randperm(args.experts, generator=torch.Generator().manual_seed(0)).tolist()
    bits = [bits[p] for p in perm]
    h, i = args.hidden, args.inter
    mixed, layout = build(h, i, bits, dev)
    res = {"commit": commit(), "device": torch.cuda.get_device_name(0), "hidden": h, "inter": i,
           "experts": args.experts, "topk": args.topk, "tiers": args.tiers, "fused": not args.unfused, "rows": []}
    fused = not args.unfused
    res["check_rel_by_block"] = {bm: check(mixed, layout, h, dev, fused, bm) for bm in CHECK_BLOCKS}
    res["check_rel"] = max(res["check_rel_by_block"].values())
    print("check (2 rows vs float32 reconstruct, per route block): "
          + ", ".join(f"{bm}: {e:.2e}" for bm, e in res["check_rel_by_block"].items()), flush=True)
    k4, _ = build(h, i, [4] * args.experts, dev, seed=1)
    serial = split_tiers(mixed, layout)
    bf = None if args.no_bf16 else Bf16MoE(args.experts, h, i, dev)
    for r in args.rows:
        inputs = [(torch.randn(r, h, device=dev, dtype=torch.bfloat16),) + routing(r, args.experts, args.topk, dev, s)
                  for s in range(4)]
        bm = plan_block_m(r, args.experts, args.topk, args.block_m)
        us_mixed, mode = time_calls(lambda x, ids, w: exl3_moe(x, ids, w, mixed, fused=fused, block_m=bm), inputs,
                                    args.iters)
        us_k4, _ = time_calls(lambda x, ids, w: exl3_moe(x, ids, w, k4, fused=fused, block_m=bm), inputs, args.iters)
        us_serial, _ = time_calls(lambda x, ids, w: [exl3_moe(x, ids, w, t, fused=fused, block_m=bm) for t in serial],
                                  inputs, args.iters)
        us_bf16 = time_calls(lambda x, ids, w: bf(x, ids, w), inputs, args.iters)[0] if bf is not None else None
        anchor = BF16_ANCHORS.get(i, {}).get(r)
        res["rows"].append({"rows": r, "block_m": bm, "mixed_us": us_mixed, "k4_us": us_k4,
                            "serial_tiers_us": us_serial, "bf16_us": us_bf16, "bf16_anchor_us": anchor,
                            "timing": mode})
        if args.profile:
            kt = kernel_times(lambda x, ids, w: exl3_moe(x, ids, w, mixed, fused=fused, block_m=bm), inputs[0])
            res["rows"][-1]["kernel_us"] = kt
            print(f"rows={r} mixed, device µs per kernel (Σ {sum(kt.values()):.1f}): "
                  + ", ".join(f"{k.split('(')[0][:32]} {v:.1f}" for k, v in kt.items()), flush=True)
        print(f"rows={r} (block_m {bm}): mixed {us_mixed:.1f} us, serial tiers {us_serial:.1f}, all-K4 {us_k4:.1f}, "
              f"bf16 grouped_mm {us_bf16 if us_bf16 is None else round(us_bf16, 1)} (issue anchor {anchor})",
              flush=True)
    write_json(args.out, res)
    print(f"\n| rows | mixed {'/'.join(args.tiers)} µs | tiers one after the other µs | serial/mixed | all-K4 µs | "
          f"mixed/K4 | bf16 grouped_mm µs (same run) | mixed/bf16 | bf16 (issue 6 anchor) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in res["rows"]:
        a, b, m = row["bf16_anchor_us"], row["bf16_us"], row["mixed_us"]
        bcol = "| | |" if b is None else f"| {b:.0f} | {m / b:.2f} |"
        print(f"| {row['rows']} | {m:.0f} | {row['serial_tiers_us']:.0f} | "
              f"{row['serial_tiers_us'] / m:.2f} | {row['k4_us']:.0f} | "
              f"{m / row['k4_us']:.2f} {bcol} {a if a else ''} |")
    return 0 if res["check_rel"] < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
