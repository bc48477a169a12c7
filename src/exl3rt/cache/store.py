"""EncodingCache: load an encoding from the cache or encode it, publish it, list/verify/prune entries.

Layout: ``<root>/v1/<digest[:2]>/<digest>.safetensors`` with ``<digest>.safetensors.lock`` beside it
(the per-entry lock, mode 0600) and, while a publish is in flight, ``.<digest>.safetensors.<random>.tmp``.

Concurrency: readers never lock (publication is an atomic rename, so a reader sees no file or a whole
one). A writer takes the entry's ``filelock`` (flock on Linux: released by the kernel when the holder
dies, even by SIGKILL), re-checks the entry (another process may have published it while we waited),
encodes, writes a temporary file in the same directory, fsyncs it, renames it onto the entry name and
fsyncs the directory. Temporary files left by a killed writer are removed by the next writer of that
entry (it holds the lock, so they cannot be live) and by ``exl3rt cache prune``.

Hostile trees: below the root (which may itself be a link) nothing is followed through a symbolic link:
``v1``, the fan-out directories, entries and lock files are examined with ``lstat``; a linked or
non-directory ``v1``/fan-out directory is never read or written through, and only regular files are read
or removed.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import filelock
import torch

from ..format.encoded import EncodedLinear
from ..format.errors import FormatError
from ..util.fs import atomic_path, temp_files, temp_target
from .modes import CacheMode, parse_cache_mode, resolve_root
from .entry import (SUFFIX, CacheEntryInfo, check_encoding, entry_info, entry_payload, file_kind, nonfinite_reason,
                    proxy_err_of, read_entry, remove_quietly, write_entry)
from .errors import CacheError, InvalidEntryError
from .key import SCHEMA, CacheKey

log = logging.getLogger(__name__)

LAYOUT = f"v{SCHEMA}"
LOCK_SUFFIX = ".lock"
LOCK_MODE = 0o600
DEFAULT_LOCK_TIMEOUT = 600.0
#: Age after which prune removes temporaries that no entry lock protects (``.tmpXXXXXX`` left by
#: ``safetensors.torch.save_file`` in older versions): no write of one entry takes this long.
FOREIGN_TMP_GRACE = 15 * 60.0
_FANOUT = re.compile(r"[0-9a-f]{2}")
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}" + re.escape(SUFFIX))    # path_for: the key's SHA-256, hex
_IN_USE = "being written by another process"


@dataclasses.dataclass
class CacheStats:
    """Counters of one :class:`EncodingCache` (not thread-safe; diagnostics only)."""

    hits: int = 0
    misses: int = 0
    encodes: int = 0             # calls of encode(), retries included
    published: int = 0
    publish_failures: int = 0
    uncached: int = 0            # encodes not published because the cache was unavailable
    invalid_entries: int = 0
    nonfinite_retries: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    hash_seconds: float = 0.0    # time in key_for_weight (hashing source weights and Hessians)
    encode_seconds: float = 0.0
    publish_seconds: float = 0.0
    lock_wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def read_gbps(self) -> float:
        """Cache read throughput, GB/s (0 before the first hit)."""
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


@dataclasses.dataclass
class CacheResult:
    """What :meth:`EncodingCache.load_or_encode` returns."""

    encoded: EncodedLinear
    hit: bool
    path: Optional[Path]   # entry path if read from or published to the cache, else None
    seconds: float         # wall time of the call (read, or encode + publish)


@dataclasses.dataclass
class VerifyResult:
    """One entry's verdict from :meth:`EncodingCache.verify`."""

    info: CacheEntryInfo
    ok: bool
    reason: str = ""
    deleted: bool = False
    kept: str = ""      # with delete_invalid: why an invalid entry was not deleted


@dataclasses.dataclass
class PruneReport:
    """What :meth:`EncodingCache.prune` removed (or, with ``dry_run``, would remove)."""

    removed: list[CacheEntryInfo] = dataclasses.field(default_factory=list)
    skipped_in_use: list[CacheEntryInfo] = dataclasses.field(default_factory=list)
    skipped: list[tuple[CacheEntryInfo, str]] = dataclasses.field(default_factory=list)  # (entry, why kept)
    freed_bytes: int = 0
    remaining_bytes: int = 0
    remaining_entries: int = 0
    stale_files_removed: int = 0   # temporaries of dead writers, orphan lock files
    dry_run: bool = False


