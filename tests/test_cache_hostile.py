"""The encoding cache against hostile trees and crashes: temporaries of killed writers, symbolic links and
non-files below the root, loose permissions, deeply nested or edited metadata.

Whatever is planted, the cache must never read, write or delete through a link below its root, never
crash a walk, and treat a bad entry as invalid with a one-line reason.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from exl3rt.cache import CacheError, CacheKey, EncodingCache, InvalidEntryError, read_entry
from exl3rt.cache.entry import METADATA_FIELDS, entry_info, read_header, write_entry
from exl3rt.cache.key import SCHEMA
from exl3rt.util.safejson import loads_bounded
from exl3rt.cache.store import FOREIGN_TMP_GRACE, LOCK_MODE
from exl3rt.cli.main import main
from exl3rt.format.encoded import EncodedLinear
from exl3rt.format.random import random_linear
from exl3rt.util.fs import is_temp_name, temp_target
from exl3rt.util.safetensors_io import write_safetensors

IN, OUT, K = 128, 256, 2
DEEP = 100_000  # nesting levels of the hostile JSON (json.loads recurses once per level)
TRUST = "writable only by the serving user"


def weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def key_of(seed: int = 0) -> CacheKey:
    return CacheKey.for_weight(weight(seed), bits=K)


class FakeEncode:
    """A counting encode: a random valid linear with a proxy error."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> EncodedLinear:
        self.calls += 1
        enc = random_linear(IN, OUT, K, "mcg", seed=self.calls)
        enc.info = {"proxy_err": 0.125}
        return enc


def publish(root: Path, *seeds: int) -> list[Path]:
    cache = EncodingCache(root, "readwrite")
    return [cache.load_or_encode(key_of(s), FakeEncode()).path for s in seeds]


def snapshot(top: Path) -> dict[str, tuple]:
    """Every name below ``top`` (links not followed): its type, bytes (files), link target, mode, mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            out[str(p.relative_to(top))] = (stat.S_IFMT(st.st_mode), data, st.st_mode & 0o7777, st.st_mtime_ns)
    return out


def rewrite(path: Path, edit) -> None:
    """Re-write the entry at ``path`` with the same tensors and ``edit(metadata)`` applied."""
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    edit(meta)
    tmp = path.with_name(path.name + ".new")  # not in place: loaded tensors may map the old file
    write_safetensors(tmp, tensors, meta)
    os.replace(tmp, path)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["cache", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def warnings_with(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# --------------------------------------------------------------------------------------------- temporaries
def test_write_entry_writes_only_the_path_it_is_given(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    fd, tmp = tempfile.mkstemp(prefix=".x.safetensors.", suffix=".tmp", dir=d)  # as atomic_path makes it
    os.close(fd)
    before = os.stat(tmp)
    enc = random_linear(IN, OUT, K)
    tensors = {"trellis": enc.trellis, "suh": enc.suh, "svh": enc.svh}
    write_entry(Path(tmp), tensors, {"a": "1"})
    after = os.stat(tmp)
    assert os.listdir(d) == [os.path.basename(tmp)]         # no temporary of its own left or renamed over
    assert (after.st_ino, after.st_mode & 0o777) == (before.st_ino, 0o600)  # written in place, still private
    with safe_open(tmp, "pt") as f:
        assert f.metadata() == {"a": "1"} and torch.equal(f.get_tensor("trellis"), enc.trellis)


CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    from exl3rt.cache import EncodingCache
    from exl3rt.format.random import random_linear

    root, work = sys.argv[1], Path(sys.argv[2])
    w = (torch.arange(256 * 128, dtype=torch.float32).reshape(256, 128) / 1000).to(torch.bfloat16)

    class PausingCache(EncodingCache):
        def _write_entry(self, tmp, tensors, metadata):
            super()._write_entry(tmp, tensors, metadata)
            with open(tmp, "r+b") as f:   # half written when the kill comes
                f.truncate(os.path.getsize(tmp) // 2)
            (work / "paused").touch()
            time.sleep(600)

    cache = PausingCache(root, "readwrite")
    cache.load_or_encode(cache.key_for_weight(w, bits=2), lambda: random_linear(128, 256, 2))
""")


def _child_key() -> CacheKey:
    w = (torch.arange(256 * 128, dtype=torch.float32).reshape(256, 128) / 1000).to(torch.bfloat16)
    return CacheKey.for_weight(w, bits=2)


