"""argparse value types shared by the sub-commands: a bad value is a usage error before anything runs."""

from __future__ import annotations

import argparse
import os
from typing import Callable


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
