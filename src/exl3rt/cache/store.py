"""EncodingCache: load an encoding from the cache or encode it, publish it, list/verify/prune entries.

Layout: ``<root>/v1/<digest[:2]>/<digest>.safetensors`` with ``<digest>.safetensors.lock`` beside it
(the per-entry lock) and, while a publish is in flight, ``.<digest>.safetensors.<random>.tmp``.

Concurrency: readers never lock (publication is an atomic rename, so a reader sees no file or a whole
one). A writer takes the entry's ``filelock`` (flock on Linux: released by the kernel when the holder
dies, even by SIGKILL), re-checks the entry (another process may have published it while we waited),
encodes, writes a temporary file in the same directory, fsyncs it, renames it onto the entry name and
fsyncs the directory. Temporary files left by a killed writer are removed by the next writer of that
entry (it holds the lock, so they cannot be live) and by ``exl3rt cache prune``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import filelock
import torch

from ..format.encoded import EncodedLinear
from ..format.errors import FormatError
from ..util.fs import atomic_path
from .config import CacheMode, parse_cache_mode, resolve_root
from .entry import (SUFFIX, CacheEntryInfo, check_encoding, entry_info, entry_payload, nonfinite_reason,
                    proxy_err_of, read_entry, remove_quietly, write_entry)
from .errors import CacheError, InvalidEntryError
from .key import SCHEMA, CacheKey

log = logging.getLogger(__name__)

LAYOUT = f"v{SCHEMA}"
LOCK_SUFFIX = ".lock"
TMP_SUFFIX = ".tmp"
DEFAULT_LOCK_TIMEOUT = 600.0


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


@dataclasses.dataclass
class PruneReport:
    """What :meth:`EncodingCache.prune` removed (or, with ``dry_run``, would remove)."""

    removed: list[CacheEntryInfo] = dataclasses.field(default_factory=list)
    skipped_in_use: list[CacheEntryInfo] = dataclasses.field(default_factory=list)
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


class EncodingCache:
    """Persistent, content-addressed store of encodings, keyed by :class:`CacheKey`.

    ``root`` defaults to ``EXL3RT_CACHE_DIR`` or ``$XDG_CACHE_HOME/exl3rt``; ``mode`` to
    ``EXL3RT_CACHE_MODE`` or ``readwrite``. A cache problem (unwritable directory, full disk, lock
    timeout, invalid entry) never stops a model from loading: the layer is encoded uncached and the
    problem is logged once per kind.
    """

    def __init__(self, root: Union[str, Path, None] = None, mode: Union[str, CacheMode, None] = None, *,
                 lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        self.root: Path = resolve_root(root)
        self.mode: CacheMode = parse_cache_mode(mode)
        self.lock_timeout = float(lock_timeout)
        self.stats = CacheStats()
        self._warned: set[str] = set()
        self._root_checked = False

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

    def _check_root_trust(self) -> None:
        if self._root_checked:
            return
        self._root_checked = True
        try:
            st = self.root.stat()
        except OSError:
            return
        loose = st.st_mode & 0o022
        foreign = hasattr(os, "geteuid") and st.st_uid not in (os.geteuid(), 0)
        if loose or foreign:
            self._warn(_TRUST, "encoding cache %s is %s: cached entries become model weights, so the directory "
                       "must be writable only by the serving user (chmod 700 it, or use EXL3RT_CACHE_DIR)",
                       self.root, "writable by group/others" if loose else f"owned by uid {st.st_uid}")

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
        path = self.path_for(key)

        if self.mode is CacheMode.OFF:
            enc = self._encode_checked(key, encode, label)
            return CacheResult(_place(enc, device, name), False, None, time.perf_counter() - t0)

        self._check_root_trust()
        status, loaded = self._try_read(path, key, label, refresh=self.mode is CacheMode.READWRITE)
        if loaded is not None:
            return CacheResult(_place(loaded, device, name), True, path, time.perf_counter() - t0)
        seen_invalid = status == "invalid"

        if self.mode is CacheMode.READONLY:
            self.stats.misses += 1
            enc = self._encode_checked(key, encode, label)
            self.stats.uncached += 1
            return CacheResult(_place(enc, device, name), False, None, time.perf_counter() - t0)

        # readwrite: lock, re-check, encode, publish
        lock = self._acquire(path, label)
        if lock is None:
            self.stats.misses += 1
            enc = self._encode_checked(key, encode, label)
            self.stats.uncached += 1
            return CacheResult(_place(enc, device, name), False, None, time.perf_counter() - t0)
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
            if not path.exists() and exc.reason.startswith("unreadable"):
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
                os.utime(path)
            except OSError:
                pass
        return "hit", loaded.encoded

    def _acquire(self, path: Path, label: str) -> Optional[filelock.BaseFileLock]:
        """Create the entry's directory and take its lock; None (after a warning) when impossible."""
        try:
            self._make_dirs(path.parent)
            lock = filelock.FileLock(str(self.lock_path(path)), timeout=self.lock_timeout)
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
        except OSError as exc:
            self._warn(_UNAVAILABLE, "encoding cache %s is unavailable (%s); encoding without caching. "
                       "Fix the directory's permissions, choose another with EXL3RT_CACHE_DIR, or set "
                       "EXL3RT_CACHE_MODE=readonly/off", self.root, _oserror_text(exc))
        return None

    def _make_dirs(self, directory: Path) -> None:
        """Create ``directory`` and parents below the root with mode 0700 (the root too)."""
        if directory.is_dir():
            return
        if not self.root.is_dir():
            self.root.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.root.mkdir(mode=0o700)
            except FileExistsError:
                pass
        for d in (self.entries_dir, directory):
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                pass

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
        removed = 0
        try:
            for tmp in path.parent.glob(f".{path.name}.*{TMP_SUFFIX}"):
                removed += remove_quietly(tmp)
        except OSError:
            pass
        return removed

    # ---- administration (exl3rt cache ...) ------------------------------------------------------
    def entries(self) -> Iterator[CacheEntryInfo]:
        """Every entry file under ``<root>/v1`` (header facts only), sorted by path."""
        base = self.entries_dir
        if not base.is_dir():
            return
        for sub in sorted(p for p in base.iterdir() if p.is_dir()):
            for f in sorted(sub.glob(f"*{SUFFIX}")):
                if f.name.startswith("."):
                    continue
                yield entry_info(f)

    def summary(self) -> dict[str, Any]:
        """Totals for ``exl3rt cache stats``: entries, bytes, unreadable headers, stray files."""
        n = size = bad = 0
        oldest: Optional[float] = None
        newest: Optional[float] = None
        for e in self.entries():
            n += 1
            size += e.size
            bad += e.error is not None
            oldest = e.mtime if oldest is None else min(oldest, e.mtime)
            newest = e.mtime if newest is None else max(newest, e.mtime)
        temps = locks = 0
        if self.entries_dir.is_dir():
            for sub in self.entries_dir.iterdir():
                if sub.is_dir():
                    temps += sum(1 for _ in sub.glob(f".*{TMP_SUFFIX}"))
                    locks += sum(1 for _ in sub.glob(f"*{LOCK_SUFFIX}"))
        return {"root": str(self.root), "layout": LAYOUT, "mode": self.mode.value, "entries": n, "bytes": size,
                "unreadable_headers": bad, "temporary_files": temps, "lock_files": locks,
                "oldest_mtime": oldest, "newest_mtime": newest}

    def verify(self, *, delete_invalid: bool = False) -> list[VerifyResult]:
        """Fully re-validate every entry against the key stored in it (and its file name).

        With ``delete_invalid`` (readwrite only), invalid entries are removed under their lock; an entry
        whose lock is held (being written) is never deleted.
        """
        if delete_invalid:
            self._require_writable("verify --delete-invalid")
        results = []
        for info in self.entries():
            try:
                read_entry(info.path, None)
                results.append(VerifyResult(info, True))
                continue
            except InvalidEntryError as exc:
                res = VerifyResult(info, False, exc.reason)
            if delete_invalid:
                res.deleted = self._remove_if_unlocked(info.path)
            results.append(res)
        return results

    def prune(self, older_than: Optional[float] = None, max_size: Optional[int] = None, *,
              dry_run: bool = False, now: Optional[float] = None) -> PruneReport:
        """Remove entries unused for ``older_than`` seconds, then the least recently used ones until the
        total is at most ``max_size`` bytes. Also removes temporaries and lock files of dead writers.

        An entry whose lock another process holds (it is being written) is never removed. Readwrite only.
        """
        self._require_writable("prune")
        now = time.time() if now is None else now
        report = PruneReport(dry_run=dry_run)
        entries = sorted(self.entries(), key=lambda e: (e.mtime, str(e.path)))  # oldest first
        total = sum(e.size for e in entries)
        victims: list[CacheEntryInfo] = []
        keep: list[CacheEntryInfo] = []
        for e in entries:
            (victims if older_than is not None and now - e.mtime > older_than else keep).append(e)
        if max_size is not None:
            size_kept = sum(e.size for e in keep)
            while keep and size_kept > max_size:
                e = keep.pop(0)
                victims.append(e)
                size_kept -= e.size
        for e in victims:
            if dry_run:
                report.removed.append(e)
                report.freed_bytes += e.size
            elif self._remove_if_unlocked(e.path):
                report.removed.append(e)
                report.freed_bytes += e.size
            else:
                report.skipped_in_use.append(e)
        if not dry_run:
            report.stale_files_removed = self._remove_stale_files()
        report.remaining_bytes = total - report.freed_bytes
        report.remaining_entries = len(entries) - len(report.removed)
        return report

    def _require_writable(self, what: str) -> None:
        if self.mode is not CacheMode.READWRITE:
            raise CacheError(f"{what} writes to the cache, but the cache {self.root} is in {self.mode.value} "
                             f"mode; use mode readwrite (EXL3RT_CACHE_MODE=readwrite)")

    def _try_lock_now(self, entry: Path) -> Optional[filelock.BaseFileLock]:
        """The entry's lock if nobody holds it right now, else None."""
        lock = filelock.FileLock(str(self.lock_path(entry)), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            return None
        return lock

    def _remove_if_unlocked(self, entry: Path) -> bool:
        """Delete ``entry`` (and its lock file) unless another process holds its lock."""
        lock = self._try_lock_now(entry)
        if lock is None:
            return False
        try:
            removed = remove_quietly(entry)
            # Unlinking the lock file while holding it: a process already waiting on the old inode may then
            # run beside a newcomer; both publish atomically, so the worst case is one duplicated encode.
            remove_quietly(self.lock_path(entry))
            return removed
        finally:
            lock.release()

    def _remove_stale_files(self) -> int:
        """Temporaries and lock files of entries nobody is writing (dead writers, failed encodes)."""
        removed = 0
        if not self.entries_dir.is_dir():
            return 0
        for sub in self.entries_dir.iterdir():
            if not sub.is_dir():
                continue
            for tmp in sub.glob(f".*{SUFFIX}.*{TMP_SUFFIX}"):
                entry = sub / tmp.name[1:].split(SUFFIX, 1)[0]
                entry = entry.with_name(entry.name + SUFFIX)
                lock = self._try_lock_now(entry)
                if lock is not None:
                    try:
                        removed += remove_quietly(tmp)
                    finally:
                        lock.release()
            for lk in sub.glob(f"*{SUFFIX}{LOCK_SUFFIX}"):
                entry = lk.with_name(lk.name[: -len(LOCK_SUFFIX)])
                if entry.exists():
                    continue
                lock = self._try_lock_now(entry)
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
