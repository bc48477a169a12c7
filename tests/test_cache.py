"""The persistent encoding cache: keys, entries, modes, validation, locking, failure handling.

Fake encodes (random valid linears) are used where calls are counted; one test runs the real encoder.
Cross-process tests start small Python children (subprocess) that share a tmp_path root.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import filelock
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exl3rt import env
from exl3rt.cache import (CacheError, CacheKey, CacheMode, EncodingCache, default_cache_root, parse_cache_mode,
                          read_entry, tensor_digest)
from exl3rt.cache.entry import payload_digest
from exl3rt.encode import ENCODER_VERSION
from exl3rt.format.encoded import EncodedLinear
from exl3rt.format.random import random_linear

IN, OUT, K = 128, 256, 2


def weight(seed: int = 0, out_f: int = OUT, in_f: int = IN, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g).to(dtype)


class FakeEncode:
    """A counting encode: a random valid linear for the key's widths, with a proxy error."""

    def __init__(self, in_f: int = IN, out_f: int = OUT, bits=K, codebook: str = "mcg", proxy: float = 0.125,
                 nan_in: str = "", nan_times: int = 0) -> None:
        self.in_f, self.out_f, self.bits, self.codebook, self.proxy = in_f, out_f, bits, codebook, proxy
        self.nan_in, self.nan_times, self.calls = nan_in, nan_times, 0

    def __call__(self) -> EncodedLinear:
        self.calls += 1
        enc = random_linear(self.in_f, self.out_f, self.bits, self.codebook, seed=self.calls)
        enc.info = {"proxy_err": self.proxy}
        if self.calls <= self.nan_times:
            if self.nan_in == "proxy_err":
                enc.info["proxy_err"] = float("nan")
            else:
                getattr(enc, self.nan_in)[3] = float("inf") if self.nan_in == "svh" else float("nan")
        return enc


@pytest.fixture
def key() -> CacheKey:
    return CacheKey.for_weight(weight(), bits=K)


def rw(tmp_path: Path, **kw) -> EncodingCache:
    return EncodingCache(tmp_path / "cache", "readwrite", **kw)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def same(a: EncodedLinear, b: EncodedLinear) -> bool:
    return (torch.equal(a.trellis, b.trellis) and torch.equal(a.suh, b.suh) and torch.equal(a.svh, b.svh)
            and a.codebook == b.codebook and (a.in_features, a.out_features) == (b.in_features, b.out_features))


# ---------------------------------------------------------------------------------------------- modes, root
@pytest.mark.parametrize("raw,mode", [("off", "off"), ("none", "off"), ("readonly", "readonly"),
                                      ("read-only", "readonly"), ("READONLY", "readonly"), ("readwrite", "readwrite"),
                                      ("rw", "readwrite"), (CacheMode.OFF, "off")])
def test_mode_names_and_aliases(raw, mode):
    assert parse_cache_mode(raw) is CacheMode(mode)


def test_unknown_mode_is_a_clear_error(monkeypatch):
    with pytest.raises(CacheError, match="must be off, readonly, or readwrite"):
        parse_cache_mode("sometimes")
    monkeypatch.setenv("EXL3RT_CACHE_MODE", "sometimes")
    with pytest.raises(env.EnvError, match="EXL3RT_CACHE_MODE=.*must be off, readonly, or readwrite"):
        parse_cache_mode(None)


def test_mode_and_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("EXL3RT_CACHE_MODE", raising=False)
    monkeypatch.delenv("EXL3RT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert parse_cache_mode(None) is CacheMode.READWRITE
    assert default_cache_root() == tmp_path / "xdg" / "exl3rt"
    monkeypatch.setenv("EXL3RT_CACHE_MODE", "read-only")
    monkeypatch.setenv("EXL3RT_CACHE_DIR", str(tmp_path / "mine"))
    cache = EncodingCache()
    assert cache.mode is CacheMode.READONLY and cache.root == tmp_path / "mine"
    assert "EXL3RT_CACHE_MODE" in env.describe() and "EXL3RT_CACHE_DIR" in env.describe()


def test_root_is_created_private_and_layout_is_fanned_out(tmp_path, key):
    cache = rw(tmp_path)
    res = cache.load_or_encode(key, FakeEncode())
    assert (cache.root.stat().st_mode & 0o777) == 0o700
    d = key.digest()
    assert res.path == cache.path_for(key) == cache.root / "v1" / d[:2] / f"{d}.safetensors"
    lock = Path(str(res.path) + ".lock")
    assert lock.exists() and (lock.stat().st_mode & 0o777) == 0o600  # private, whatever the umask


def test_loose_root_permissions_warn_once(tmp_path, key, caplog):
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o777)
    cache = EncodingCache(root, "readwrite")
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        for seed in range(2):
            cache.load_or_encode(CacheKey.for_weight(weight(seed), bits=K), FakeEncode())
    assert sum("writable only by the serving user" in r.getMessage() for r in caplog.records) == 1


