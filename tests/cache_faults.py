"""A fault campaign against the encoding cache: concurrent and killed writers, and corrupted entries.

Each function runs one part at a given scale and returns counts; ``tests/test_fault_campaign.py`` runs them
small and asserts the invariants, ``benchmarks/fault_campaign.py`` runs them large and prints the figures
that docs/cache.md records. The invariants:

- writers: after any mix of concurrent, slow and SIGKILLed writers, every entry validates, every key that
  a surviving writer asked for is present, and each entry holds exactly the encoding made for its key
  (no torn file, no entry of another key);
- kills during a publish: no entry appears, the torn temporary is counted by ``summary()``, and the next
  writer of the entry or ``prune`` removes it;
- corruptions: a corrupted entry is either refused by ``read_entry`` (with a reason, never another
  exception) or, when the corruption left the stored tensors as they were, accepted with the original
  tensors; an entry that validates but holds other weights is the one outcome that must never occur; a
  readonly load of a corrupted entry changes nothing on disk.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
import shutil
import signal
import struct
import time
from pathlib import Path
from typing import Optional

import torch

from exl3rt.cache import CacheKey, EncodingCache, read_entry
from exl3rt.cache.errors import InvalidEntryError
from exl3rt.format.random import random_linear

IN, OUT, K = 128, 256, 2


def source_weight(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(OUT, IN, generator=g).to(torch.bfloat16)


def key_of(i: int) -> CacheKey:
    return CacheKey.for_weight(source_weight(i), bits=K)


def encoding_of(i: int):
    """The one encoding every writer makes for key ``i`` (so a wrong entry is visible)."""
    enc = random_linear(IN, OUT, K, seed=i)
    enc.info = {"proxy_err": 0.01 * (i + 1)}
    return enc


def same(a, b) -> bool:
    return torch.equal(a.trellis, b.trellis) and torch.equal(a.suh, b.suh) and torch.equal(a.svh, b.svh)


# --------------------------------------------------------------------------------------------- writers
def _writer(root: str, keys: list[int], seed: int, slow: float) -> None:
    rnd = random.Random(seed)
    cache = EncodingCache(root, "readwrite", lock_timeout=120)
    order = list(keys)
    rnd.shuffle(order)
    for i in order:
        def encode(i=i):
            time.sleep(rnd.random() * slow)
            return encoding_of(i)
        res = cache.load_or_encode(key_of(i), encode, name=f"layer{i}")
        assert same(res.encoded, encoding_of(i)), f"writer {seed} got a wrong encoding for key {i}"


_CONTEXT = None


def context():
    """Children fork from a server that imported exl3rt and torch once (and never ran a torch thread)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["cache_faults"])
    return _CONTEXT


@dataclasses.dataclass
class WriterReport:
    runs: int = 0
    writers: int = 0
    killed: int = 0
    failed_writers: int = 0      # a surviving writer that raised (a wrong encoding, a crash)
    entries: int = 0
    invalid_entries: int = 0
    wrong_entries: int = 0       # validates, but holds another key's or a torn encoding
    missing: int = 0             # a key a surviving writer asked for has no entry
    leftovers_after_prune: int = 0


