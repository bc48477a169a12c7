"""Errors raised by the encoding cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


class CacheError(ValueError):
    """The cache cannot do what was asked (bad mode, bad key, an encode that stays non-finite, …).

    The message names the layer or entry, the problem and the fix.
    """


class InvalidEntryError(CacheError):
    """A cache entry failed validation (torn, corrupt, wrong key, non-finite, wrong shape …)."""

    def __init__(self, path: Optional[Path], reason: str) -> None:
        self.path = path
        self.reason = reason
        where = f"cache entry {path}" if path is not None else "cache entry"
        super().__init__(f"{where}: {reason}")
