"""Every ``EXL3RT_*`` environment variable, parsed in one place.

Nothing else in exl3rt reads ``os.environ``. Each variable has a parser with a clear error
message; :func:`describe` lists them (``exl3rt --help`` shows the table).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class EnvError(ValueError):
    """An ``EXL3RT_*`` variable holds a value that cannot be used."""


@dataclasses.dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    help: str
    brief: str = ""     # one clause for `exl3rt --help` (the developer switches; docs hold the whole help)

    def get(self, environ: Optional[dict[str, str]] = None) -> T:
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        try:
            return self.parse(raw.strip())
        except (ValueError, KeyError) as exc:
            raise EnvError(f"{self.name}={raw!r}: {exc}") from None


def _log_level(raw: str) -> str:
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")
    value = raw.upper()
    if value not in levels:
        raise ValueError(f"expected one of {', '.join(levels)}")
    return value


LOG_LEVEL: EnvVar[str] = EnvVar("EXL3RT_LOG_LEVEL", "WARNING", _log_level,
                                "log level of the exl3rt logger (DEBUG, INFO, WARNING, ERROR)")

def _path(raw: str) -> str:
    return os.path.expanduser(raw)


KERNEL_CACHE_DIR: EnvVar[str] = EnvVar(
    "EXL3RT_KERNEL_CACHE_DIR", "", _path,
    "compiled CPU kernels (default: $XDG_CACHE_HOME/exl3rt/kernels, i.e. ~/.cache/exl3rt/kernels)")

MODELS_DIR: EnvVar[str] = EnvVar(
    "EXL3RT_MODELS_DIR", "", _path,
    "models prepared by exl3rt (default: $XDG_CACHE_HOME/exl3rt/models), e.g. the bundled SmolLM2 as BF16")

#: canonical encoding-cache modes and their accepted spellings (exl3rt.cache.CacheMode holds the enum)
CACHE_MODES: tuple[str, ...] = ("off", "readonly", "readwrite")
CACHE_MODE_ALIASES: dict[str, str] = {
    "off": "off", "none": "off",
    "readonly": "readonly", "read-only": "readonly",
    "readwrite": "readwrite", "rw": "readwrite",
}


def parse_cache_mode_name(raw: str) -> str:
    """``raw`` (case-insensitive, an alias allowed) -> ``"off"``, ``"readonly"`` or ``"readwrite"``.

    Raises ValueError listing the valid values for anything else.
    """
    value = str(raw).strip().lower()
    if value not in CACHE_MODE_ALIASES:
        raise ValueError(
            f"cache mode {raw!r} is not valid: it must be off, readonly, or readwrite "
            f"(aliases: none = off, read-only = readonly, rw = readwrite)"
        )
    return CACHE_MODE_ALIASES[value]


CACHE_MODE: EnvVar[str] = EnvVar(
    "EXL3RT_CACHE_MODE", "readwrite", parse_cache_mode_name,
    "encoding cache: off, readonly or readwrite (aliases none, read-only, rw)")

CACHE_DIR: EnvVar[str] = EnvVar(
    "EXL3RT_CACHE_DIR", "", _path,
    "encoding cache root (default: $XDG_CACHE_HOME/exl3rt, i.e. ~/.cache/exl3rt)")

def _flag(raw: str) -> bool:
    value = raw.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0 (or true/false, yes/no, on/off)")


KERNEL_NO_ASM: EnvVar[bool] = EnvVar(
    "EXL3RT_KERNEL_NO_ASM", False, _flag,
    "1: the GPU kernels decode with plain Triton ops instead of inline PTX (debugging, other GPUs)",
    brief="1: decode with plain Triton ops instead of inline PTX")

KERNEL_NO_PDL: EnvVar[bool] = EnvVar(
    "EXL3RT_KERNEL_NO_PDL", False, _flag,
    "1: launch the linear kernels and the MoE decode plan's 1-4-row calls without programmatic dependent launch "
    "(each kernel then starts only when the last one has finished)",
    brief="1: no programmatic dependent launch")

KERNEL_ROUNDED_DECODE: EnvVar[bool] = EnvVar(
    "EXL3RT_KERNEL_ROUNDED_DECODE", False, _flag,
    "1: the 1-8-row GEMV kernels (linear layers, MoE decode) round each MCG/3INST weight to fp16 before the "
    "multiply, as the format's decode does (default at K other than 4 and 8: both halves of the codebook sum go to "
    "the tensor cores unrounded, fewer instructions, within half an fp16 ulp of the format's weight)",
    brief="1: round each decoded weight to fp16 before the multiply, as the format does")

KERNEL_DETERMINISTIC: EnvVar[bool] = EnvVar(
    "EXL3RT_KERNEL_DETERMINISTIC", False, _flag,
    "1: the 1-8-row GEMV kernels (linear layers, the MoE decode plan) and, on Hopper, the 9-32-row wgmma kernel "
    "of layers split 12 or more ways along K write one partial sum per K split and the next pass adds them in a "
    "fixed order (bit-identical results from run to run; default: the splits add into one fp32 buffer with atomic "
    "adds, whose order varies, and the next pass reads only that buffer: faster at 2-8 rows, 1-4 % at 9-32)",
    brief="1: bit-identical GEMV / wgmma results run to run (fixed-order split-K sums)")

KERNEL_NO_WGMMA: EnvVar[bool] = EnvVar(
    "EXL3RT_KERNEL_NO_WGMMA", False, _flag,
    "1: never use the Hopper wgmma kernels (linear layers: 17-256 and 417-512 rows, 9-16 at K other than 1, 2, 4, "
    "then take the mma GEMV / decode + cuBLAS; "
    "MoE: prefill route blocks of 32/64/128 take the mma tiered launch)",
    brief="1: never use the Hopper wgmma kernels")


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("expected a positive integer") from None
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")
    return value


MOE_MAX_DECODE_M: EnvVar[int] = EnvVar(
    "EXL3RT_MOE_MAX_DECODE_M", 32, _positive_int,
    "MoE: most rows run by the decode plan (capped at the declared max batch); more rows use the prefill plan",
    brief="MoE: most rows run by the decode plan")

MOE_PREFILL_BLOCK_M: EnvVar[Optional[int]] = EnvVar(
    "EXL3RT_MOE_PREFILL_BLOCK_M", None, _positive_int,
    "MoE: prefill route block; unset = automatic (16, 32 or 64 by the routes per expert of each row bucket), "
    "set = exactly this for every prefill call",
    brief="MoE: prefill route block (unset: automatic)")

MOE_PREFILL_CAPACITY: EnvVar[Optional[int]] = EnvVar(
    "EXL3RT_MOE_PREFILL_CAPACITY", None, _positive_int,
    "MoE: rows of the prefill arena (unset = the declared max batch); larger batches run in slices",
    brief="MoE: rows of the prefill arena (unset: the declared max batch)")

def _bits(raw: str) -> float | int:
    from .format.bits import normalize_bits  # the one rule for K (FormatError is a ValueError)

    return normalize_bits(raw, name="K")


def _codebook(raw: str) -> str:
    from .format.codebooks import check_codebook  # the one rule for codebook names (FormatError is a ValueError)

    return check_codebook(raw.lower())


VLLM_BITS: EnvVar[Optional[float | int]] = EnvVar(
    "EXL3RT_VLLM_BITS", None, _bits,
    "vLLM online EXL3: K of the linears when quantization_config has no 'bits' (unset = 4)")

VLLM_CODEBOOK: EnvVar[Optional[str]] = EnvVar(
    "EXL3RT_VLLM_CODEBOOK", None, _codebook,
    "vLLM online EXL3: codebook when quantization_config has no 'codebook' (unset = mcg)")

ALL: tuple[EnvVar, ...] = (LOG_LEVEL, KERNEL_CACHE_DIR, MODELS_DIR, CACHE_MODE, CACHE_DIR,
                           KERNEL_DETERMINISTIC, KERNEL_NO_ASM, KERNEL_NO_PDL, KERNEL_NO_WGMMA, KERNEL_ROUNDED_DECODE,
                           MOE_MAX_DECODE_M, MOE_PREFILL_BLOCK_M, MOE_PREFILL_CAPACITY, VLLM_BITS, VLLM_CODEBOOK)


def xdg_cache_home() -> str:
    """``$XDG_CACHE_HOME`` or ``~/.cache`` (read here, as the Hub variables below are: the non-EXL3RT variables
    exl3rt reads)."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


