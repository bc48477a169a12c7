"""``exl3rt quantize SRC OUT``: convert a Hugging Face safetensors checkpoint to EXL3."""

from __future__ import annotations

import argparse
from typing import Any

from ..format.codebooks import CODEBOOKS
from ._args import bits_type, check_device, check_half_bits, check_output_dir, int_at_least, readable_file

HELP = "convert a Hugging Face safetensors checkpoint to an EXL3 checkpoint"

DESCRIPTION = HELP + """.

Every linear layer is encoded at --bits (the lm_head at --head-bits); embeddings, norms and MoE
routers are copied unquantized; MoE experts stored per expert become per-expert EXL3 linears.
The result loads in exllamav3 and in exl3rt.

Without --calibrate each layer is encoded on its own (fast, what online quantization does).
With --calibrate TEXT the model runs over the text once (needs transformers) and each layer
is encoded with LDLQ error feedback from its input Hessian, and its scales refitted.

A crash or Ctrl-C loses at most the layer in progress: rerun the same command to resume
(finished layers are kept in OUT/.exl3rt-work until the checkpoint is complete).

OUT must be new or empty (or hold the run to resume); --overwrite replaces an EXL3 checkpoint there
and leaves every other file alone. OUT may not be, contain or lie inside SRC or the encoding cache.

examples:
  exl3rt quantize ./SmolLM2-135M ./SmolLM2-135M-exl3-4.0 --bits 4
  exl3rt quantize ./model ./model-exl3 --bits 3 --bits-for '*.down_proj=4' --codebook mul1
  exl3rt quantize ./model ./model-exl3 --bits 4 --calibrate wiki.txt --calib-rows 64
  exl3rt quantize ./model ./model-exl3 --bits 4 --from-cache   # what an online load already encoded
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("quantize", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("out", help="output directory for the EXL3 checkpoint")
    p.add_argument("--bits", type=bits_type(unquantized=False), default=4,
                   help="bits per weight K: 1..8, or 1.5/2.5/3.5 with mul1 (default 4)")
    p.add_argument("--codebook", default="mcg", choices=CODEBOOKS, help="codebook (default mcg)")
    p.add_argument("--head-bits", type=bits_type(unquantized=True), default=6,
                   help="lm_head bits (as --bits); 16 keeps it unquantized (default 6)")
    p.add_argument("--bits-for", action="append", default=[], metavar="PATTERN=K",
                   help="per-module K by shell pattern on the module name, e.g. '*.down_proj=5' (repeatable)")
    p.add_argument("--keep", action="append", default=[], metavar="PATTERN",
                   help="keep matching modules unquantized, e.g. '*.layers.0.*' (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sign vectors (default 0)")
    p.add_argument("--calibrate", metavar="TEXT", type=readable_file,
                   help="text file for calibration (LDLQ + scale refit)")
    p.add_argument("--calib-rows", type=int_at_least(1), default=32, help="calibration sequences (default 32)")
    p.add_argument("--calib-tokens", type=int_at_least(2), default=512,
                   help="tokens per calibration sequence (default 512)")
    p.add_argument("--backend", default="auto", choices=("auto", "numba", "triton", "torch"),
                   help="Viterbi backend (default auto: triton on CUDA, numba on CPU)")
    p.add_argument("--device", default="cpu", help="device for the encoder, e.g. cuda (default cpu)")
    p.add_argument("--overwrite", action="store_true",
                   help="OUT may hold files: its EXL3 checkpoint files (and an unfinished conversion) are replaced; "
                        "files exl3rt did not write are kept, and refused if the checkpoint would replace them")
    p.add_argument("--cache-mode", choices=("readwrite", "readonly", "off", "rw", "read-only", "none"),
                   help="encoding cache: layers it holds are read, not encoded (default: EXL3RT_CACHE_MODE or "
                        "readwrite; the keys are those of online quantization)")
    p.add_argument("--cache-dir", metavar="DIR", help="encoding cache root (default: EXL3RT_CACHE_DIR or ~/.cache/exl3rt)")
    p.add_argument("--from-cache", action="store_true",
                   help="export a checkpoint from the encoding cache alone: encode nothing; every layer must be "
                        "cached already (by an earlier quantize or online load with the same bits, codebook and "
                        "seed), checked before OUT is written")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _bits(x: float) -> Any:
    return int(x) if float(x).is_integer() else x


def _cache(args: argparse.Namespace) -> Any:
    """The encoding cache of ``--cache-mode`` / ``--cache-dir`` (None when off)."""
    from ..cache import CacheMode, EncodingCache, parse_cache_mode

    mode = parse_cache_mode(args.cache_mode)
    if mode == CacheMode.OFF:
        return None
    if args.from_cache:         # an export reads; it never publishes
        mode = CacheMode.READONLY
    return EncodingCache(root=args.cache_dir, mode=mode)


def run(args: argparse.Namespace) -> int:
    from ..convert import convert_checkpoint
    from ..convert.plan import parse_overrides

    check_half_bits("--bits", [args.bits], args.codebook)
    check_half_bits("--head-bits", [args.head_bits], args.codebook)
    check_output_dir(args.out)
    check_device(args.device)
    from ..cache.modes import resolve_root
    from ..format.output import check_location

    # before anything is read: OUT may not overlap SRC or the encoding cache (whatever the cache mode)
    protect = {"the source model": args.src, "the encoding cache": resolve_root(args.cache_dir)}
    check_location(args.out, protect)
    hessians, calib_id = None, None
    if args.calibrate:
        from ..convert.calibrate import collect_hessians

        hessians, calib_id = collect_hessians(args.src, args.calibrate, rows=args.calib_rows,
                                              tokens=args.calib_tokens, device=args.device,
                                              progress=not args.quiet)
    summary = convert_checkpoint(
        args.src, args.out, bits=_bits(args.bits), codebook=args.codebook, head_bits=_bits(args.head_bits),
        seed=args.seed, keep=tuple(args.keep), overrides=tuple(parse_overrides(args.bits_for)),
        hessians=hessians, calibration_id=calib_id, backend=args.backend, device=args.device,
        overwrite=args.overwrite, progress=not args.quiet, cache=_cache(args), cache_only=args.from_cache,
        protect=protect,
    )
    err = summary["mean_proxy_err"]
    print(f"wrote {summary['out']}: {summary['linears']} linears ({summary['encoded']} encoded, "
          f"{summary['cache_hits']} from the encoding cache, {summary['reused']} resumed), {summary['weights']:,} weights in {summary['seconds']:.1f} s"
          + (f", mean proxy error {err:.2e}" if err is not None else "")
          + (f"; copied {', '.join(summary['copied'])}" if summary["copied"] else ""))
    print(f"next: exl3rt inspect {summary['out']}")
    return 0
