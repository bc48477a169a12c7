"""Cache modes and the cache root (the environment is read only through :mod:`exl3rt.env`)."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Union

from .. import env
from .errors import CacheError


class CacheMode(str, enum.Enum):
    """What the cache may do.

    - ``OFF``: never reads or writes; every layer is encoded.
    - ``READONLY``: reads valid entries; never locks, creates directories or writes (an invalid
      entry is ignored and left in place).
    - ``READWRITE``: reads, and publishes new encodes atomically under a per-entry lock; an invalid
      entry is replaced.
    """

    OFF = "off"
    READONLY = "readonly"
    READWRITE = "readwrite"

    def __str__(self) -> str:  # "readwrite", not "CacheMode.READWRITE"
        return self.value


def parse_cache_mode(value: Union[str, CacheMode, None]) -> CacheMode:
    """A mode from config: a :class:`CacheMode`, a name/alias, or ``None``.

    ``None`` means ``EXL3RT_CACHE_MODE`` (default ``readwrite``). Names are case-insensitive;
    aliases ``none`` (off), ``read-only`` (readonly), ``rw`` (readwrite). Anything else raises
    :class:`CacheError` (a ValueError) listing the valid values; a bad environment value raises
    :class:`exl3rt.env.EnvError` naming the variable.
    """
    if isinstance(value, CacheMode):
        return value
    if value is None:
        return CacheMode(env.CACHE_MODE.get())
    if not isinstance(value, str):
        raise CacheError(f"cache mode must be a string or CacheMode, got {type(value).__name__} {value!r}")
    try:
        return CacheMode(env.parse_cache_mode_name(value))
    except ValueError as exc:
        raise CacheError(str(exc)) from None


def default_cache_root() -> Path:
    """``EXL3RT_CACHE_DIR`` or ``$XDG_CACHE_HOME/exl3rt`` (``~/.cache/exl3rt``); entries live under ``v1/``."""
    return Path(env.cache_dir())


def resolve_root(root: Union[str, "Path", None]) -> Path:
    """``root`` (``~`` expanded) or :func:`default_cache_root`."""
    return Path(root).expanduser() if root is not None and str(root) != "" else default_cache_root()


__all__ = ["CacheMode", "default_cache_root", "parse_cache_mode", "resolve_root"]
