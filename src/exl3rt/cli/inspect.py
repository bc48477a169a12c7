"""``exl3rt inspect PATH``: what an EXL3 checkpoint holds and what loading it will build."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from ..format.checkpoint import Exl3Checkpoint, LinearInfo
from ..format.validate import validate_checkpoint
from ..util.units import fmt_bytes
from ._args import UsageError

HELP = "show what an EXL3 checkpoint holds and what loading it builds (directory or .safetensors file)"

_EXPERT = re.compile(r"^(?P<pre>.+\.experts)\.(?P<e>\d+)\.(?P<post>[^.]+)$")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help=HELP, description=HELP + ".\n\n"
                       "Reads only the safetensors headers (fast on any model size). For a model directory it\n"
                       "also builds the model on the meta device as `from_pretrained` would (no weight is read)\n"
                       "and prints what loads: the architecture, the Exl3Linear and expert modules, whether the\n"
                       "head is quantized, the tensors that stay unquantized, and how to run it. The same checks\n"
                       "as loading run here (dtypes, shapes, duplicates, config.json against the tensors): a\n"
                       "tensor missing, cut off, mislabelled or unknown is one error line naming it; --validate\n"
                       "adds the values (NaN/inf), as every loader does.\n\n"
                       "K (bits per weight) of each layer comes from its trellis shape; 'bpw' is the\n"
                       "weight-averaged K over all quantized linears, 'bpw+scales' also counts suh/svh/bias/marker\n"
                       "bytes. A layer's experts that share shape, K and codebook are one row (--all: one each).\n\n"
                       "Exit status 1 (one error line) when PATH holds no EXL3 tensors, e.g. an unquantized model.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="EXL3 model directory or one .safetensors file")
    p.add_argument("--json", action="store_true", help="print JSON (layers, totals, load plan) instead of a table")
    p.add_argument("--all", action="store_true", help="one row per expert instead of one per layer's experts")
    p.add_argument("--validate", action="store_true",
                   help="also read the values: every layer loaded and checked, no NaN/inf in any stored tensor, "
                        "markers; a directory must be a complete checkpoint (config.json)")
    p.set_defaults(run=run)


def _rows(linears: list[LinearInfo], each: bool) -> list[tuple[str, LinearInfo, int, int]]:
    """(label, first linear, count, bytes): a layer's experts with equal shape, K and codebook merged."""
    rows: list[tuple[str, LinearInfo, int, int]] = []
    groups: dict[tuple, int] = {}
    for li in linears:
        m = None if each else _EXPERT.match(li.name)
        if m is None:
            rows.append((li.name, li, 1, li.nbytes))
            continue
        key = (m["pre"], m["post"], li.in_padded, li.out_padded, li.bits, li.codebook)
        if key in groups:
            label, first, n, nbytes = rows[groups[key]]
            rows[groups[key]] = (label, first, n + 1, nbytes + li.nbytes)
        else:
            groups[key] = len(rows)
            rows.append((f"{m['pre']}.*.{m['post']}", li, 1, li.nbytes))
    return [(f"{label} ({n} experts)" if n > 1 else label, li, n, b) for label, li, n, b in rows]


def _plan(path: Path) -> dict[str, Any]:
    """The load plan, or ``{"error": line}`` when transformers cannot build a model from this config.json (a
    checkpoint made for another engine); a damaged checkpoint raises FormatError as loading would."""
    from ..format.errors import FormatError

    try:
        import transformers  # noqa: F401
    except ImportError:     # the base install: the codes are listed, the transformers plan needs exl3rt[hf]
        return {"error": "transformers is not installed", "unchecked": True}
    from ..integrations.transformers import plan_checkpoint_load

    try:
        return plan_checkpoint_load(path)
    except FormatError:
        raise
    except (ValueError, KeyError, ImportError, AttributeError, TypeError, OSError) as exc:
        return {"error": " ".join(str(exc).split())[:300] or type(exc).__name__}


