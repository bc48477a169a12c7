"""A small progress bar for long work (stderr): done/total, rate, ETA. No dependency.

On a terminal it redraws one line; otherwise (logs, CI) it prints a line at most every 10 s. :class:`LogProgress`
says the same through ``logging`` (a server's log), one line every few seconds.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Optional, TextIO


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


class LogProgress:
    """Progress of work whose total grows as it is planned (``plan(n)``) and is done in pieces (``update(n, note)``):
    one INFO line on ``logger`` at most every ``interval`` seconds, with done/total, rate and ETA, and one when the
    planned work is all done."""

    def __init__(self, logger: logging.Logger, desc: str, *, unit: str = "", interval: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger, self.desc, self.unit, self.interval, self.clock = logger, desc, unit, interval, clock
        self.total = 0
        self.done = 0
        self.start: Optional[float] = None
        self._last = 0.0

    def plan(self, n: int) -> None:
        self.total += max(int(n), 0)

    def update(self, n: int, note: str = "") -> None:
        now = self.clock()
        if self.start is None:          # the clock starts with the first piece (planning is instant)
            self.start = now
            self._last = now
        self.done += int(n)
        finished = self.total > 0 and self.done >= self.total
        if finished or now - self._last >= self.interval:
            self._last = now
            self.logger.info("%s", self.line(now, note))

    def line(self, now: float, note: str = "") -> str:
        elapsed = max(now - (self.start if self.start is not None else now), 0.0)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        total = max(self.total, self.done)
        pct = 100.0 * self.done / total if total else 100.0
        left = total - self.done
        eta = _fmt_time(left / rate) if rate > 0 else "--:--"
        tail = f"done in {_fmt_time(elapsed)}" if left == 0 else f"eta {eta}"
        return (f"{self.desc}: {_fmt_num(self.done)}/{_fmt_num(total)}{self.unit} ({pct:.1f} %), "
                f"{_fmt_num(rate)}{self.unit}/s, elapsed {_fmt_time(elapsed)}, {tail}" + (f" ({note})" if note else ""))


def visible_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``, made to show INFO lines on stderr when nothing configured logging to show them
    (a server that configures only its own loggers); where the application set handlers and levels, it is left as
    it is."""
    logger = logging.getLogger(name)
    if not logger.handlers and not (logger.hasHandlers() and logger.getEffectiveLevel() <= logging.INFO):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