def _kill_mid_publish(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    exec_env = {k: v for k, v in os.environ.items() if not k.startswith("EXL3RT_CACHE")}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache"), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=exec_env)
    try:
        while not (tmp_path / "paused").exists():
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("cleaner", ["prune", "next-writer"])
def test_sigkill_mid_publish_leftover_is_counted_and_cleaned(tmp_path, cleaner):
    _kill_mid_publish(tmp_path)
    key = _child_key()
    cache = EncodingCache(tmp_path / "cache", "readwrite", lock_timeout=60)
    path = cache.path_for(key)
    names = sorted(os.listdir(path.parent))
    # the entry's lock and our own temporary, nothing else (no safetensors-style .tmpXXXXXX)
    [tmp] = [n for n in names if n != path.name + ".lock"]
    assert is_temp_name(tmp) and temp_target(tmp) == path.name and not path.exists()
    assert cache.summary()["temporary_files"] == 1
    if cleaner == "prune":
        rep = cache.prune()
        assert rep.stale_files_removed == 2 and os.listdir(path.parent) == []  # temporary and orphan lock
    else:
        enc = FakeEncode()
        res = cache.load_or_encode(key, enc)
        assert (res.hit, res.path, enc.calls) == (False, path, 1)
        assert sorted(os.listdir(path.parent)) == [path.name, path.name + ".lock"]
    assert cache.summary()["temporary_files"] == 0


def test_safetensors_style_temporaries_are_pruned_after_a_grace_period(tmp_path):
    [entry] = publish(tmp_path / "cache", 0)
    cache = EncodingCache(tmp_path / "cache", "readwrite")
    old, fresh = entry.parent / ".tmpAbC123", entry.parent / ".tmpXyZ789"
    old.write_bytes(b"left by save_file in an older exl3rt")
    fresh.write_bytes(b"maybe being written right now")
    t = time.time() - FOREIGN_TMP_GRACE - 60
    os.utime(old, (t, t))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.utime(victim, (t, t))
    (entry.parent / ".tmpLnK456").symlink_to(victim)  # named like a temporary, but a link: never touched
    assert cache.summary()["temporary_files"] == 2
    rep = cache.prune()
    assert not old.exists() and fresh.exists() and rep.stale_files_removed == 1 and entry.exists()
    assert victim.read_bytes() == b"precious" and (entry.parent / ".tmpLnK456").is_symlink()
    assert cache.summary()["temporary_files"] == 1


# --------------------------------------------------------------------------------------------- walks
def test_symlinked_fanout_dir_is_never_followed(tmp_path, capsys, caplog):
    root = tmp_path / "cache"
    mine = publish(root, 0, 1)
    # an entry made elsewhere, its fan-out directory moved outside the root and linked in
    [theirs] = publish(tmp_path / "other", 2)
    assert theirs.parent.name not in {p.parent.name for p in mine}
    outside = tmp_path / "outside"
    theirs.parent.rename(outside)
    shutil.copy(outside / theirs.name, outside / ("f" * 64 + ".safetensors"))  # invalid: name != digest
    (outside / ".tmpAbC123").write_bytes(b"old")
    (outside / f".{theirs.name}.abcdef12.tmp").write_bytes(b"dead writer?")
    t = time.time() - 10 * 86400
    for p in outside.iterdir():
        os.utime(p, (t, t))
    link = root / "v1" / theirs.parent.name
    link.symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)

    status, out, _ = cli(capsys, "verify", "--root", str(root), "--delete-invalid")
    assert status == 0 and "2 of 2 entries valid" in out
    status, out, _ = cli(capsys, "ls", "--root", str(root))
    assert status == 0 and theirs.name[:16] not in out and "2 entries" in out
    status, out, _ = cli(capsys, "stats", "--root", str(root), "--json")
    s = json.loads(out)
    assert (status, s["entries"], s["links_not_followed"], s["temporary_files"]) == (0, 2, 1, 0)
    status, out, _ = cli(capsys, "prune", "--root", str(root), "--max-size", "0")
    assert status == 0 and "removed 2 entries" in out and not any(p.exists() for p in mine)
    assert snapshot(outside) == before and link.is_symlink()

    assert warnings_with(caplog, f"{link} is a symbolic link")  # the walks said so
    caplog.clear()
    # loading through the link: neither read (it is valid!) nor written; encoded uncached, one warning
    for mode in ("readwrite", "readonly"):
        enc = FakeEncode()
        with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
            res = EncodingCache(root, mode).load_or_encode(CacheKey.for_weight(weight(2), bits=K), enc)
        assert (res.hit, res.path, enc.calls) == (False, None, 1)
    assert len(warnings_with(caplog, f"{link} is a symbolic link")) == 2  # once per cache object
    assert snapshot(outside) == before


