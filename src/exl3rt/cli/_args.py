"""argparse value types shared by the sub-commands: a bad value is a usage error before anything runs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable, Iterable, Union


class UsageError(ValueError):
    """A command-line value this machine or command cannot use (``exl3rt`` prints it as one error line)."""


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low`` (argparse ``type``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small: at least {low}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``low..high`` (argparse ``type``)."""
    at_least = int_at_least(low)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"{value} is too large: at most {high}")
        return value
    parse.__name__ = f"integer in {low}..{high}"
    return parse


def check_output_dir(path: str, option: str = "OUT") -> None:
    """Refuse an output directory that exists as a file, or lies under one (one line, before any work)."""
    p = Path(path).expanduser()
    try:
        for q in (p, *p.parents):
            if q.exists() or q.is_symlink():
                if not q.is_dir():
                    what = "exists and is not a directory" if q == p else f"lies under {q}, which is not a directory"
                    raise UsageError(f"{option} {path}: {what}")
                return
    except OSError as exc:      # e.g. a name longer than the file system allows
        raise UsageError(f"{option} {shown_path(path)}: {exc.strerror or exc}") from None


def shown_path(path: str, limit: int = 120) -> str:
    """``path`` for an error line: a name too long to print is cut in the middle."""
    return path if len(path) <= limit else f"{path[:limit // 2]}...{path[-limit // 2:]} ({len(path)} characters)"


#: ``--bits 16``: the unquantized model (generate, eval; quantize --head-bits: keep lm_head unquantized)
UNQUANTIZED = 16


def bits_type(*, unquantized: bool) -> Callable[[str], Union[int, float]]:
    """A bitrate K (argparse ``type``): 1..8, or 1.5 / 2.5 / 3.5 (the rule of
    :func:`exl3rt.format.bits.normalize_bits`), and 16 (:data:`UNQUANTIZED`) where ``unquantized``.

    Returns an ``int`` for whole K. That half-integer K needs ``--codebook mul1`` is checked after
    parsing (:func:`check_half_bits`), as it depends on another option.
    """
    from ..format.bits import normalize_bits
    from ..format.errors import FormatError

    allowed = "1..8, or 1.5, 2.5, 3.5 with --codebook mul1"
    if unquantized:
        allowed += f", or {UNQUANTIZED} (unquantized)"

    def parse(text: str) -> Union[int, float]:
        try:
            if float(text) == UNQUANTIZED:
                if unquantized:
                    return UNQUANTIZED
                raise argparse.ArgumentTypeError(
                    f"{text} (unquantized) is not a bitrate this option takes: use {allowed}")
        except ValueError:
            pass
        try:
            return normalize_bits(text.strip())
        except FormatError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a bitrate: use {allowed}") from None
    parse.__name__ = "bitrate"
    return parse


def check_half_bits(option: str, values: Iterable[Union[int, float]], codebook: str) -> None:
    """Refuse a half-integer K unless ``codebook`` is mul1 (one ``exl3rt: error:`` line, before anything loads)."""
    for k in values:
        if not float(k).is_integer() and codebook != "mul1":
            raise UsageError(f"{option} {k:g}: half-integer bitrates need --codebook mul1 (got --codebook {codebook})")


def readable_file(text: str) -> str:
    """A path to an existing, readable file (argparse ``type``)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return text


def check_device(name: str) -> None:
    """Refuse a ``--device`` this machine cannot run on, in one line, before anything loads."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {name!r}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA device here (this torch "
                              f"{'is a CPU build' if torch.version.cuda is None else 'sees no GPU'}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here "
                              f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    elif dev.type != "cpu":
        raise UsageError(f"--device {name}: exl3rt runs on cpu or cuda")