#: seconds the Hub's metadata calls (connect, and reading an API answer) may wait, when HF_HUB_ETAG_TIMEOUT is unset
HUB_METADATA_TIMEOUT = 5.0
#: seconds a file download may wait for the next bytes, when HF_HUB_DOWNLOAD_TIMEOUT is unset (huggingface_hub's)
HUB_DOWNLOAD_TIMEOUT = 10.0


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected a number of seconds") from None
    if not value > 0:
        raise EnvError(f"{name}={raw!r}: expected a positive number of seconds")
    return value


def hub_timeouts() -> tuple[float, float]:
    """(metadata, download) read timeouts for Hugging Face Hub calls: huggingface_hub's own variables
    ``HF_HUB_ETAG_TIMEOUT`` and ``HF_HUB_DOWNLOAD_TIMEOUT``, read here, else a few seconds."""
    return (_seconds("HF_HUB_ETAG_TIMEOUT", HUB_METADATA_TIMEOUT),
            _seconds("HF_HUB_DOWNLOAD_TIMEOUT", HUB_DOWNLOAD_TIMEOUT))


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (huggingface_hub's variable, read here)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def kernel_cache_dir() -> str:
    """Where generated CPU kernels are kept."""
    return KERNEL_CACHE_DIR.get() or os.path.join(xdg_cache_home(), "exl3rt", "kernels")


def cache_dir() -> str:
    """Root of the persistent encoding cache: ``EXL3RT_CACHE_DIR`` or ``$XDG_CACHE_HOME/exl3rt``."""
    return CACHE_DIR.get() or os.path.join(xdg_cache_home(), "exl3rt")


#: the settings a user sets; the rest tune or debug the kernels and MoE plans (listed apart, under "developer")
USER: tuple[EnvVar, ...] = (CACHE_DIR, CACHE_MODE, LOG_LEVEL, MODELS_DIR, KERNEL_CACHE_DIR, VLLM_BITS, VLLM_CODEBOOK)


def describe() -> str:
    """The variables, users' settings first, then the developer switches: one line each (name, default, meaning; a
    developer switch's in brief)."""
    def line(v: EnvVar, short: bool) -> str:
        text = (v.brief or v.help) if short else v.help
        default = "unset" if v.default in (None, "") else v.default
        return f"  {v.name:<28} (default {default!s:<9}) {text}"
    developer = [v for v in ALL if v not in USER]
    return "\n".join([*(line(v, False) for v in USER), "developer (kernel and MoE-plan switches; docs/kernels.md, "
                      "docs/moe.md):", *(line(v, True) for v in developer)])