def test_symlinked_v1_is_never_followed(tmp_path, capsys, caplog):
    [theirs] = publish(tmp_path / "other", 0)
    outside = tmp_path / "outside"
    (tmp_path / "other" / "v1").rename(outside)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    (root / "v1").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    status, out, _ = cli(capsys, "stats", "--root", str(root), "--json")
    s = json.loads(out)
    assert (status, s["entries"], s["links_not_followed"]) == (0, 0, 1)
    assert cli(capsys, "prune", "--root", str(root), "--max-size", "0")[0] == 0
    assert cli(capsys, "verify", "--root", str(root), "--delete-invalid")[0] == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        cache = EncodingCache(root, "readwrite")
        results = [cache.load_or_encode(key_of(s), FakeEncode()) for s in (0, 5)]  # a hit there, a new fan-out
    assert [(r.hit, r.path) for r in results] == [(False, None)] * 2
    assert len(warnings_with(caplog, "is a symbolic link")) == 1
    assert snapshot(outside) == before  # no entry, lock or fan-out directory created through the link


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_non_file_named_like_an_entry_is_reported_and_kept(tmp_path, capsys, kind):
    root = tmp_path / "cache"
    good, bad = publish(root, 0, 1)
    odd = good.parent / ("0" * 64 + ".safetensors")   # sorts before the real entries of its directory
    if kind == "directory":
        odd.mkdir()
        (odd / "inside").write_bytes(b"not ours")
    else:
        os.mkfifo(odd)
    data = bytearray(bad.read_bytes())
    data[-1000] ^= 0x10
    bad.write_bytes(bytes(data))

    status, out, err = cli(capsys, "verify", "--root", str(root))
    assert status == 1 and f"INVALID {odd}: not a regular file ({kind})" in out and "Traceback" not in err
    assert f"INVALID {bad}: payload digest mismatch" in out and "1 of 3 entries valid" in out
    status, out, _ = cli(capsys, "verify", "--root", str(root), "--delete-invalid")
    assert status == 1 and f"{bad}: payload digest mismatch" in out and "(deleted)" in out
    assert "(kept: not a regular file; remove it by hand)" in out and not bad.exists() and os.path.lexists(odd)
    status, out, _ = cli(capsys, "ls", "--root", str(root))
    assert status == 0 and f"BAD: not a regular file ({kind})" in out
    s = json.loads(cli(capsys, "stats", "--root", str(root), "--json")[1])
    assert (s["entries"], s["not_regular_files"], s["unreadable_headers"]) == (2, 1, 1)
    status, out, _ = cli(capsys, "prune", "--root", str(root), "--max-size", "0")
    assert status == 0 and f"kept {odd}: not a regular file ({kind})" in out and "removed 1 entries" in out
    assert not good.exists() and os.path.lexists(odd)
    if kind == "directory":
        assert (odd / "inside").read_bytes() == b"not ours"


def test_linked_entry_and_lock_files_are_never_followed(tmp_path, capsys, caplog):
    root = tmp_path / "cache"
    [entry] = publish(root, 0)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "entry-copy"
    shutil.copy(entry, target)
    entry.unlink()
    entry.symlink_to(target)                           # a valid entry, but behind a link
    key1 = key_of(1)
    cache = EncodingCache(root, "readwrite")
    lock1 = cache.lock_path(cache.path_for(key1))
    lock1.parent.mkdir(parents=True, exist_ok=True)
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    os.chmod(victim, 0o644)
    lock1.symlink_to(victim)                            # a lock file that leads outside
    before = snapshot(outside)

    [res] = cache.verify(delete_invalid=True)
    assert (res.ok, res.reason, res.deleted) == (False, "not a regular file (symbolic link)", False)
    assert cli(capsys, "prune", "--root", str(root), "--max-size", "0")[0] == 0
    assert entry.is_symlink() and lock1.is_symlink() and snapshot(outside) == before

    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        ro = EncodingCache(root, "readonly").load_or_encode(key_of(0), FakeEncode())
        enc = FakeEncode()
        rw = EncodingCache(root, "readwrite").load_or_encode(key_of(0), enc)
        locked = EncodingCache(root, "readwrite").load_or_encode(key1, FakeEncode())
    assert (ro.hit, ro.path) == (False, None)
    assert (rw.hit, rw.path, enc.calls) == (False, entry, 1) and not entry.is_symlink()  # the link was replaced
    assert read_entry(entry, key_of(0)).encoded is not None
    assert (locked.hit, locked.path) == (False, None) and warnings_with(caplog, f"{lock1} is a symbolic link")
    assert snapshot(outside) == before


