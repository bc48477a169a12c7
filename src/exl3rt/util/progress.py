"""A small progress bar for long work (stderr): done/total, rate, ETA. No dependency.

On a terminal it redraws one line; otherwise (logs, CI) it prints a line at most every 10 s.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def _fmt_time(sec: float) -> str:
    sec = max(0, int(sec))
    h, rem = divmod(sec, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _fmt_num(x: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(x) < 1000:
            return f"{x:.0f}{unit}" if unit == "" else f"{x:.1f}{unit}"
        x /= 1000
    return f"{x:.1f}P"


class Progress:
    """``with Progress(total, "encoding", unit="w") as p: p.update(n)``; ``enabled=False`` prints nothing."""

    def __init__(self, total: int, desc: str = "", *, unit: str = "", enabled: bool = True,
                 stream: Optional[TextIO] = None, interval: float = 0.5):
        self.total = max(int(total), 0)
        self.desc = desc
        self.unit = unit
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if self.tty else 10.0
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self.note = ""

    def update(self, n: int = 1, note: Optional[str] = None) -> None:
        self.done += n
        if note is not None:
            self.note = note
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.interval or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float, final: bool = False) -> None:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        frac = self.done / self.total if self.total else 1.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        eta_s = _fmt_time(eta) if eta != float("inf") else "--:--"
        line = (f"{self.desc} [{bar}] {100 * frac:5.1f}% {_fmt_num(self.done)}/{_fmt_num(self.total)}{self.unit} "
                f"{_fmt_num(rate)}{self.unit}/s elapsed {_fmt_time(elapsed)} " +
                (f"total {_fmt_time(elapsed)}" if final else f"eta {eta_s}") + (f"  {self.note}" if self.note else ""))
        if self.tty:
            self.stream.write("\r" + line[:200].ljust(120) + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic(), final=True)
            self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