def concurrent_writers(root: Path, *, runs: int, writers: int, keys: int, kill_fraction: float,
                       seed: int = 0, slow: float = 0.05) -> WriterReport:
    """``runs`` rounds of ``writers`` processes on the same ``keys`` keys; about ``kill_fraction`` of them
    are SIGKILLed at a random moment."""
    rep = WriterReport()
    rnd = random.Random(seed)
    ctx = context()
    for r in range(runs):
        rdir = root / f"run{r}"
        procs = [ctx.Process(target=_writer, args=(str(rdir), list(range(keys)), seed * 1000 + r * 100 + w, slow))
                 for w in range(writers)]
        victims = {w for w in range(writers) if rnd.random() < kill_fraction}
        for p in procs:
            p.start()
        deadline = time.monotonic() + rnd.random() * slow * keys
        for w in sorted(victims):
            time.sleep(max(0.0, deadline - time.monotonic()) * rnd.random())
            try:
                os.kill(procs[w].pid, signal.SIGKILL)
            except ProcessLookupError:   # it finished first
                pass
        for w, p in enumerate(procs):
            p.join(300)
            rep.writers += 1
            if p.exitcode == -signal.SIGKILL:
                rep.killed += 1
            elif p.exitcode != 0:
                rep.failed_writers += 1
        cache = EncodingCache(rdir, "readwrite")
        survivors = len(procs) - sum(p.exitcode == -signal.SIGKILL for p in procs)
        for i in range(keys):
            path = cache.path_for(key_of(i))
            if not path.exists():
                rep.missing += survivors > 0
                continue
            rep.entries += 1
            try:
                got = read_entry(path, key_of(i)).encoded
            except InvalidEntryError:
                rep.invalid_entries += 1
                continue
            rep.wrong_entries += not same(got, encoding_of(i))
        cache.prune()
        rep.leftovers_after_prune += cache.summary()["temporary_files"]
        rep.runs += 1
    return rep


# ------------------------------------------------------------------------------------ kill mid-publish
class _PausingCache(EncodingCache):
    def __init__(self, *a, flag: str, **k):
        super().__init__(*a, **k)
        self.flag = flag

    def _write_entry(self, tmp, tensors, metadata):
        super()._write_entry(tmp, tensors, metadata)
        with open(tmp, "r+b") as f:   # a torn temporary, as a kill during the write leaves it
            f.truncate(os.path.getsize(tmp) // 2)
        Path(self.flag).touch()
        time.sleep(600)


def _paused_writer(root: str, i: int, flag: str) -> None:
    _PausingCache(root, "readwrite", flag=flag).load_or_encode(key_of(i), lambda: encoding_of(i))


@dataclasses.dataclass
class PublishKillReport:
    kills: int = 0
    entries_after_kill: int = 0          # must be 0: nothing that could validate
    temporaries_counted: int = 0         # summary() saw the torn temporary
    cleaned_by_next_writer: int = 0
    cleaned_by_prune: int = 0
    published_after: int = 0


def kills_during_publish(root: Path, *, kills: int) -> PublishKillReport:
    """Kill a writer with its temporary half written; alternate who cleans up: the next writer, or prune."""
    rep = PublishKillReport()
    ctx = context()
    for n in range(kills):
        rdir, flag = root / f"kill{n}", root / f"paused{n}"
        p = ctx.Process(target=_paused_writer, args=(str(rdir), n, str(flag)))
        p.start()
        deadline = time.monotonic() + 120
        while not flag.exists() and time.monotonic() < deadline and p.is_alive():
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
        rep.kills += 1
        cache = EncodingCache(rdir, "readwrite", lock_timeout=60)
        rep.entries_after_kill += len(list(cache.entries()))
        rep.temporaries_counted += cache.summary()["temporary_files"] >= 1
        if n % 2 == 0:
            res = cache.load_or_encode(key_of(n), lambda: encoding_of(n))
            rep.published_after += res.path is not None and same(read_entry(res.path, key_of(n)).encoded, encoding_of(n))
            rep.cleaned_by_next_writer += cache.summary()["temporary_files"] == 0
        else:
            cache.prune()
            rep.cleaned_by_prune += cache.summary()["temporary_files"] == 0
    return rep


# --------------------------------------------------------------------------------------------- corruptions
def _header_len(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def _edit_metadata(data: bytes, rnd: random.Random) -> bytes:
    n = _header_len(data)
    header = json.loads(data[8:n])
    meta = header["__metadata__"]
    field = rnd.choice(sorted(meta))
    choice = rnd.random()
    if choice < 0.3:
        meta[field] = rnd.choice(["", "0", "1", "-1", "nan", "inf", "1e999", "x", "[]", "{}", "null", "3.5", "16"])
    elif choice < 0.5:
        meta[field] = "[" * rnd.choice([50, 1000, 100_000]) + "]" * 3
    elif choice < 0.7:
        meta.pop(field)
    else:
        meta[field] = meta[field][:-1] + ("0" if not meta[field].endswith("0") else "1") if meta[field] else "1"
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[n:]


def corrupt(data: bytes, rnd: random.Random) -> tuple[str, bytes]:
    """One random corruption of an entry's bytes: (kind, new bytes)."""
    n = _header_len(data)
    kind = rnd.choice(["flip-byte", "flip-tensor-bit", "flip-header-byte", "truncate", "append", "metadata",
                       "zero-run", "swap-halves"])
    b = bytearray(data)
    if kind == "flip-byte":
        i = rnd.randrange(len(b))
        b[i] ^= rnd.randrange(1, 256)
    elif kind == "flip-tensor-bit":
        i = rnd.randrange(n, len(b))
        b[i] ^= 1 << rnd.randrange(8)
    elif kind == "flip-header-byte":
        i = rnd.randrange(n)
        b[i] ^= rnd.randrange(1, 256)
    elif kind == "truncate":
        b = b[: rnd.randrange(len(b))]
    elif kind == "append":
        b += bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 64)))
    elif kind == "metadata":
        return kind, _edit_metadata(data, rnd)
    elif kind == "zero-run":
        i = rnd.randrange(len(b))
        j = min(len(b), i + rnd.randint(1, 4096))
        b[i:j] = bytes(j - i)
    else:
        h = n + (len(b) - n) // 2
        b = b[:n] + b[h:] + b[n:h]
    return kind, bytes(b)