def test_root_may_be_a_symlink(tmp_path, capsys):
    real = tmp_path / "big-disk"
    real.mkdir(mode=0o700)
    root = tmp_path / "cache"
    root.symlink_to(real, target_is_directory=True)
    enc = FakeEncode()
    assert not EncodingCache(root, "readwrite").load_or_encode(key_of(0), enc).hit
    res = EncodingCache(root, "readwrite").load_or_encode(key_of(0), enc)
    assert res.hit and enc.calls == 1 and res.path.resolve().is_relative_to(real)
    assert json.loads(cli(capsys, "stats", "--root", str(root), "--json")[1])["entries"] == 1
    assert cli(capsys, "verify", "--root", str(root))[0] == 0
    assert cli(capsys, "prune", "--root", str(root), "--max-size", "0")[0] == 0
    assert list(EncodingCache(root, "readwrite").entries()) == []


# --------------------------------------------------------------------------------------------- trust
@pytest.mark.parametrize("which", ["v1", "fanout"])
def test_loose_directories_below_the_root_warn(tmp_path, caplog, which):
    [entry] = publish(tmp_path / "cache", 0)
    loose = entry.parent.parent if which == "v1" else entry.parent
    os.chmod(loose, 0o777)
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        res = EncodingCache(tmp_path / "cache", "readwrite").load_or_encode(key_of(0), FakeEncode())
    assert res.hit
    [msg] = warnings_with(caplog, TRUST)
    assert f"directory {loose} is writable by group/others" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        EncodingCache(tmp_path / "cache", "readwrite").summary()   # the walks check it too
    assert len(warnings_with(caplog, str(loose))) == 1


def test_trust_is_checked_once_per_directory_and_cache_object(tmp_path, caplog):
    [entry] = publish(tmp_path / "cache", 0)
    cache = EncodingCache(tmp_path / "cache", "readwrite")
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        assert cache.load_or_encode(key_of(0), FakeEncode()).hit
        os.chmod(entry.parent, 0o777)                 # loosened after this object checked it
        assert cache.load_or_encode(key_of(0), FakeEncode()).hit
        assert not warnings_with(caplog, TRUST)
        EncodingCache(tmp_path / "cache", "readwrite").load_or_encode(key_of(0), FakeEncode())
    assert len(warnings_with(caplog, TRUST)) == 1


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_directory_owned_by_another_user_warns(tmp_path, caplog):
    [entry] = publish(tmp_path / "cache", 0)
    os.chown(entry.parent, 4242, 4242)
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        EncodingCache(tmp_path / "cache", "readwrite").load_or_encode(key_of(0), FakeEncode())
    [msg] = warnings_with(caplog, TRUST)
    assert f"{entry.parent} is owned by uid 4242" in msg


# --------------------------------------------------------------------------------------------- bounded JSON
def test_bounded_json_checks_depth_and_size_before_parsing():
    assert loads_bounded("[" * 8 + "]" * 8, max_bytes=100) == [[[[[[[[]]]]]]]]
    with pytest.raises(ValueError, match="nested deeper than 8 levels"):
        loads_bounded("[" * 9 + "]" * 9, max_bytes=100)
    with pytest.raises(ValueError, match="nested deeper than 8 levels"):
        loads_bounded("[" * DEEP + "]" * DEEP, max_bytes=1 << 20)   # not a RecursionError
    with pytest.raises(ValueError, match="nested deeper than 8 levels"):
        loads_bounded('{"a":' * DEEP + "1" + "}" * DEEP, max_bytes=1 << 20)
    # brackets inside strings (escaped quotes included) do not nest
    assert loads_bounded('{"a": "[[[[[[[[[[\\"[[[[[[[[["}', max_bytes=100) == {"a": '[[[[[[[[[["[[[[[[[[['}
    with pytest.raises(ValueError, match="more than the limit"):
        loads_bounded('"' + "x" * 100 + '"', max_bytes=50)
    for bad, why in [('{"a": 1, "a": 2}', "duplicate object key"), ("[NaN]", "NaN"), ('"open', "not JSON"),
                     (b"\xff", "not UTF-8")]:
        with pytest.raises(ValueError, match=why):
            loads_bounded(bad, max_bytes=100)


