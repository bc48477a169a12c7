"""Crash-safe file publication: write to a temporary name in the same directory, fsync, rename.

Readers never see half a file: either the old content or the new, whole. A writer killed mid-write leaves
its temporary (``.<target name>.<random>.tmp``); :func:`temp_files` finds those (and the ``.tmpXXXXXX``
files that ``safetensors.torch.save_file`` leaves) so that the owner of the directory can sweep them.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional


def _read_umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


_UMASK = _read_umask()  # read once at import: os.umask() is process-wide and not thread-safe

TMP_SUFFIX = ".tmp"
# ours: "." + target name + "." + mkstemp's random part + ".tmp"; safetensors' own save_file: ".tmp" + 6 chars
_OUR_TMP = re.compile(r"^\..+\.[A-Za-z0-9_]{6,}\.tmp$")
_FOREIGN_TMP = re.compile(r"^\.tmp[A-Za-z0-9_]{6}$")


def is_temp_name(name: str) -> bool:
    """True for the name of a temporary that :func:`atomic_path` or safetensors' ``save_file`` creates."""
    return bool(_OUR_TMP.match(name) or _FOREIGN_TMP.match(name))


def temp_target(name: str) -> str | None:
    """The target name an :func:`atomic_path` temporary was made for (None for other names)."""
    if not _OUR_TMP.match(name):
        return None
    return name[1:-len(TMP_SUFFIX)].rsplit(".", 1)[0]


def temp_files(directory: str | os.PathLike[str], *, min_age: float = 0.0) -> list[Path]:
    """Regular files in ``directory`` (not below it) named like a temporary, last modified at least
    ``min_age`` seconds ago. Symbolic links and other non-files are never listed."""
    now = time.time()
    found = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                if not is_temp_name(e.name):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime >= min_age:
                    found.append(Path(e.path))
    except OSError:
        return []
    return sorted(found)


def sweep_temp_files(directory: str | os.PathLike[str], *, min_age: float = 0.0,
                     owned: Optional[Callable[[str], bool]] = None) -> int:
    """Remove :func:`temp_files` of ``directory`` (only those made for a target name ``owned`` accepts, when
    given); returns how many were removed. Call it only where no live writer can own them (under the directory's
    lock, or with a ``min_age`` no write lasts)."""
    removed = 0
    for p in temp_files(directory, min_age=min_age):
        if owned is not None and not owned(temp_target(p.name) or ""):
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed += 1
    return removed


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

    The temporary is private (0600) while it is written; once written it gets permission bits ``mode``
    (default: 0o666 less the process umask, like ``open``) and only then is renamed, so the published file
    has them from its first moment and nothing that replaced the temporary meanwhile can leave its own. On
    an exception the temporary file is removed and ``target`` is untouched. The caller must write into the yielded path itself (not through a writer that renames its own
    temporary onto it: :func:`exl3rt.util.safetensors_io.write_safetensors`, not ``save_file``).
    """
    target = Path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_UMASK if mode is None else mode)
        fsync_file(tmp_path)
        os.replace(tmp_path, target)
        fsync_dir(target.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        if isinstance(exc, OSError) and not exc.filename and exc.errno is not None:
            # a full disk or a quota says only "[Errno 28] No space left on device": name the file it was writing
            raise OSError(exc.errno, exc.strerror or str(exc), str(target)) from exc
        raise


class DirectoryLock:
    """An exclusive lock on a directory itself (``flock`` on its descriptor: no lock file is left in it), held
    from :meth:`acquire` to :meth:`release`. Where the platform or file system has no such lock it holds nothing.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._fd: Optional[int] = None

    def acquire(self) -> bool:
        """Take the lock; False where it cannot exist here. Raises ``BlockingIOError`` at once when another
        process holds it."""
        try:
            import fcntl
        except ImportError:     # not POSIX
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise
        except OSError:         # a file system without flock
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


def atomic_write(target: str | os.PathLike[str], writer: Callable[[Path], None]) -> None:
    """Publish ``target`` atomically; ``writer(tmp_path)`` fills the temporary file."""
    with atomic_path(target) as tmp:
        writer(tmp)


def atomic_write_text(target: str | os.PathLike[str], text: str) -> None:
    atomic_write(target, lambda p: p.write_text(text, encoding="utf8"))