# Warning kinds: each is logged once per cache object (then at DEBUG).
_UNAVAILABLE = "unavailable"
_LOCK_TIMEOUT = "lock-timeout"
_PUBLISH = "publish"
_INVALID = "invalid"
_UNREADABLE = "unreadable"
_TRUST = "trust"
_UNSAFE = "unsafe"


class _UnsafePath(Exception):
    """A path below the root that must not be used: a symbolic link, or not what the layout expects."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


class EncodingCache:
    """Persistent, content-addressed store of encodings, keyed by :class:`CacheKey`.

    ``root`` defaults to ``EXL3RT_CACHE_DIR`` or ``$XDG_CACHE_HOME/exl3rt``; ``mode`` to
    ``EXL3RT_CACHE_MODE`` or ``readwrite``. A cache problem (unwritable directory, full disk, lock
    timeout, invalid entry, a linked directory below the root) never stops a model from loading: the
    layer is encoded uncached and the problem is logged once per kind.
    """

    def __init__(self, root: Union[str, Path, None] = None, mode: Union[str, CacheMode, None] = None, *,
                 lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        self.root: Path = resolve_root(root)
        self.mode: CacheMode = parse_cache_mode(mode)
        self.lock_timeout = float(lock_timeout)
        self.stats = CacheStats()
        self._warned: set[str] = set()
        self._dirs_ok: set[Path] = set()  # directories found real (and trust-checked) by this object

    def __repr__(self) -> str:
        return f"EncodingCache(root={str(self.root)!r}, mode={self.mode.value!r})"

    # ---- paths -------------------------------------------------------------------------------
    @property
    def entries_dir(self) -> Path:
        """``<root>/v1``: everything this cache owns lives below it."""
        return self.root / LAYOUT

    def path_for(self, key: CacheKey) -> Path:
        """``<root>/v1/<digest[:2]>/<digest>.safetensors``."""
        d = key.digest()
        return self.entries_dir / d[:2] / f"{d}{SUFFIX}"

    @staticmethod
    def lock_path(entry: Path) -> Path:
        return entry.with_name(entry.name + LOCK_SUFFIX)

    # ---- warnings ----------------------------------------------------------------------------
    def _warn(self, kind: str, msg: str, *args: Any) -> None:
        """Log ``msg`` at WARNING the first time this cache meets ``kind``, at DEBUG afterwards."""
        if kind in self._warned:
            log.debug(msg, *args)
        else:
            self._warned.add(kind)
            log.warning(msg + " (further problems of this kind are logged at DEBUG)", *args)

    def _warn_unsafe(self, exc: _UnsafePath, what: str) -> None:
        self._warn(_UNSAFE, "encoding cache path %s %s; nothing is read or written through it (a link could lead "
                   "outside the cache root %s): %s. Remove it (the cache recreates what it needs)",
                   exc.path, exc.reason, self.root, what)

    def _check_trust(self, directory: Path, st: os.stat_result) -> None:
        loose = st.st_mode & 0o022
        foreign = hasattr(os, "geteuid") and st.st_uid not in (os.geteuid(), 0)
        if loose or foreign:
            self._warn(_TRUST, "encoding cache directory %s is %s: cached entries become model weights, so the cache "
                       "must be writable only by the serving user (chmod 700 it, or use EXL3RT_CACHE_DIR)",
                       directory, "writable by group/others" if loose else f"owned by uid {st.st_uid}")

    def _note_dir(self, directory: Path, st: os.stat_result) -> None:
        """Record ``directory`` as a real directory, checking its trust once per cache object."""
        if directory not in self._dirs_ok:
            self._dirs_ok.add(directory)
            self._check_trust(directory, st)

    def _check_dir(self, directory: Path) -> bool:
        """True if ``directory`` is a real directory (trust-checked once), False if it does not exist.

        Raises :class:`_UnsafePath` for anything else below the root, OSError for a root that is not a
        directory or cannot be examined. The root is followed (it may be a link to a big disk); every
        directory below it is examined with ``lstat``.
        """
        if directory in self._dirs_ok:
            return True
        is_root = directory == self.root
        try:
            st = os.stat(directory) if is_root else os.lstat(directory)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            if is_root:
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(directory))
            raise _UnsafePath(directory, f"is a {file_kind(st.st_mode)}, not a directory")
        self._note_dir(directory, st)
        return True

    def _check_dirs(self, fanout: Path) -> None:
        """Check the root, ``v1`` and ``fanout`` down to the first one that does not exist yet."""
        for d in (self.root, self.entries_dir, fanout):
            if not self._check_dir(d):
                return

    # ---- keys ----------------------------------------------------------------------------------
    def key_for_weight(self, weight_hf: torch.Tensor, **kwargs: Any) -> CacheKey:
        """:meth:`CacheKey.for_weight`, with the hashing time added to ``stats.hash_seconds``."""
        t0 = time.perf_counter()
        try:
            return CacheKey.for_weight(weight_hf, **kwargs)
        finally:
            self.stats.hash_seconds += time.perf_counter() - t0

    # ---- the one verb --------------------------------------------------------------------------
    def load_or_encode(self, key: CacheKey, encode: Callable[[], EncodedLinear], *,
                       device: Union[str, torch.device] = "cpu", name: str = "") -> CacheResult:
        """The encoding for ``key``: from the cache if a valid entry exists, else ``encode()``.

        ``encode()`` returns an :class:`EncodedLinear` whose tensors match ``key`` (``info["proxy_err"]``
        is recorded when present). A non-finite result (NaN/inf in suh, svh or proxy_err, or a
        FormatError from encode) is retried once and never published; a second failure raises
        :class:`CacheError` naming ``name``. Other exceptions from ``encode()`` propagate. Cache
        problems never raise: the layer is encoded uncached and a warning is logged once per kind.
        The result is on ``device``; its ``bias`` is None (attach the checkpoint's bias).
        """
        t0 = time.perf_counter()
        label = name or key.describe()
        if key.schema != SCHEMA:
            raise CacheError(f"{label}: the cache key has schema {key.schema}, but this exl3rt writes schema {SCHEMA}; "
                             f"build keys with CacheKey.for_weight")
        path = self.path_for(key)

        if self.mode is CacheMode.OFF:
            enc = self._encode_checked(key, encode, label)
            return CacheResult(_place(enc, device, name), False, None, time.perf_counter() - t0)

        try:
            self._check_dirs(path.parent)
        except _UnsafePath as exc:
            self._warn_unsafe(exc, "encoding without caching")
            return self._uncached(key, encode, label, device, name, t0)
        except OSError as exc:
            self._warn_unavailable(exc)
            return self._uncached(key, encode, label, device, name, t0)
        status, loaded = self._try_read(path, key, label, refresh=self.mode is CacheMode.READWRITE)
        if loaded is not None:
            return CacheResult(_place(loaded, device, name), True, path, time.perf_counter() - t0)
        seen_invalid = status == "invalid"

        if self.mode is CacheMode.READONLY:
            return self._uncached(key, encode, label, device, name, t0)

        # readwrite: lock, re-check, encode, publish
        lock = self._acquire(path, label)
        if lock is None:
            return self._uncached(key, encode, label, device, name, t0)
        try:
            status, loaded = self._try_read(path, key, label, refresh=False, count_invalid=not seen_invalid)
            if loaded is not None:
                return CacheResult(_place(loaded, device, name), True, path, time.perf_counter() - t0)
            self.stats.misses += 1
            self._remove_stale_temporaries(path)
            enc = self._encode_checked(key, encode, label)
            published = self._publish(path, key, enc, label)
            return CacheResult(_place(enc, device, name), False, path if published else None, time.perf_counter() - t0)
        finally:
            try:
                lock.release()
            except OSError:  # pragma: no cover - releasing a flock does not fail in practice
                pass

    def _uncached(self, key: CacheKey, encode: Callable[[], EncodedLinear], label: str,
                  device: Union[str, torch.device], name: str, t0: float) -> CacheResult:
        self.stats.misses += 1
        enc = self._encode_checked(key, encode, label)
        self.stats.uncached += 1
        return CacheResult(_place(enc, device, name), False, None, time.perf_counter() - t0)

    # ---- steps ---------------------------------------------------------------------------------
    def _try_read(self, path: Path, key: CacheKey, label: str, *, refresh: bool,
                  count_invalid: bool = True) -> tuple[str, Optional[EncodedLinear]]:
        """("hit", enc) | ("missing", None) | ("invalid", None); never raises for cache problems."""
        t0 = time.perf_counter()
        if not os.path.lexists(path):
            return "missing", None
        try:
            loaded = read_entry(path, key)
        except InvalidEntryError as exc:
            if not os.path.lexists(path) and exc.reason.startswith("unreadable"):
                return "missing", None
            if exc.reason.startswith("unreadable"):
                self._warn(_UNREADABLE, "cannot read encoding cache entry %s for %s: %s; encoding it instead",
                           path, label, exc.reason)
                return "invalid", None
            if count_invalid:
                self.stats.invalid_entries += 1
                action = ("ignoring it (readonly cache)" if self.mode is CacheMode.READONLY
                          else "re-encoding and replacing it")
                self._warn(_INVALID, "invalid encoding cache entry for %s: %s; %s", label, exc, action)
            return "invalid", None
        self.stats.hits += 1
        self.stats.bytes_read += loaded.nbytes
        self.stats.read_seconds += time.perf_counter() - t0
        if refresh:  # readwrite: record the use, so that `prune --older-than` means "unused for"
            try:
                if os.utime in os.supports_follow_symlinks:
                    os.utime(path, follow_symlinks=False)
                else:  # pragma: no cover - Linux and macOS support it
                    os.utime(path)
            except OSError:
                pass
        return "hit", loaded.encoded

    def _lock(self, entry: Path, timeout: float) -> filelock.BaseFileLock:
        """The entry's lock object (not acquired); raises :class:`_UnsafePath` if the lock file is not a
        regular file (some filelock versions open it with O_TRUNC, through a link)."""
        lock_path = self.lock_path(entry)
        try:
            st = os.lstat(lock_path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISREG(st.st_mode):
                raise _UnsafePath(lock_path, f"is a {file_kind(st.st_mode)}, not a lock file")
        return filelock.FileLock(str(lock_path), timeout=timeout, mode=LOCK_MODE)

    def _acquire(self, path: Path, label: str) -> Optional[filelock.BaseFileLock]:
        """Create the entry's directory and take its lock; None (after a warning) when impossible."""
        try:
            self._make_dirs(path.parent)
            lock = self._lock(path, self.lock_timeout)
            t0 = time.perf_counter()
            try:
                lock.acquire()
            finally:
                self.stats.lock_wait_seconds += time.perf_counter() - t0
            return lock
        except filelock.Timeout:  # before OSError: a Timeout is not a broken cache
            self._warn(_LOCK_TIMEOUT, "timed out after %.0f s waiting for the encoding cache lock of %s (%s); "
                       "another process holds it. Encoding uncached", self.lock_timeout, label,
                       self.lock_path(path))
        except _UnsafePath as exc:
            self._warn_unsafe(exc, "encoding without caching")
        except OSError as exc:
            self._warn_unavailable(exc)
        return None

    def _warn_unavailable(self, exc: OSError) -> None:
        self._warn(_UNAVAILABLE, "encoding cache %s is unavailable (%s); encoding without caching. "
                   "Fix the directory's permissions, choose another with EXL3RT_CACHE_DIR, or set "
                   "EXL3RT_CACHE_MODE=readonly/off", self.root, _oserror_text(exc))

    def _make_dirs(self, directory: Path) -> None:
        """Create ``directory`` and parents below the root with mode 0700 (the root too), checking each
        before anything is created inside it."""
        if directory in self._dirs_ok:
            return
        if not self._check_dir(self.root):
            self.root.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.root.mkdir(mode=0o700)
            except FileExistsError:
                pass
            self._check_dir(self.root)
        for d in (self.entries_dir, directory):
            if not self._check_dir(d):
                try:
                    d.mkdir(mode=0o700)
                except FileExistsError:
                    pass
                if not self._check_dir(d):  # removed again at once: let the next step report it
                    raise FileNotFoundError(errno.ENOENT, "directory vanished while it was created", str(d))

    def _encode_checked(self, key: CacheKey, encode: Callable[[], EncodedLinear], label: str) -> EncodedLinear:
        """``encode()``, checked against ``key``; one retry on a non-finite result."""
        last = ""
        for attempt in (1, 2):
            t0 = time.perf_counter()
            self.stats.encodes += 1
            try:
                enc = encode()
            except FormatError as exc:  # EncodedLinear's own validation (e.g. NaN scales) inside encode
                enc, last = None, f"encode raised: {exc}"
            finally:
                self.stats.encode_seconds += time.perf_counter() - t0
            if enc is not None:
                wrong = check_encoding(enc, key)
                if wrong:
                    raise CacheError(f"{label}: the encoding does not match its cache key: {wrong}. "
                                     f"This is a bug in the caller's encode function; nothing was cached")
                last = nonfinite_reason(enc.suh, enc.svh, proxy_err_of(enc)) or ""
                if not last:
                    enc.info = dict(enc.info or {})
                    enc.info.setdefault("encode_seconds", time.perf_counter() - t0)
                    return enc
            if attempt == 1:
                self.stats.nonfinite_retries += 1
                log.warning("%s: rejected a non-finite encoding (%s); retrying once", label, last)
        raise CacheError(f"{label}: encoding is non-finite twice ({last}); nothing was cached. Check the source "
                         f"weight for NaN/inf, or try another seed or backend")

    def _publish(self, path: Path, key: CacheKey, enc: EncodedLinear, label: str) -> bool:
        """Write the entry atomically; False (after a warning) on any failure. The caller holds the lock."""
        t0 = time.perf_counter()
        try:
            tensors, meta = entry_payload(enc, key, float(enc.info.get("encode_seconds", 0.0)))
            with atomic_path(path) as tmp:
                self._write_entry(tmp, tensors, meta)
        except Exception as exc:  # a failed publish must keep the finished encode
            self.stats.publish_failures += 1
            self.stats.uncached += 1
            text = _oserror_text(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
            self._warn(_PUBLISH, "could not publish the encoding of %s to the cache %s (%s); the encoded layer "
                       "is used without caching", label, self.root, text)
            return False
        finally:
            self.stats.publish_seconds += time.perf_counter() - t0
        self.stats.published += 1
        enc.info["cache_path"] = str(path)
        return True

    def _write_entry(self, tmp: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        """Fill the temporary file (a seam for tests that inject disk errors or pause mid-publish)."""
        write_entry(tmp, tensors, metadata)

    def _remove_stale_temporaries(self, path: Path) -> int:
        """Remove temporaries of ``path`` left by dead writers (call with the entry's lock held)."""
        return sum(remove_quietly(tmp) for tmp in temp_files(path.parent) if temp_target(tmp.name) == path.name)

    # ---- walks (never through a link below the root) -------------------------------------------
    def _fanout_dirs(self) -> tuple[list[Path], list[Path]]:
        """(real fan-out directories under ``v1``, sorted; links and non-directories found where
        ``v1`` or a fan-out directory should be, which are warned about and not followed)."""
        base = self.entries_dir
        try:
            if not self._check_dir(self.root) or not self._check_dir(base):
                return [], []
        except _UnsafePath as exc:
            self._warn_unsafe(exc, "skipped")
            return [], [exc.path]
        except OSError:  # the root is not a directory, or cannot be examined: nothing to walk
            return [], []
        dirs, skipped = [], []
        try:
            with os.scandir(base) as it:
                for e in it:
                    if not _FANOUT.fullmatch(e.name):
                        continue  # not part of the layout
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    p = Path(e.path)
                    if stat.S_ISDIR(st.st_mode):
                        self._note_dir(p, st)
                        dirs.append(p)
                    else:
                        self._warn_unsafe(_UnsafePath(p, f"is a {file_kind(st.st_mode)}, not a directory"), "skipped")
                        skipped.append(p)
        except OSError:
            pass
        return sorted(dirs), sorted(skipped)

    @staticmethod
    def _scan(directory: Path) -> list[tuple[Path, os.stat_result]]:
        """(path, lstat) of every name in ``directory``, sorted; names that vanish are left out."""
        out = []
        try:
            with os.scandir(directory) as it:
                for e in it:
                    try:
                        out.append((Path(e.path), e.stat(follow_symlinks=False)))
                    except OSError:
                        continue
        except OSError:
            return []
        return sorted(out, key=lambda item: item[0])

    def entries(self) -> Iterator[CacheEntryInfo]:
        """Every name ``<digest>.safetensors`` (64 hex digits: what :meth:`path_for` names an entry) under the real
        fan-out directories of ``<root>/v1``, sorted by
        path: header facts of regular files; anything else (directory, link, FIFO …) with ``regular=False``
        and ``error`` saying what it is. Nothing is followed through a symbolic link."""
        for sub in self._fanout_dirs()[0]:
            for p, st in self._scan(sub):
                # only names the cache gives its entries: a file put here by hand is never verified away or pruned
                if _ENTRY_NAME.fullmatch(p.name):
                    yield entry_info(p, st)

    def summary(self) -> dict[str, Any]:
        """Totals for ``exl3rt cache stats``: entries, bytes, bad headers, stray files, links not followed."""
        n = size = bad = not_regular = 0
        oldest: Optional[float] = None
        newest: Optional[float] = None
        for e in self.entries():
            n += 1
            size += e.size
            bad += e.error is not None
            not_regular += not e.regular
            oldest = e.mtime if oldest is None else min(oldest, e.mtime)
            newest = e.mtime if newest is None else max(newest, e.mtime)
        temps = locks = 0
        dirs, skipped = self._fanout_dirs()
        for sub in dirs:
            temps += len(temp_files(sub))
            locks += sum(1 for p, st in self._scan(sub)
                         if p.name.endswith(SUFFIX + LOCK_SUFFIX) and stat.S_ISREG(st.st_mode))
        return {"root": str(self.root), "layout": LAYOUT, "mode": self.mode.value, "entries": n, "bytes": size,
                "unreadable_headers": bad, "not_regular_files": not_regular, "temporary_files": temps,
                "lock_files": locks, "links_not_followed": len(skipped), "oldest_mtime": oldest,
                "newest_mtime": newest}

    def verify(self, *, delete_invalid: bool = False) -> list[VerifyResult]:
        """Fully re-validate every entry against the key stored in it (and its file name).

        With ``delete_invalid`` (readwrite only), invalid entries are removed under their lock; an entry
        whose lock is held (being written) is never deleted, nor is anything that is not a regular file
        (``kept`` says why). Raises CacheError if the root does not exist.
        """
        if delete_invalid:
            self._require_writable("verify --delete-invalid")
        if not self.root.is_dir():
            what = "is not a directory" if os.path.lexists(self.root) else "does not exist"
            raise CacheError(f"cache root {self.root} {what}; nothing to verify (check --root or EXL3RT_CACHE_DIR)")
        results = []
        for info in self.entries():
            if not info.regular:
                res = VerifyResult(info, False, info.error or "not a regular file")
                if delete_invalid:
                    res.kept = "not a regular file; remove it by hand"
                results.append(res)
                continue
            try:
                read_entry(info.path, None)
                results.append(VerifyResult(info, True))
                continue
            except InvalidEntryError as exc:
                res = VerifyResult(info, False, exc.reason)
            if delete_invalid:
                why = self._remove_if_unlocked(info.path)
                res.deleted, res.kept = why is None, why or ""
            results.append(res)
        return results

    def prune(self, older_than: Optional[float] = None, max_size: Optional[int] = None, *,
              dry_run: bool = False, now: Optional[float] = None) -> PruneReport:
        """Remove entries unused for ``older_than`` seconds, then the least recently used ones until the
        total is at most ``max_size`` bytes. Also removes temporaries and lock files of dead writers, and
        temporaries no lock protects (``.tmpXXXXXX``) once older than :data:`FOREIGN_TMP_GRACE`.

        An entry whose lock another process holds (it is being written) is never removed, nor is anything
        that is not a regular file (reported in ``skipped``). Readwrite only.
        """
        self._require_writable("prune")
        now = time.time() if now is None else now
        report = PruneReport(dry_run=dry_run)
        entries = sorted(self.entries(), key=lambda e: (e.mtime, str(e.path)))  # oldest first
        total = sum(e.size for e in entries)
        victims: list[CacheEntryInfo] = []
        keep: list[CacheEntryInfo] = []
        for e in entries:
            if not e.regular:
                report.skipped.append((e, f"{e.error}; remove it by hand"))
                continue
            (victims if older_than is not None and now - e.mtime > older_than else keep).append(e)
        if max_size is not None:
            size_kept = sum(e.size for e in keep)
            while keep and size_kept > max_size:
                e = keep.pop(0)
                victims.append(e)
                size_kept -= e.size
        for e in victims:
            why = None if dry_run else self._remove_if_unlocked(e.path)
            if why is None:
                report.removed.append(e)
                report.freed_bytes += e.size
            elif why == _IN_USE:
                report.skipped_in_use.append(e)
            else:
                report.skipped.append((e, why))
        if not dry_run:
            report.stale_files_removed = self._remove_stale_files(now)
        report.remaining_bytes = total - report.freed_bytes
        report.remaining_entries = len(entries) - len(report.removed)
        return report

    def _require_writable(self, what: str) -> None:
        if self.mode is not CacheMode.READWRITE:
            raise CacheError(f"{what} writes to the cache, but the cache {self.root} is in {self.mode.value} "
                             f"mode; use mode readwrite (EXL3RT_CACHE_MODE=readwrite)")

    def _try_lock_now(self, entry: Path) -> Optional[filelock.BaseFileLock]:
        """The entry's lock if nobody holds it right now, else None; :class:`_UnsafePath` if it cannot be
        taken safely (a linked lock file, an unwritable directory)."""
        lock = self._lock(entry, 0)
        try:
            lock.acquire()
        except filelock.Timeout:
            return None
        except OSError as exc:
            raise _UnsafePath(self.lock_path(entry), f"cannot be locked ({_oserror_text(exc)})") from None
        return lock

    def _remove_if_unlocked(self, entry: Path) -> Optional[str]:
        """Delete the regular file ``entry`` (and its lock file) unless another process holds its lock.

        None when removed, else why not (:data:`_IN_USE` when the lock is held).
        """
        try:
            lock = self._try_lock_now(entry)
        except _UnsafePath as exc:
            return f"its lock {exc.path} {exc.reason}"
        if lock is None:
            return _IN_USE
        try:
            try:
                st = os.lstat(entry)
            except FileNotFoundError:
                return "already removed"
            if not stat.S_ISREG(st.st_mode):  # replaced since it was listed
                return f"now a {file_kind(st.st_mode)}; remove it by hand"
            removed = remove_quietly(entry)
            # Unlinking the lock file while holding it: a process already waiting on the old inode may then
            # run beside a newcomer; both publish atomically, so the worst case is one duplicated encode.
            remove_quietly(self.lock_path(entry))
            return None if removed else "already removed"
        finally:
            lock.release()

    def _remove_stale_files(self, now: Optional[float] = None) -> int:
        """Temporaries and lock files of entries nobody is writing (dead writers, failed encodes), and
        temporaries no entry lock protects once older than :data:`FOREIGN_TMP_GRACE`."""
        removed = 0
        now = time.time() if now is None else now
        for sub in self._fanout_dirs()[0]:
            for tmp in temp_files(sub):
                target = temp_target(tmp.name)
                if target is not None and target.endswith(SUFFIX) and not target.startswith("."):
                    try:  # ours: the entry's lock proves that no writer is live
                        lock = self._try_lock_now(sub / target)
                    except _UnsafePath:
                        continue
                    if lock is not None:
                        try:
                            removed += remove_quietly(tmp)
                        finally:
                            lock.release()
                else:
                    try:
                        old = now - os.lstat(tmp).st_mtime >= FOREIGN_TMP_GRACE
                    except OSError:
                        continue
                    if old:
                        removed += remove_quietly(tmp)
            for lk, st in self._scan(sub):
                if not (lk.name.endswith(SUFFIX + LOCK_SUFFIX) and stat.S_ISREG(st.st_mode)):
                    continue
                entry = lk.with_name(lk.name[: -len(LOCK_SUFFIX)])
                if os.path.lexists(entry):
                    continue
                try:
                    lock = self._try_lock_now(entry)
                except _UnsafePath:
                    continue
                if lock is not None:
                    try:
                        removed += remove_quietly(lk)
                    finally:
                        lock.release()
        return removed


def _place(enc: EncodedLinear, device: Union[str, torch.device], name: str) -> EncodedLinear:
    """``enc`` on ``device`` (no copy when it is already there), named ``name`` if it has no name."""
    if enc.trellis.device != torch.device(device):
        info = enc.info
        enc = enc.to(device)
        enc.info = info
    if name and not enc.name:
        enc.name = name
    return enc


def _oserror_text(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f": {exc.filename}" if exc.filename else ""
        return f"{name} {exc.strerror or ''}{where}".strip()
    return str(exc)
