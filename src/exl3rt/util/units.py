"""Human-readable sizes for tables and messages."""

from __future__ import annotations


def fmt_bytes(n: float, digits: int = 2) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units; bytes without decimals)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"
