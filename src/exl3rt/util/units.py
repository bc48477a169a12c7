"""Human-readable sizes for tables and messages."""

from __future__ import annotations

import re


def fmt_bytes(n: float, digits: int = 2) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units; bytes without decimals)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(size: int | str) -> int:
    """``5_000_000``, ``"5MB"`` (decimal, as transformers' ``max_shard_size``) or ``"5MiB"`` -> bytes."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"(\d+(?:\.\d*)?)([A-Z]*)", str(size).strip().upper().replace(" ", ""))
        if m is None or m.group(2) not in _SIZE_UNITS:
            raise ValueError(f"size {size!r}: expected bytes or a number with KB, MB, GB, TB (or KiB … TiB)")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"size {size!r}: must be positive")
    return n