def _deep_header(path: Path) -> None:
    """Put a nested array DEEP levels down into the safetensors header itself (beside the tensors)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = b'{"x":' + b"[" * DEEP + b"]" * DEEP + b"," + data[8:8 + n].lstrip()[1:]
    path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n:])


def _deep_key(levels: int):
    return lambda p: rewrite(p, lambda m: m.update(key="[" * levels + "]" * levels))


def _deep_info(levels: int):
    return lambda p: rewrite(p, lambda m: m.update(info='{"a":' * levels + "1" + "}" * levels))


# 100,000 levels of key or info exceed the field's size bound; 5,000 fit it (and still make json.loads
# recurse past Python's limit), so the depth bound rejects them
DEEP_EDITS = {"key-100k": _deep_key(DEEP), "key-5k": _deep_key(5000), "info-100k": _deep_info(DEEP),
              "info-5k": _deep_info(5000), "header-100k": _deep_header}
BOUND = r"nested deeper than 8 levels|more than the limit of"


@pytest.mark.parametrize("where", sorted(DEEP_EDITS))
def test_deeply_nested_metadata_is_an_invalid_entry(tmp_path, capsys, caplog, where):
    root = tmp_path / "cache"
    [path] = publish(root, 0)
    DEEP_EDITS[where](path)
    crafted = path.read_bytes()
    [res] = EncodingCache(root, "readwrite").verify()
    assert not res.ok and re.search(BOUND, res.reason) and where.split("-")[0] in res.reason
    status, out, err = cli(capsys, "verify", "--root", str(root))
    assert status == 1 and f"INVALID {path}: {res.reason}" in out and "Traceback" not in err
    status, out, err = cli(capsys, "ls", "--root", str(root))
    assert status == 0 and f"BAD: {res.reason}" in out
    [row] = json.loads(cli(capsys, "ls", "--root", str(root), "--json")[1])
    assert row["error"] == res.reason
    assert json.loads(cli(capsys, "stats", "--root", str(root), "--json")[1])["unreadable_headers"] == 1

    enc = FakeEncode()
    res = EncodingCache(root, "readonly").load_or_encode(key_of(0), enc)
    assert (res.hit, res.path, enc.calls) == (False, None, 1) and path.read_bytes() == crafted
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        res = EncodingCache(root, "readwrite").load_or_encode(key_of(0), enc, name="layers.0.q_proj")
    assert (res.hit, res.path, enc.calls) == (False, path, 2)
    assert warnings_with(caplog, "invalid encoding cache entry for layers.0.q_proj")
    assert read_entry(path, key_of(0)).encoded is not None and read_entry(path).encoded is not None


# --------------------------------------------------------------------------------------------- every field
def _pretty_key(m: dict) -> None:
    m["key"] = json.dumps(json.loads(m["key"]), indent=1)  # the same key, not in canonical form


FIELD_EDITS = {
    "format": lambda m: m.update(format="exl3rt-encoding-cache-v2"),
    "schema": lambda m: m.update(schema=str(SCHEMA + 1)),
    "key": _pretty_key,
    "key_digest": lambda m: m.update(key_digest="0" * 64),
    "codebook": lambda m: m.update(codebook="3inst"),
    "bits": lambda m: m.update(bits="3"),
    "in_features": lambda m: m.update(in_features=str(IN - 1)),
    "out_features": lambda m: m.update(out_features=str(OUT + 16)),
    "proxy_err": lambda m: m.update(proxy_err="small"),
    "encode_seconds": lambda m: m.update(encode_seconds="1e999"),
    "created": lambda m: m.update(created="yesterday"),
    "payload_digest": lambda m: m.update(payload_digest="0" * 64),
    "info": lambda m: m.update(info='["not", "an", "object"]'),
    "exl3rt_version": lambda m: m.update(exl3rt_version=""),
}


def test_the_field_table_covers_every_metadata_field():
    assert sorted(FIELD_EDITS) == sorted(METADATA_FIELDS)


def test_rewritten_entry_with_unchanged_metadata_stays_valid(tmp_path):
    [path] = publish(tmp_path / "cache", 0)
    rewrite(path, lambda m: None)
    assert read_entry(path, key_of(0)).encoded is not None and read_entry(path).encoded is not None
    assert entry_info(path).error is None


@pytest.mark.parametrize("field", sorted(FIELD_EDITS))
def test_every_metadata_field_is_checked(tmp_path, field):
    root = tmp_path / "cache"
    [path] = publish(root, 0)
    rewrite(path, FIELD_EDITS[field])
    for key in (key_of(0), None):  # a load, and verify (which trusts only the file)
        with pytest.raises(InvalidEntryError) as e:
            read_entry(path, key)
        assert field in e.value.reason and "\n" not in e.value.reason
    [res] = EncodingCache(root, "readwrite").verify()
    assert not res.ok and field in res.reason
    if field != "payload_digest":  # the header alone shows it: ls and stats flag the entry too
        assert field in entry_info(path).error


@pytest.mark.parametrize("edit,reason", [
    (lambda m: m.pop("created"), "metadata field(s) created missing"),
    (lambda m: m.update(evil="1"), "unknown metadata field(s) 'evil'"),
    (lambda m: m.update(info='{"g_scale": [1.0]}'), "metadata info['g_scale'] is not a scalar"),
    (lambda m: m.update(info='{"g_scale": 1, "g_scale": 2}'), "duplicate object key"),
], ids=["missing", "unknown", "nested-info", "duplicate-info-key"])
def test_missing_unknown_and_odd_metadata(tmp_path, edit, reason):
    [path] = publish(tmp_path / "cache", 0)
    rewrite(path, edit)
    with pytest.raises(InvalidEntryError, match=re.escape(reason)):
        read_entry(path, key_of(0))
    assert reason in EncodingCache(tmp_path / "cache", "readwrite").verify()[0].reason


@pytest.mark.parametrize("old,new", [
    ('"seed":0', '"seed":1e400'),                  # a float too large: inf
    ('"seed":0', '"seed":' + "9" * 5000),           # past Python's int digit limit
    ('"source_shape":[256,128]', '"source_shape":5'),
    ('"options":{}', '"options":"abc"'),
    ('"bits":2', '"bits":null'),
], ids=["inf", "huge-int", "shape-not-a-list", "options-not-a-dict", "bits-null"])
def test_hostile_key_values_make_an_invalid_entry_not_a_crash(tmp_path, capsys, old, new):
    root = tmp_path / "cache"
    [path] = publish(root, 0)
    rewrite(path, lambda m: m.update(key=m["key"].replace(old, new)))
    [res] = EncodingCache(root, "readwrite").verify()
    assert not res.ok and res.reason.startswith("metadata key is unusable: ") and "\n" not in res.reason
    assert entry_info(path).error == res.reason
    status, out, err = cli(capsys, "verify", "--root", str(root))
    assert status == 1 and f"INVALID {path}" in out and "Traceback" not in err


def test_non_string_metadata_value_is_invalid(tmp_path):
    [path] = publish(tmp_path / "cache", 0)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["bits"] = 2
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    with pytest.raises(InvalidEntryError, match="metadata 'bits' is not a string"):
        read_header(path)


# --------------------------------------------------------------------------------------------- odds and ends
def test_verify_of_a_missing_root_is_a_one_line_error(tmp_path, capsys):
    status, out, err = cli(capsys, "verify", "--root", str(tmp_path / "nowhere"))
    assert status == 1 and out == ""
    assert err.strip().count("\n") == 0 and f"cache root {tmp_path / 'nowhere'} does not exist" in err
    with pytest.raises(CacheError, match="does not exist"):
        EncodingCache(tmp_path / "nowhere", "readwrite").verify()


def test_lock_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        [entry] = publish(tmp_path / "cache", 0)
    finally:
        os.umask(old)
    assert LOCK_MODE == 0o600 and (os.stat(str(entry) + ".lock").st_mode & 0o777) == 0o600


def test_a_key_of_another_schema_is_refused(tmp_path):
    import dataclasses

    key = dataclasses.replace(key_of(0), schema=SCHEMA + 1)
    with pytest.raises(CacheError, match=f"schema {SCHEMA + 1}"):
        EncodingCache(tmp_path / "cache", "readwrite").load_or_encode(key, FakeEncode())