def _describe_plan(plan: dict[str, Any], ckpt: Exl3Checkpoint, path: Path) -> list[str]:
    if plan.get("unchecked"):
        return ["loads as     not checked: transformers is not installed (pip install 'exl3rt[hf]')"]
    if "error" in plan:
        return [f"loads as     not in transformers: {plan['error']}"]
    n_exp = sum(plan["experts"].values())
    in_experts = sum(1 for n in plan["linears"] if _EXPERT.match(n))
    parts = [f"{len(plan['linears']) - in_experts} Exl3Linear"]
    if plan["experts"]:
        per = sorted(set(plan["experts"].values()))
        parts.append(f"{len(plan['experts'])} Exl3Experts layers ({'/'.join(map(str, per))} experts each, "
                     f"{in_experts} linears in {n_exp} experts)")
    parts.append("lm_head EXL3 K%g" % plan["head"] if plan["head"] is not None else "lm_head unquantized")
    other = {n: ckpt.tensor_info(n) for n in plan["other"]}
    big = sorted(other, key=lambda n: -other[n].numel)[:2]
    rest = len(other) - len(big)
    qc = ckpt.quantization_config or {}
    # exl3rt names itself in "quantizer"; exllamav3 writes only its version
    who = " ".join(str(x) for x in (qc.get("quantizer", "exllamav3"), qc.get("version", "")) if x)
    files = sorted({ckpt.tensor_info(n).file for n in ckpt.tensor_names()})
    lines = [
        f"checkpoint   {path} ({len(files)} file{'s' if len(files) > 1 else ''}; quantization_config by {who})",
        f"loads as     {plan['architecture']}, {plan['layers']} layers: " + ", ".join(parts),
        "unquantized  " + "; ".join(f"{n} {other[n].dtype} {list(other[n].shape)}" for n in big)
        + (f"; {rest} more ({fmt_bytes(sum(other[n].nbytes for n in other if n not in big))})" if rest > 0 else ""),
    ]
    if plan["dense"] and plan["dense"] != ["lm_head"]:
        lines.append(f"dense        {len(plan['dense'])} linear(s) stay nn.Linear: {', '.join(plan['dense'][:4])}"
                     + (" ..." if len(plan["dense"]) > 4 else ""))
    lines.append(f"run it       exl3rt generate --model {path}     (exl3rt eval --model: its perplexity)")
    lines.append("             AutoModelForCausalLM.from_pretrained(path) after `import exl3rt.integrations.transformers`")
    lines.append(f"             vllm serve {path}     (with exl3rt installed: its vLLM plugin)")
    return lines


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    # the loaders' own checks (format/validate.py); --validate adds the values and needs a complete checkpoint
    ckpt = validate_checkpoint(path, data=False, require_config=args.validate)
    linears = ckpt.linears()
    if not linears:     # before --validate reads the values: an unquantized model may be large
        src = path if path.is_dir() else "MODEL_DIR"
        raise UsageError(f"{path}: no EXL3 tensors, so not an EXL3 checkpoint (an unquantized model?): convert "
                         f"{'it' if path.is_dir() else 'its model folder'} with `exl3rt quantize {src} OUT`, or run "
                         f"it quantized as it loads with `exl3rt generate --model {src}`")
    if args.validate:
        validate_checkpoint(ckpt, data=True)
        for li in linears:
            ckpt.load_linear(li.name)  # raises FormatError naming the tensor
    incomplete = path.is_dir() and ckpt.config is None
    note = (f"{path}: no config.json, so not a complete checkpoint (an interrupted save or quantize leaves none; "
            f"rerun it); its tensors are listed, nothing can load it") if incomplete else None
    plan = _plan(path) if path.is_dir() and not incomplete else None
    summary = ckpt.summary()
    if args.json:
        rows = [{"name": li.name, "in": li.in_padded, "out": li.out_padded, "bits": li.bits,
                 "codebook": li.codebook, "bytes": li.nbytes, "bias": li.has_bias} for li in linears]
        out: dict[str, Any] = {"layers": rows, "totals": summary}
        if note:
            out["note"] = note
        if plan is not None and "error" not in plan:
            out["loads"] = {**plan, "other": {n: {"dtype": d, "shape": list(s)} for n, (d, s) in plan["other"].items()}}
        elif plan is not None:
            out["loads"] = plan
        print(json.dumps(out, indent=2))
        return 0
    if note:
        print(f"note         {note}")
    if plan is not None:
        print("\n".join(_describe_plan(plan, ckpt, path)))
        print()
    rows = _rows(linears, args.all)
    width = max(len("layer"), *(len(r[0]) for r in rows))
    print(f"{'layer':<{width}}  {'shape (in x out)':>16}  {'bits':>4}  {'codebook':>8}  {'bytes':>11}")
    for label, li, _, nbytes in rows:
        shape = f"{li.in_padded} x {li.out_padded}"
        print(f"{label:<{width}}  {shape:>16}  {li.bits!s:>4}  {li.codebook:>8}  {fmt_bytes(nbytes):>11}")
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
