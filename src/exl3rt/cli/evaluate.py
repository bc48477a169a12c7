"""``exl3rt eval``: perplexity of the unquantized model and of each EXL3 bitrate, as one table."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ._args import UNQUANTIZED, UsageError, bits_type, check_device, int_at_least, readable_file
from ._load import (add_model_args, check_bits, describe_load, is_exl3_checkpoint, load, low_bits_note, model_dir,
                    model_path, parameter_count)

HELP = "perplexity on a bundled text: the unquantized model and each EXL3 bitrate side by side"

DESCRIPTION = HELP + """.

Every bitrate is loaded the way `exl3rt generate` loads it (online encoding through the encoding
cache), scored on the same tokens in non-overlapping windows of --ctx tokens, and compared with the
unquantized model loaded from the same directory. An EXL3 checkpoint as --model is scored as stored
(--bits does not apply), beside the unquantized model in --source if given. The bundled text is ~1500 words of plain
English prose (exl3rt/data/eval_text.txt); pass --text FILE for your own. At K <= 3 on a model under 1 B
parameters it notes that calibration (exl3rt quantize --calibrate) or more bits give better results.

examples:
  exl3rt eval --bits 2 3 4 6                       # SmolLM2-135M-Instruct
  exl3rt eval --model ./Llama-3.2-1B --bits 3 4 --device cuda --json
  exl3rt eval --model ./Llama-3.2-1B-exl3 --source ./Llama-3.2-1B   # a checkpoint beside its source
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=bits_type(unquantized=True), nargs="+", default=[2, 3, 4, 6],
                   help="bitrates to score: 1..8, 1.5/2.5/3.5 with --codebook mul1; 16 = the unquantized model "
                        "(default 2 3 4 6)")
    p.add_argument("--text", metavar="FILE", type=readable_file, help="text file to score (default: the bundled text)")
    p.add_argument("--ctx", type=int_at_least(2), default=512, help="window length in tokens (default 512)")
    p.add_argument("--max-tokens", type=int_at_least(2), help="score only the first N tokens")
    p.add_argument("--no-baseline", action="store_true", help="skip the unquantized model")
    p.add_argument("--source", metavar="PATH",
                   help="with an EXL3 checkpoint as --model: the unquantized model to score beside it")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    add_model_args(p)
    p.set_defaults(run=run)


def _read_text(path: str) -> str:
    """The --text file as UTF-8; empty, whitespace-only or undecodable text is one error line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise UsageError(f"--text {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise UsageError(f"--text {path}: the file holds no text to score")
    return text


def run(args: argparse.Namespace) -> int:
    from ..evaluation import perplexity

    quantized = [b for b in dict.fromkeys(args.bits) if b != UNQUANTIZED]
    check_bits(quantized, args.codebook)
    check_device(args.device)
    text = None
    if args.text:
        text = _read_text(args.text)
    path, name = model_path(args)
    stored = is_exl3_checkpoint(path)
    if args.source and not stored:
        raise UsageError("--source names the unquantized model of an EXL3 checkpoint given as --model; "
                         f"{path} is not one (use --bits to score online bitrates beside it)")
    runs: list[Any]
    if stored:        # the checkpoint as stored, after its source if given
        runs = ([(None, model_dir(args.source, "--source", exl3=False))] if args.source else []) + [("stored", path)]
    else:
        baseline = not args.no_baseline or UNQUANTIZED in args.bits
        runs = ([(None, path)] if baseline else []) + [(b, path) for b in quantized]
    rows: list[dict[str, Any]] = []
    base_ppl = None
    for bits, where in runs:
        label = "unquantized" if bits is None else "the EXL3 checkpoint" if bits == "stored" else f"K={bits:g}"
        if not args.json:
            print(f"exl3rt: {name}: loading {label} ...", flush=True)
        ld = load(args, where, None if bits == "stored" else bits)
        if not args.json:
            print(f"exl3rt: {describe_load(ld)}", flush=True)
        try:
            r = perplexity(ld.model, ld.tokenizer, text, ctx=args.ctx, max_tokens=args.max_tokens)
        except ValueError as exc:          # e.g. a text of fewer than 2 tokens
            raise UsageError(f"{f'--text {args.text}' if args.text else 'the bundled text'}: {exc}") from None
        if bits is None:
            base_ppl = r.ppl
        if ld.stored:
            bits = round(ld.summary.get("bpw", 0.0), 2)
        rows.append({"model": name, "bits": bits, "stored": ld.stored,
                     "codebook": None if bits is None else
                     "/".join(sorted(ld.summary.get("codebooks", {}))) if ld.stored else args.codebook,
                     "bpw": ld.summary.get("bpw_with_scales" if ld.stored else "bpw"), "ppl": r.ppl, "tokens": r.tokens,
                     "delta_pct": None if base_ppl is None or bits is None else 100.0 * (r.ppl / base_ppl - 1.0),
                     "load_seconds": ld.seconds, "hits": ld.summary.get("hits"), "misses": ld.summary.get("misses")})
        del ld
    online = [r["bits"] for r in rows if r["bits"] is not None and not r["stored"]]
    note = low_bits_note(min(online), parameter_count(path), path, args.codebook) if online else None
    if args.json:
        print(json.dumps({"model": name, "ctx": args.ctx, "rows": rows}, indent=2))
        if note:        # stdout stays JSON
            print(f"exl3rt: {note}", file=sys.stderr)
        return 0
    print(f"\nperplexity on {'the bundled text' if text is None else args.text} "
          f"({rows[0]['tokens']} tokens, windows of {args.ctx}), {name}")
    print(f"{'weights':<18} {'bpw':>6} {'ppl':>10} {'vs unq.':>9} {'load s':>8} {'hits/misses':>12}")
    for r in rows:
        w = ("unquantized" if r["bits"] is None else f"checkpoint {r['codebook']}" if r["stored"] else
             f"EXL3 K={r['bits']:g} {r['codebook']}")
        bpw = "" if r["bpw"] is None else f"{r['bpw']:.2f}"
        d = "" if r["delta_pct"] is None else f"{r['delta_pct']:+.1f}%"
        hm = "" if r["bits"] is None or r["stored"] else f"{r['hits']}/{r['misses']}"
        ppl = f"{r['ppl']:.3f}" if math.isfinite(r["ppl"]) else "inf"
        # a space between columns whatever the widths (a random model's perplexity can take 11 digits)
        print(f"{w:<18} {bpw:>6} {ppl:>10} {d:>9} {r['load_seconds']:>8.1f} {hm:>12}")
    if note:
        print(f"\nexl3rt: {note}")
    return 0
