"""Launch-configuration sweep of the mixed-bitrate MoE layer (GPU): the fused passes' launch shapes, the
tiered launches' split-K target, and the prefill route block with its x' layout.

    python benchmarks/tune_moe.py [--inter 2048] [--rows 1 8 32] [--sweep passes]
    python benchmarks/tune_moe.py --sweep blocks --rows 128 512 2048
    python benchmarks/tune_moe.py --sweep padding --rows 128 512 2048

``--sweep passes`` (per row count, route block from the runtime's plans): one knob at a time, keeping a value
only when it is ≥ 1 % faster — fragment-order x', the mid-pass (slots per
program, warps, partials per load), the post-pass (partials per load, warps), the pre-pass (slots, warps),
``target_programs`` — starting from :func:`exl3rt.kernels.moe.default_glue`. ``--sweep blocks``: route
blocks (``--blocks``, default 16 / 32 / 64), each with row-major and fragment-order x' (row-major only where
the block takes the wgmma launch). ``--sweep padding``: the runtime's route block
with and without ``GlueLaunch.skip_padding`` (the outputs must be bit-identical; checked). Every point is the
median of graph-timed calls of the whole layer (``bench_moe.time_calls``: one CUDA graph per routing input, replayed in
rotation); layer and routing as ``bench_moe.py`` (hidden 6144, 256 experts, top-8, K3/K4 192/64, MCG).
Prints each sweep line and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import build, plan_block_m, routing, time_calls  # noqa: E402
from common import commit, write_json  # noqa: E402
from exl3rt.kernels import moe_wgmma as _mwg  # noqa: E402
from exl3rt.kernels.moe import default_glue, exl3_moe  # noqa: E402


def _glue(field_names):
    """A knob that sets GlueLaunch fields ``field_names`` from a tuple value."""
    def set_(cfg, v):
        vals = v if isinstance(v, tuple) else (v,)
        return dict(cfg, glue=dataclasses.replace(cfg["glue"], **dict(zip(field_names, vals))))
    return set_


KNOBS = [
    ("frag", [True, False], _glue(["frag"])),
    ("mid (rows, warps, splits/load)", [(1, 1, 16), (2, 1, 8), (4, 1, 8), (4, 4, 4), (8, 2, 4), (16, 4, 2)],
     _glue(["mid_rows", "mid_warps", "mid_splits"])),
    ("post (splits/load, warps)", [(8, 1), (8, 2), (4, 1), (4, 0), (1, 2), (1, 4)],
     _glue(["post_splits", "post_warps"])),
    ("pre (rows, warps)", [(4, 1), (2, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4)],
     _glue(["pre_rows", "pre_warps"])),
    ("target_programs", [None, 2112, 4224, 8448, 16896], lambda cfg, v: dict(cfg, tp=v)),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--sweep", choices=["passes", "blocks", "padding"], default="passes")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64],
                    help="route blocks of --sweep blocks (64/128 run the wgmma launch where it applies, row-major)")
    ap.add_argument("--out", default="benchmarks/results/tune_moe.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_moe.py times CUDA graphs: it needs a GPU")
    bits = [3] * 192 + [4] * 64
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0)).tolist()
    w, _ = build(6144, args.inter, [bits[p] for p in perm], "cuda")
    res = {"commit": commit(), "device": torch.cuda.get_device_name(0), "inter": args.inter, "sweep": args.sweep,
           "rows": []}
    for rows in args.rows:
        inputs = [(torch.randn(rows, 6144, device="cuda", dtype=torch.bfloat16),) + routing(rows, 256, 8, "cuda", s)
                  for s in range(3)]

        def timed(cfg, bm):
            return time_calls(lambda x, ids, wt: exl3_moe(x, ids, wt, w, block_m=bm, glue=cfg["glue"],
                                                          target_programs=cfg["tp"]), inputs, args.iters)[0]
        entry = {"rows": rows, "lines": []}
        if args.sweep == "blocks":
            for bm in args.blocks:
                for frag in ((False,) if _mwg.applies(torch.device("cuda"), bm) else (False, True)):
                    us = timed({"glue": dataclasses.replace(default_glue(bm), frag=frag), "tp": None}, bm)
                    entry["lines"].append({"block_m": bm, "frag": frag, "us": us})
                    print(f"rows {rows}: block {bm} {'fragments' if frag else 'row-major'} {us:.0f} us", flush=True)
        elif args.sweep == "padding":
            bm = plan_block_m(rows, 256, 8)
            glues = {skip: dataclasses.replace(default_glue(bm), skip_padding=skip) for skip in (True, False)}
            ys = [exl3_moe(*inputs[0], w, block_m=bm, glue=g) for g in glues.values()]
            if not torch.equal(*ys):
                raise SystemExit(f"rows {rows}: skipping padding slots changed the output")
            us = {skip: timed({"glue": g, "tp": None}, bm) for skip, g in glues.items()}
            entry["lines"].append({"block_m": bm, "skip_us": us[True], "all_slots_us": us[False]})
            print(f"rows {rows} (block {bm}): padding skipped {us[True]:.0f} us, every slot {us[False]:.0f} us "
                  f"({us[False] / us[True]:.3f}x), outputs identical", flush=True)
        else:
            bm = plan_block_m(rows, 256, 8)
            cur = {"glue": default_glue(bm), "tp": None}
            best = timed(cur, bm)
            entry["default_us"] = best
            print(f"rows {rows} (block {bm}): defaults {best:.1f} us", flush=True)
            for name, values, apply in KNOBS:
                times = {v: timed(apply(cur, v), bm) for v in values}
                pick = min(times, key=times.get)
                if times[pick] < 0.99 * best:
                    cur, best = apply(cur, pick), times[pick]
                entry["lines"].append({"knob": name, "us": {str(v): t for v, t in times.items()}, "pick": str(pick)})
                print(f"  {name}: " + "  ".join(f"{v}: {t:.1f}" for v, t in times.items()), flush=True)
            entry["best_us"], entry["best"] = best, {"glue": dataclasses.asdict(cur["glue"]), "tp": cur["tp"]}
            print(f"  best {best:.1f} us: {entry['best']}", flush=True)
        res["rows"].append(entry)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