# -------------------------------------------------------------------------------------------------------- keys
def test_tensor_digest_covers_dtype_shape_and_bytes():
    w = weight()
    assert tensor_digest(w) == tensor_digest(w.clone())
    assert tensor_digest(w.t().contiguous().t()) == tensor_digest(w)       # strides do not matter
    assert tensor_digest(w.t()) != tensor_digest(w)                         # a transpose is another tensor
    assert tensor_digest(w.view(torch.float16)) != tensor_digest(w)         # same bytes, other dtype
    assert tensor_digest(w.reshape(OUT * 2, IN // 2)) != tensor_digest(w)  # same bytes, other shape
    w2 = w.clone()
    w2[17, 3] = w2[17, 3] + 1
    assert tensor_digest(w2) != tensor_digest(w)                            # one element
    assert len(tensor_digest(w)) == 64 and int(tensor_digest(w), 16) >= 0
    assert tensor_digest(torch.zeros(0)) != tensor_digest(torch.zeros(0, dtype=torch.float16))


def _variants():
    """(field, key) pairs: each changes exactly one field of the base key."""
    w = weight()
    base = dict(bits=K, codebook="mcg", seed=0)
    r = dataclasses.replace
    b = CacheKey.for_weight(w, **base)
    w1 = w.clone()
    w1[0, 0] += 1
    return b, [
        ("source_digest", CacheKey.for_weight(w1, **base)),
        ("source_dtype", r(b, source_dtype="torch.float16")),
        ("source_shape", r(b, source_shape=(IN, OUT))),
        ("bits", CacheKey.for_weight(w, **{**base, "bits": 3})),
        ("codebook", CacheKey.for_weight(w, **{**base, "codebook": "3inst"})),
        ("seed", CacheKey.for_weight(w, **{**base, "seed": 1})),
        ("encoder_version", r(b, encoder_version=ENCODER_VERSION + 1)),
        ("hessian_digest", CacheKey.for_weight(w, **base, hessian=torch.eye(IN))),
        ("in_features", r(b, in_features=IN - 1)),
        ("out_features", r(b, out_features=OUT - 1)),
        ("in_padded", r(b, in_padded=IN + 128)),
        ("out_padded", r(b, out_padded=OUT + 128)),
        ("tp_size", CacheKey.for_weight(w, **base, tp_size=2)),
        ("tp_rank", r(b, tp_size=2, tp_rank=1)),  # vs tp_size=2 rank 0 above
        ("tp_bounds", CacheKey.for_weight(w, **base, tp_size=2, tp_bounds=(0, OUT // 2, 0, IN))),
        ("out_scales", CacheKey.for_weight(w, **base, out_scales=False)),
        ("schema", r(b, schema=2)),
        ("options", CacheKey.for_weight(w, **base, options={"refit": False})),
    ]


def test_key_changes_when_any_field_changes():
    base, variants = _variants()
    fields = {f.name for f in dataclasses.fields(CacheKey)}
    assert {name for name, _ in variants} == fields, "every key field must be varied by this table"
    digests = [base.digest()] + [k.digest() for _, k in variants]
    assert len(set(digests)) == len(digests)
    for name, k in variants:
        assert getattr(k, name) != getattr(base, name) or name == "tp_rank", name
    # a different Hessian is a different key too
    w = weight()
    assert (CacheKey.for_weight(w, bits=K, hessian=torch.eye(IN)).digest()
            != CacheKey.for_weight(w, bits=K, hessian=2 * torch.eye(IN)).digest())


def test_key_canonical_forms():
    w = weight()
    assert CacheKey.for_weight(w, bits=4).canonical_json() == CacheKey.for_weight(w, bits=4.0).canonical_json()
    assert '"bits":4,' in CacheKey.for_weight(w, bits=4.0).canonical_json()
    assert '"bits":2.5' in CacheKey.for_weight(w, bits=2.5, codebook="mul1").canonical_json()
    k = CacheKey.for_weight(w, bits=3, options={"b": 1, "a": 2.0})
    assert CacheKey.from_json(k.canonical_json()) == k
    assert k.options == (("a", 2), ("b", 1))
    sliced = CacheKey.for_weight(w, bits=3, tp_size=2, tp_rank=1, tp_bounds=(0, OUT, IN // 2, IN))
    assert (sliced.in_features, sliced.out_features, sliced.in_padded) == (IN // 2, OUT, 128)
    padded = CacheKey.for_weight(weight(in_f=200), bits=3)
    assert (padded.in_features, padded.in_padded, padded.trellis_shape) == (200, 256, (16, OUT // 16, 48))
    with pytest.raises(CacheError, match="not a non-empty slice"):
        CacheKey.for_weight(w, bits=3, tp_bounds=(0, OUT + 1, 0, IN))
    with pytest.raises(CacheError, match="unsupported bitrate"):
        CacheKey.for_weight(w, bits=9)
    with pytest.raises(CacheError, match="tp_rank"):
        CacheKey.for_weight(w, bits=3, tp_size=2, tp_rank=2)


CHILD_KEY = """
import torch
from exl3rt.cache import CacheKey
w = (torch.arange(256 * 128, dtype=torch.float32).reshape(256, 128) / 1000).to(torch.bfloat16)
print(CacheKey.for_weight(w, bits=2.5, codebook="mul1", seed=7, hessian=torch.eye(128) * 3, tp_size=2, tp_rank=1,
                          tp_bounds=(128, 256, 0, 128), options={"refit": False}).digest())
"""


def test_key_is_identical_across_processes():
    exec_env = {k: v for k, v in os.environ.items() if not k.startswith("EXL3RT_CACHE")}
    out = subprocess.run([sys.executable, "-c", CHILD_KEY], capture_output=True, text=True, env=exec_env, timeout=120)
    assert out.returncode == 0, out.stderr
    ns: dict = {}
    exec(CHILD_KEY.replace("print(", "result = ("), ns)
    assert out.stdout.strip() == ns["result"]


# --------------------------------------------------------------------------------------------- basic behaviour
def test_real_encode_round_trip_hits_and_rebuilds_exactly(tmp_path):
    w_hf = torch.randn(128, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    key = CacheKey.for_weight(w_hf, bits=2, codebook="mcg")
    calls = []

    def encode():
        from exl3rt.encode import quantize_weight
        calls.append(1)
        return quantize_weight(w_hf.t().float(), 2, "mcg")

    cache = rw(tmp_path)
    first = cache.load_or_encode(key, encode, name="model.layers.0.q_proj")
    second = EncodingCache(cache.root, "readwrite").load_or_encode(key, encode, name="model.layers.0.q_proj")
    assert (first.hit, second.hit, len(calls)) == (False, True, 1)
    assert first.path == second.path == cache.path_for(key)
    assert same(first.encoded, second.encoded) and second.encoded.bias is None
    assert second.encoded.info["proxy_err"] == first.encoded.info["proxy_err"]
    assert torch.equal(first.encoded.reconstruct(), second.encoded.reconstruct())
    assert second.encoded.name == "model.layers.0.q_proj"
    with safe_open(str(second.path), "pt") as f:
        meta = f.metadata()
        assert sorted(f.keys()) == ["suh", "svh", "trellis"]
    assert meta["key"] == key.canonical_json() and float(meta["proxy_err"]) == first.encoded.info["proxy_err"]
    assert float(meta["encode_seconds"]) > 0


def test_bf16_weight_loaded_in_float32_or_float16_shares_the_entry():
    """A BF16 checkpoint loaded with dtype=float32 (or float16, where its values fit) encodes to the bf16 load's
    codes, so it has the bf16 load's key; a weight with one value off the bf16 grid, and a genuine fp16 one, do not."""
    from exl3rt.encode import quantize_weight

    w = (0.02 * torch.randn(128, 128, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    key = CacheKey.for_weight(w, bits=2)
    assert CacheKey.for_weight(w.float(), bits=2) == key
    # fp16 holds a bf16 value exactly only in its normal range (small weights become fp16 subnormals and round)
    fits = torch.where(w.abs() < 2.0 ** -13, torch.full_like(w, 2.0 ** -13), w)
    assert torch.equal(fits.half().to(torch.bfloat16), fits)
    assert CacheKey.for_weight(fits.half(), bits=2) == CacheKey.for_weight(fits, bits=2)
    assert not torch.equal(w.half().to(torch.bfloat16), w)
    assert CacheKey.for_weight(w.half(), bits=2) != key        # rounded on the way: other values, another key
    # why sharing is sound: the encoder reads float32, so both loads give the same codes
    a, b = quantize_weight(w.t().float(), 2, "mcg"), quantize_weight(w.float().t().float(), 2, "mcg")
    assert torch.equal(a.trellis, b.trellis) and torch.equal(a.suh, b.suh) and torch.equal(a.svh, b.svh)
    for at in ((5, 7), (100, 50)):                              # in the first 4096 values checked, and past them
        off = w.float().clone()
        off[at] += 2.0 ** -20                                   # below bf16's resolution at this magnitude
        assert CacheKey.for_weight(off, bits=2).source_dtype == "torch.float32"
        assert CacheKey.for_weight(off, bits=2) != key
    fp16 = (0.02 * torch.randn(128, 128, generator=torch.Generator().manual_seed(4))).half()
    assert CacheKey.for_weight(fp16, bits=2).source_dtype == "torch.float16"


def test_padded_widths_round_trip(tmp_path):
    key = CacheKey.for_weight(weight(out_f=200, in_f=300), bits=3)
    cache = rw(tmp_path)
    enc = FakeEncode(300, 200, 3)
    a = cache.load_or_encode(key, enc)
    b = cache.load_or_encode(key, enc)
    assert b.hit and enc.calls == 1 and same(a.encoded, b.encoded)
    assert (b.encoded.in_features, b.encoded.out_features, b.encoded.in_padded) == (300, 200, 384)


def test_readonly_reads_but_never_locks_creates_or_writes(tmp_path, key):
    root = tmp_path / "cache"
    ro = EncodingCache(root, "readonly")
    enc = FakeEncode()
    res = ro.load_or_encode(key, enc)
    assert (res.hit, res.path, enc.calls) == (False, None, 1)
    assert not root.exists()  # no directory, no lock, no entry
    EncodingCache(root, "rw").load_or_encode(key, enc)
    before = files_under(root)
    res = ro.load_or_encode(key, enc)
    assert res.hit and res.path == ro.path_for(key) and enc.calls == 2
    other = CacheKey.for_weight(weight(5), bits=K)
    assert not ro.load_or_encode(other, enc).hit
    assert files_under(root) == before  # the miss added no lock file either


def test_off_never_reads_or_writes(tmp_path, key):
    cache = rw(tmp_path)
    cache.load_or_encode(key, FakeEncode())
    path = cache.path_for(key)
    off = EncodingCache(cache.root, "off")
    enc = FakeEncode()
    assert not off.load_or_encode(key, enc).hit and enc.calls == 1  # a valid entry is not used
    path.write_bytes(b"garbage")
    mtime = path.stat().st_mtime_ns
    res = off.load_or_encode(key, enc)
    assert (res.hit, res.path) == (False, None)
    assert path.read_bytes() == b"garbage" and path.stat().st_mtime_ns == mtime
    empty = tmp_path / "never"
    EncodingCache(empty, "none").load_or_encode(key, enc)
    assert not empty.exists()


def test_hit_in_readwrite_records_use(tmp_path, key):
    cache = rw(tmp_path)
    path = cache.load_or_encode(key, FakeEncode()).path
    os.utime(path, (1_000_000, 1_000_000))
    assert cache.load_or_encode(key, FakeEncode()).hit
    assert path.stat().st_mtime > 1_000_000
    os.utime(path, (1_000_000, 1_000_000))
    assert EncodingCache(cache.root, "readonly").load_or_encode(key, FakeEncode()).hit
    assert path.stat().st_mtime == 1_000_000  # readonly writes nothing, not even times


# --------------------------------------------------------------------------------------------- invalid entries
def _nan_entry(path: Path) -> None:
    """Rewrite a valid entry with a NaN in suh and a payload digest that matches it (only finiteness fails)."""
    with safe_open(str(path), "pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    t["suh"][5] = float("nan")
    meta["payload_digest"] = payload_digest(t["trellis"], t["suh"], t["svh"])
    save_file(t, str(path), metadata=meta)


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0x10  # inside the trellis: shapes and finiteness stay fine
    path.write_bytes(bytes(data))


def _extra_tensor(path: Path) -> None:
    with safe_open(str(path), "pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    t["bias"] = torch.zeros(OUT, dtype=torch.float16)
    save_file(t, str(path), metadata=meta)


CORRUPTIONS = {
    "garbage": (lambda p, other: p.write_bytes(b"definitely not a safetensors file" * 10), "implausible"),
    "empty": (lambda p, other: p.write_bytes(b""), "truncated"),
    "truncated": (lambda p, other: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated or corrupt"),
    "wrong_key": (lambda p, other: p.write_bytes(other.read_bytes()), "key metadata does not match"),
    "nan": (lambda p, other: _nan_entry(p), "non-finite"),
    "bit_flip": (lambda p, other: _flip_a_bit(p), "payload digest mismatch"),
    "extra_tensor": (lambda p, other: _extra_tensor(p), "tensors are"),
}


@pytest.fixture(params=sorted(CORRUPTIONS))
def corrupt_entry(request, tmp_path, key):
    """A cache whose entry for ``key`` is damaged in one way; returns (cache root, path, expected reason)."""
    cache = rw(tmp_path)
    path = cache.load_or_encode(key, FakeEncode()).path
    other = cache.load_or_encode(CacheKey.for_weight(weight(9), bits=K), FakeEncode()).path
    damage, reason = CORRUPTIONS[request.param]
    damage(path, other)
    return cache.root, path, reason


def test_invalid_entry_is_replaced_in_readwrite(corrupt_entry, key, caplog):
    root, path, reason = corrupt_entry
    cache = EncodingCache(root, "readwrite")
    enc = FakeEncode()
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        res = cache.load_or_encode(key, enc, name="layers.3.o_proj")
    assert (res.hit, res.path, enc.calls, cache.stats.invalid_entries) == (False, path, 1, 1)
    [msg] = [r.getMessage() for r in caplog.records]
    assert "layers.3.o_proj" in msg and reason in msg and "replacing" in msg
    assert read_entry(path, key).encoded is not None
    again = EncodingCache(root, "readwrite").load_or_encode(key, enc)
    assert again.hit and enc.calls == 1 and same(again.encoded, res.encoded)


def test_invalid_entry_is_ignored_in_readonly(corrupt_entry, key, caplog):
    root, path, reason = corrupt_entry
    before = path.read_bytes()
    cache = EncodingCache(root, "readonly")
    enc = FakeEncode()
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        res = cache.load_or_encode(key, enc)
        cache.load_or_encode(key, enc)
    assert (res.hit, res.path, enc.calls, cache.stats.invalid_entries) == (False, None, 2, 2)
    assert path.read_bytes() == before
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and reason in msgs[0] and "readonly" in msgs[0]


def test_read_entry_names_the_problem(tmp_path, key):
    path = rw(tmp_path).load_or_encode(key, FakeEncode()).path
    other = dataclasses.replace(key, seed=1)
    with pytest.raises(CacheError, match=f"{path.name}.*key metadata does not match"):
        read_entry(path, other)


# --------------------------------------------------------------------------------------------- non-finite encodes
@pytest.mark.parametrize("where", ["suh", "svh", "proxy_err"])
def test_nonfinite_encode_is_retried_once_then_rejected(tmp_path, key, where):
    cache = rw(tmp_path)
    enc = FakeEncode(nan_in=where, nan_times=99)
    with pytest.raises(CacheError, match=r"layers\.7\.up_proj.*non-finite twice"):
        cache.load_or_encode(key, enc, name="layers.7.up_proj")
    assert enc.calls == 2
    assert not cache.path_for(key).exists()
    assert not [p for p in files_under(cache.root) if p.suffix in (".safetensors", ".tmp")]


def test_nonfinite_encode_succeeds_on_retry_and_only_the_good_one_is_published(tmp_path, key):
    cache = rw(tmp_path)
    enc = FakeEncode(nan_in="suh", nan_times=1)
    res = cache.load_or_encode(key, enc)
    assert enc.calls == 2 and res.path is not None and cache.stats.nonfinite_retries == 1
    assert bool(torch.isfinite(read_entry(res.path, key).encoded.suh).all())


def test_encode_raising_formaterror_is_retried(tmp_path, key):
    calls = []

    def encode():
        calls.append(1)
        good = FakeEncode()()
        if len(calls) == 1:  # EncodedLinear's own validation rejects NaN scales inside the encoder
            EncodedLinear(good.trellis, good.suh * float("nan"), good.svh)
        return good

    assert rw(tmp_path).load_or_encode(key, encode).path is not None and len(calls) == 2


def test_encoding_that_does_not_match_its_key_is_a_bug_report(tmp_path, key):
    cache = rw(tmp_path)
    with pytest.raises(CacheError, match=r"layers\.1\.k_proj.*does not match its cache key.*trellis"):
        cache.load_or_encode(key, FakeEncode(bits=3), name="layers.1.k_proj")
    assert not cache.path_for(key).exists()


# --------------------------------------------------------------------------------------------- cache trouble
def _load_model(cache: EncodingCache, layers: int = 3) -> list:
    """Stand-in for a model load: several layers through one cache object."""
    return [cache.load_or_encode(CacheKey.for_weight(weight(100 + i), bits=K), FakeEncode(), name=f"layers.{i}")
            for i in range(layers)]


def _warnings(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_full_disk_keeps_encodes_and_warns_once(tmp_path, monkeypatch, caplog):
    cache = rw(tmp_path)

    def full(self, tmp, tensors, metadata):
        with open(tmp, "wb") as f:
            f.write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    monkeypatch.setattr(EncodingCache, "_write_entry", full)
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        results = _load_model(cache)
    assert all(r.encoded is not None and not r.hit and r.path is None for r in results)
    assert cache.stats.publish_failures == 3
    assert _warnings(caplog, "could not publish") == 1 and _warnings(caplog, "ENOSPC") == 1
    assert not [p for p in files_under(cache.root) if not p.name.endswith(".lock")]  # no entry, no temp


def _deny_writes_under(monkeypatch, root: Path) -> None:
    """Simulate a directory without write permission (works for root too, where chmod does not bite)."""
    real_open, real_mkdir, real_replace = os.open, os.mkdir, os.replace
    root = str(root)

    def inside(p) -> bool:
        return os.path.abspath(os.fspath(p)).startswith(root)

    def fake_open(path, flags, *a, **kw):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *a, **kw)

    def fake_mkdir(path, *a, **kw):
        if inside(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_mkdir(path, *a, **kw)

    def fake_replace(src, dst, *a, **kw):
        if inside(dst):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(dst))
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "replace", fake_replace)


@pytest.mark.parametrize("existing", [False, True], ids=["missing-root", "existing-root"])
def test_unwritable_cache_loads_model_with_one_warning(tmp_path, monkeypatch, caplog, existing):
    cache = rw(tmp_path)
    if existing:
        _load_model(cache, 1)  # a populated cache: one hit, two layers that cannot be published
    before = files_under(cache.root)
    cache = EncodingCache(cache.root, "readwrite")
    _deny_writes_under(monkeypatch, cache.root)
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        results = _load_model(cache)
    monkeypatch.undo()
    assert [r.hit for r in results] == [existing, False, False]
    assert all(r.encoded is not None for r in results)
    assert _warnings(caplog, "is unavailable") == 1 and _warnings(caplog, "EACCES") == 1
    assert files_under(cache.root) == before


def test_unreadable_entries_load_model_with_one_warning(tmp_path, monkeypatch, caplog):
    cache = rw(tmp_path)
    _load_model(cache)
    import builtins

    import exl3rt.cache.entry as entry_module
    real_open = builtins.open

    def deny(path, *a, **kw):
        if str(path).startswith(str(cache.root)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(entry_module, "open", deny, raising=False)
    ro = EncodingCache(cache.root, "readonly")
    with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
        results = _load_model(ro)
    assert [r.hit for r in results] == [False] * 3 and all(r.encoded is not None for r in results)
    assert _warnings(caplog, "cannot read encoding cache entry") == 1 and _warnings(caplog, "Permission denied") == 1


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="running as root: chmod does not deny root (the monkeypatched variant covers this)")
def test_chmod_readonly_directory_loads_model_with_one_warning(tmp_path, caplog):  # pragma: no cover - non-root
    cache = rw(tmp_path)
    _load_model(cache, 1)
    for d in [cache.root, *cache.root.rglob("*")]:
        if d.is_dir():
            os.chmod(d, 0o500)
    try:
        with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
            results = _load_model(EncodingCache(cache.root, "readwrite"))
    finally:
        for d in [cache.root, *cache.root.rglob("*")]:
            if d.is_dir():
                os.chmod(d, 0o700)
    assert [r.hit for r in results] == [True, False, False]
    assert _warnings(caplog, "is unavailable") + _warnings(caplog, "could not publish") == 1


def test_lock_timeout_encodes_uncached_and_says_so_once(tmp_path, key, caplog):
    assert EncodingCache(tmp_path).lock_timeout == 600.0
    cache = rw(tmp_path, lock_timeout=0.05)
    cache.path_for(key).parent.mkdir(parents=True)
    holder = filelock.FileLock(str(cache.lock_path(cache.path_for(key))))
    holder.acquire()
    try:
        enc = FakeEncode()
        with caplog.at_level(logging.WARNING, logger="exl3rt.cache"):
            results = [cache.load_or_encode(key, enc) for _ in range(2)]
    finally:
        holder.release()
    assert [(r.hit, r.path) for r in results] == [(False, None)] * 2 and enc.calls == 2
    assert not cache.path_for(key).exists()
    assert _warnings(caplog, "timed out") == 1


# --------------------------------------------------------------------------------------------- processes
CHILD = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    from exl3rt.cache import EncodingCache
    from exl3rt.format.random import random_linear

    root, work, ident, behaviour = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    w = (torch.arange(256 * 128, dtype=torch.float32).reshape(256, 128) / 1000).to(torch.bfloat16)

    class PausingCache(EncodingCache):
        def _write_entry(self, tmp, tensors, metadata):
            super()._write_entry(tmp, tensors, metadata)
            with open(tmp, "r+b") as f:   # leave a torn temporary behind
                f.truncate(os.path.getsize(tmp) // 2)
            (work / "paused").touch()
            time.sleep(600)

    cache = (PausingCache if behaviour == "pause" else EncodingCache)(root, "readwrite")
    key = cache.key_for_weight(w, bits=2)

    def encode():
        with open(work / "calls", "a") as f:
            f.write(ident + "\\n")
        time.sleep(1.5 if behaviour == "race" else 0)
        e = random_linear(128, 256, 2, seed=int(ident))
        e.info["proxy_err"] = 0.5
        return e

    (work / f"ready-{ident}").touch()
    while behaviour == "race" and len(list(work.glob("ready-*"))) < 2:
        time.sleep(0.01)
    res = cache.load_or_encode(key, encode, name="layer")
    print(json.dumps({"hit": res.hit, "path": str(res.path), "digest": key.digest()}))
""")


def _spawn(tmp_path: Path, ident: int, behaviour: str) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    exec_env = {k: v for k, v in os.environ.items() if not k.startswith("EXL3RT_CACHE")}
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache"), str(tmp_path), str(ident), behaviour],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=exec_env)


def _child_key() -> CacheKey:
    w = (torch.arange(256 * 128, dtype=torch.float32).reshape(256, 128) / 1000).to(torch.bfloat16)
    return CacheKey.for_weight(w, bits=2)


def test_two_processes_one_encodes_the_other_hits(tmp_path):
    procs = [_spawn(tmp_path, i, "race") for i in (1, 2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    calls = (tmp_path / "calls").read_text().split()
    assert len(calls) == 1, f"encoded {len(calls)} times: {calls}"
    assert sorted(o["hit"] for o in outs) == [False, True]
    key = _child_key()
    assert {o["digest"] for o in outs} == {key.digest()}
    cache = EncodingCache(tmp_path / "cache", "readonly")
    assert outs[0]["path"] == outs[1]["path"] == str(cache.path_for(key))
    loaded = read_entry(cache.path_for(key), key).encoded  # whole, valid, and the encoder's own result
    assert torch.equal(loaded.trellis, random_linear(128, 256, 2, seed=int(calls[0])).trellis)
    assert [r.ok for r in EncodingCache(cache.root, "rw").verify()] == [True]


def test_sigkill_during_publish_leaves_no_entry_and_no_blocking_lock(tmp_path):
    proc = _spawn(tmp_path, 1, "pause")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "paused").exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "child never reached the publish step"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    key = _child_key()
    cache = EncodingCache(tmp_path / "cache", "readwrite", lock_timeout=60)
    path = cache.path_for(key)
    assert not path.exists() and list(cache.entries()) == []        # no entry that could validate
    assert list(path.parent.glob(".*.tmp"))                          # the torn temporary is all that is left
    enc = FakeEncode()
    res = cache.load_or_encode(key, enc)
    # Published, not "uncached after a lock timeout": the dead holder's flock did not block us.
    assert (res.hit, res.path, enc.calls) == (False, path, 1)
    assert not list(path.parent.glob(".*.tmp"))                      # the next writer cleaned up
    assert [r.ok for r in cache.verify()] == [True]


# --------------------------------------------------------------------------------------------- verify, prune
def _populate(tmp_path: Path, n: int = 4) -> tuple[EncodingCache, list[Path]]:
    cache = rw(tmp_path)
    paths = [cache.load_or_encode(CacheKey.for_weight(weight(200 + i), bits=K), FakeEncode()).path for i in range(n)]
    for i, p in enumerate(paths):  # entry i was last used i days ago + 1 hour
        t = time.time() - (i * 86400 + 3600)
        os.utime(p, (t, t))
    return cache, paths


def test_verify_finds_corrupt_renamed_and_deletes_on_request(tmp_path):
    cache, paths = _populate(tmp_path, 3)
    _flip_a_bit(paths[0])
    moved = paths[1].with_name("00" * 32 + ".safetensors")
    paths[1].rename(moved)
    results = {r.info.path: r for r in cache.verify()}
    assert results[paths[2]].ok
    assert not results[paths[0]].ok and "payload digest" in results[paths[0]].reason
    assert not results[moved].ok and "file name does not match" in results[moved].reason
    with pytest.raises(CacheError, match="readonly"):
        EncodingCache(cache.root, "readonly").verify(delete_invalid=True)
    deleted = [r.info.path for r in cache.verify(delete_invalid=True) if r.deleted]
    assert sorted(deleted) == sorted([paths[0], moved])
    assert [r.ok for r in cache.verify()] == [True]


def test_prune_by_age_and_size_never_removes_an_entry_being_written(tmp_path):
    cache, paths = _populate(tmp_path, 4)  # ages ~1h, 1d, 2d, 3d
    two_newest = paths[0].stat().st_size + paths[1].stat().st_size  # sizes differ by a few metadata bytes
    dry = cache.prune(older_than=1.5 * 86400, dry_run=True)
    assert sorted(e.path for e in dry.removed) == sorted(paths[2:]) and all(p.exists() for p in paths)
    holder = filelock.FileLock(str(cache.lock_path(paths[3])))
    holder.acquire()  # another process is (re)writing entry 3
    try:
        rep = cache.prune(older_than=1.5 * 86400)
    finally:
        holder.release()
    assert [e.path for e in rep.removed] == [paths[2]] and [e.path for e in rep.skipped_in_use] == [paths[3]]
    assert paths[3].exists() and not paths[2].exists()
    rep = cache.prune(max_size=two_newest)  # least recently used go first
    assert [e.path for e in rep.removed] == [paths[3]] and rep.remaining_bytes == two_newest
    assert {e.path for e in cache.entries()} == {paths[0], paths[1]}
    rep = cache.prune(max_size=0)
    assert rep.remaining_entries == 0 and list(cache.entries()) == []


def test_prune_removes_leftovers_of_dead_writers_only(tmp_path, key):
    cache, paths = _populate(tmp_path, 1)
    dead = paths[0].parent / f".{paths[0].name}.abc123.tmp"
    dead.write_bytes(b"half")
    live_entry = cache.path_for(key)
    live_entry.parent.mkdir(parents=True, exist_ok=True)
    live = live_entry.parent / f".{live_entry.name}.def456.tmp"
    live.write_bytes(b"in flight")
    holder = filelock.FileLock(str(cache.lock_path(live_entry)))
    holder.acquire()
    try:
        rep = cache.prune()
    finally:
        holder.release()
    assert not dead.exists() and live.exists() and rep.stale_files_removed >= 1 and paths[0].exists()
    with pytest.raises(CacheError, match="prune writes"):
        EncodingCache(cache.root, "readonly").prune()


def test_stats_count_hits_misses_and_bytes(tmp_path, key):
    cache = rw(tmp_path)
    k = cache.key_for_weight(weight(), bits=K)
    assert k == key and cache.stats.hash_seconds > 0
    cache.load_or_encode(key, FakeEncode())
    cache.load_or_encode(key, FakeEncode())
    s = cache.stats
    assert (s.hits, s.misses, s.encodes, s.published) == (1, 1, 1, 1)
    assert s.bytes_read == cache.path_for(key).stat().st_size and s.read_gbps > 0
    summary = cache.summary()
    assert summary["entries"] == 1 and summary["bytes"] == s.bytes_read and summary["temporary_files"] == 0
