"""Crash-safe file publication: write to a temporary name in the same directory, fsync, rename.

Readers never see half a file: either the old content or the new, whole.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional


def _read_umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


_UMASK = _read_umask()  # read once at import: os.umask() is process-wide and not thread-safe


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], *, mode: Optional[int] = None) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success fsync it and rename it onto ``target``.

    The file gets permission bits ``mode`` (default: 0o666 less the process umask, like ``open``).
    On an exception the temporary file is removed and ``target`` is untouched.
    """
    target = Path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_UMASK if mode is None else mode)
    try:
        yield tmp_path
        fsync_file(tmp_path)
        os.replace(tmp_path, target)
        fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


def atomic_write(target: str | os.PathLike[str], writer: Callable[[Path], None]) -> None:
    """Publish ``target`` atomically; ``writer(tmp_path)`` fills the temporary file."""
    with atomic_path(target) as tmp:
        writer(tmp)


def atomic_write_text(target: str | os.PathLike[str], text: str) -> None:
    atomic_write(target, lambda p: p.write_text(text, encoding="utf8"))
