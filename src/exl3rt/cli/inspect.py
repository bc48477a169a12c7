"""``exl3rt inspect PATH``: the quantized layers of an EXL3 checkpoint and their totals."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..format.checkpoint import Exl3Checkpoint
from ..util.units import fmt_bytes

HELP = "list the quantized layers of an EXL3 checkpoint (directory or .safetensors file)"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help=HELP, description=HELP + ".\n\n"
                       "Reads only the safetensors headers (fast on any model size). K (bits per weight) of each\n"
                       "layer comes from its trellis shape; 'bpw' is the weight-averaged K over all quantized\n"
                       "linears, 'bpw+scales' also counts suh/svh/bias/marker bytes.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="EXL3 model directory or one .safetensors file")
    p.add_argument("--json", action="store_true", help="print JSON (layers and totals) instead of a table")
    p.add_argument("--validate", action="store_true",
                   help="also load every layer and check dtypes, shapes, markers and finiteness")
    p.set_defaults(run=run)




def run(args: argparse.Namespace) -> int:
    ckpt = Exl3Checkpoint(args.path)
    linears = ckpt.linears()
    if args.validate:
        for li in linears:
            ckpt.load_linear(li.name)  # raises FormatError naming the tensor
    summary = ckpt.summary()
    if args.json:
        rows = [{"name": li.name, "in": li.in_padded, "out": li.out_padded, "bits": li.bits,
                 "codebook": li.codebook, "bytes": li.nbytes, "bias": li.has_bias} for li in linears]
        print(json.dumps({"layers": rows, "totals": summary}, indent=2))
        return 0
    if not linears:
        print(f"{args.path}: no EXL3-quantized linears found")
        return 0
    width = max(len("layer"), *(len(li.name) for li in linears))
    print(f"{'layer':<{width}}  {'shape (in x out)':>16}  {'bits':>4}  {'codebook':>8}  {'bytes':>11}")
    for li in linears:
        shape = f"{li.in_padded} x {li.out_padded}"
        print(f"{li.name:<{width}}  {shape:>16}  {li.bits!s:>4}  {li.codebook:>8}  {fmt_bytes(li.nbytes):>11}")
    cbs = ", ".join(f"{k}: {v}" for k, v in sorted(summary["codebooks"].items()))
    print()
    print(f"linears      {summary['linears']} ({cbs})")
    print(f"weights      {summary['weights']:,}")
    print(f"bpw          {summary['bpw']:.4f}  (weight-averaged K)")
    print(f"bpw+scales   {summary['bpw_with_scales']:.4f}")
    print(f"size         {fmt_bytes(summary['linear_bytes'])} quantized + "
          f"{fmt_bytes(summary['other_bytes'])} other = {fmt_bytes(summary['total_bytes'])}")
    if summary["config_bits"] is not None:
        print(f"config bits  {summary['config_bits']}  (config.json, informational; excludes the head)")
    if args.validate:
        print("validated    every layer loaded and checked")
    return 0