@dataclasses.dataclass
class CorruptionReport:
    tried: int = 0
    unchanged: int = 0           # the corruption happened to leave the bytes as they were
    detected: int = 0
    accepted_same_tensors: int = 0
    wrong_weights: int = 0       # must be 0
    crashes: int = 0             # an exception other than InvalidEntryError: must be 0
    readonly_changed_disk: int = 0
    by_kind: dict = dataclasses.field(default_factory=dict)
    crash_examples: list = dataclasses.field(default_factory=list)


def corruptions(root: Path, *, count: int, seed: int = 0, readonly_every: int = 10) -> CorruptionReport:
    """``count`` corruptions of a valid entry, each read back by ``read_entry``; every ``readonly_every``-th
    also loaded through a readonly cache (which must leave the disk as it was)."""
    rep = CorruptionReport()
    rnd = random.Random(seed)
    cache = EncodingCache(root / "c", "readwrite")
    key = key_of(0)
    path = cache.load_or_encode(key, lambda: encoding_of(0)).path
    original = path.read_bytes()
    truth = encoding_of(0)
    for t in range(count):
        kind, data = corrupt(original, rnd)
        rep.tried += 1
        stats = rep.by_kind.setdefault(kind, {"tried": 0, "detected": 0, "accepted": 0})
        stats["tried"] += 1
        if data == original:
            rep.unchanged += 1
            continue
        path.write_bytes(data)
        try:
            got = read_entry(path, key).encoded
        except InvalidEntryError:
            rep.detected += 1
            stats["detected"] += 1
        except Exception as exc:  # noqa: BLE001 - counted: any other exception is a defect
            rep.crashes += 1
            if len(rep.crash_examples) < 5:
                rep.crash_examples.append(f"{kind}: {type(exc).__name__}: {exc}"[:200])
        else:
            stats["accepted"] += 1
            if same(got, truth):
                rep.accepted_same_tensors += 1
            else:
                rep.wrong_weights += 1
        if readonly_every and t % readonly_every == 0:
            before = _snapshot(cache.root)
            try:
                EncodingCache(cache.root, "readonly").load_or_encode(key, lambda: encoding_of(0))
            except Exception as exc:  # noqa: BLE001
                rep.crashes += 1
                if len(rep.crash_examples) < 5:
                    rep.crash_examples.append(f"readonly load after {kind}: {type(exc).__name__}: {exc}"[:200])
            rep.readonly_changed_disk += _snapshot(cache.root) != before
    path.write_bytes(original)
    return rep


def _snapshot(root: Path) -> dict[str, Optional[bytes]]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(root.rglob("*"))}


def clean(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
