"""One cache entry: a safetensors file holding an encoding, and its validation.

Tensors (exactly these names)::

    trellis  int16 [in_p/16, out_p/16, 16·K]
    suh      fp16  [in_p]
    svh      fp16  [out_p]

Metadata (exactly these fields, all strings, every one checked on read): ``format`` =
``exl3rt-encoding-cache``, ``schema``, ``key`` (the key's canonical JSON), ``key_digest``, ``codebook``,
``bits``, ``in_features``, ``out_features``, ``proxy_err`` (``repr(float)`` or ``""``),
``encode_seconds``, ``payload_digest`` (BLAKE3 over the three tensors: catches flipped bits that leave
shapes and finiteness intact), ``info`` (JSON of the encoder's scalar facts), ``created`` (unix time),
``exl3rt_version``. JSON from an entry (header, key, info) is parsed with bounds checked first
(:mod:`exl3rt.util.safejson`).

The bias is not stored: the caller attaches the checkpoint's bias after loading.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import stat
import struct
import time
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from ..format.bits import bits_from_trellis
from ..format.encoded import EncodedLinear
from ..format.errors import FormatError
from ..util.safetensors_io import write_safetensors
from .errors import InvalidEntryError
from .key import MAX_KEY_JSON, SCHEMA, CacheKey, new_hasher, tensor_bytes
from ..util.safejson import loads_bounded

FORMAT = "exl3rt-encoding-cache"
TENSOR_NAMES = ("trellis", "suh", "svh")
SUFFIX = ".safetensors"
MAX_HEADER = 1 << 20  # an entry header is ~2 KB; anything past 1 MiB is not ours
MAX_FIELD_JSON = MAX_KEY_JSON  # key and info: a few hundred bytes each
#: Exactly these metadata fields, all strings (an entry with any other is invalid).
METADATA_FIELDS = ("format", "schema", "key", "key_digest", "codebook", "bits", "in_features", "out_features",
                   "proxy_err", "encode_seconds", "payload_digest", "info", "created", "exl3rt_version")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[0-9A-Za-z.+!_-]{1,64}")


def payload_digest(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> str:
    """BLAKE3 over (name, dtype, shape, bytes) of the three stored tensors, in a fixed order."""
    tensors = (trellis, suh, svh)
    h = new_hasher(sum(t.numel() * t.element_size() for t in tensors))
    for name, t in zip(TENSOR_NAMES, tensors):
        h.update(json.dumps([name, str(t.dtype), list(t.shape)], separators=(",", ":")).encode())
        h.update(b"\0")
        h.update(tensor_bytes(t))
    return h.hexdigest()


def _scalar_info(info: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (info or {}).items():
        if isinstance(v, float) and not math.isfinite(v):
            continue
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[str(k)] = v
    return out


def check_encoding(enc: EncodedLinear, key: CacheKey) -> Optional[str]:
    """Why ``enc`` cannot be the encoding for ``key`` (shape, dtype, codebook, widths), or None if it can.

    Finiteness is checked separately (:func:`nonfinite_reason`), since a non-finite encode is retried.
    """
    if not isinstance(enc, EncodedLinear):
        return f"encode() returned {type(enc).__name__}, not an EncodedLinear"
    expect = {"trellis": (torch.int16, key.trellis_shape), "suh": (torch.float16, (key.in_padded,)),
              "svh": (torch.float16, (key.out_padded,))}
    for name, (dtype, shape) in expect.items():
        t = getattr(enc, name)
        if t.dtype != dtype or tuple(t.shape) != shape:
            return (f"{name} is {t.dtype} {tuple(t.shape)}, but the key ({key.describe()}) expects "
                    f"{dtype} {shape}")
    if enc.codebook != key.codebook:
        return f"codebook is {enc.codebook!r}, but the key says {key.codebook!r}"
    if (enc.in_features, enc.out_features) != (key.in_features, key.out_features):
        return (f"logical widths are [{enc.in_features} x {enc.out_features}], but the key says "
                f"[{key.in_features} x {key.out_features}]")
    return None


def nonfinite_reason(suh: torch.Tensor, svh: torch.Tensor, proxy_err: Optional[float]) -> Optional[str]:
    """Which part holds NaN/inf, or None if all are finite."""
    for name, t in (("suh", suh), ("svh", svh)):
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            return f"{name} has {int((~finite).sum())} non-finite value(s)"
    if proxy_err is not None and not math.isfinite(proxy_err):
        return f"proxy_err is {proxy_err!r}"
    return None


def proxy_err_of(enc: EncodedLinear) -> Optional[float]:
    """``enc.info["proxy_err"]`` as float, or None when absent."""
    value = (enc.info or {}).get("proxy_err")
    return None if value is None else float(value)


def entry_payload(enc: EncodedLinear, key: CacheKey, encode_seconds: float) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) to write for ``enc`` under ``key``: CPU, contiguous, no bias."""
    from .. import __version__

    tensors = {n: getattr(enc, n).detach().to("cpu").contiguous() for n in TENSOR_NAMES}
    err = proxy_err_of(enc)
    meta = {
        "format": FORMAT, "schema": str(SCHEMA), "key": key.canonical_json(), "key_digest": key.digest(),
        "codebook": enc.codebook, "bits": str(enc.bits), "in_features": str(enc.in_features),
        "out_features": str(enc.out_features), "proxy_err": "" if err is None else repr(err),
        "encode_seconds": repr(float(encode_seconds)),
        "payload_digest": payload_digest(tensors["trellis"], tensors["suh"], tensors["svh"]),
        "info": json.dumps(_scalar_info(enc.info), sort_keys=True, separators=(",", ":")),
        "created": repr(time.time()), "exl3rt_version": __version__,
    }
    return tensors, meta


def write_entry(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write one entry file at ``path`` and nowhere else (the caller publishes it atomically)."""
    write_safetensors(path, tensors, metadata)


def file_kind(mode: int) -> str:
    """``"regular file"``, ``"directory"``, ``"symbolic link"``, … for an ``st_mode``."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def _short(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (metadata can be large and hostile)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def _clip(exc: BaseException, limit: int = 200) -> str:
    """An exception's text on one line, at most ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _opener(path: str, flags: int) -> int:
    # never through a link; a FIFO must not block the open
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))


def _read_header(path: Path) -> tuple[dict[str, str], int]:
    """(``__metadata__``, file size) of the entry at ``path``, reading only its header."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise InvalidEntryError(path, f"unreadable: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidEntryError(path, f"not a regular file ({file_kind(st.st_mode)})")
    try:
        with open(path, "rb", opener=_opener) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):  # replaced since the lstat
                raise InvalidEntryError(path, f"not a regular file ({file_kind(st.st_mode)})")
            head = f.read(8)
            if len(head) != 8:
                raise InvalidEntryError(path, "truncated: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise InvalidEntryError(path, f"header length {n} is implausible (not an entry or corrupt)")
            raw = f.read(n)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidEntryError(path, "not a regular file (symbolic link)") from None
        raise InvalidEntryError(path, f"unreadable: {exc.strerror or exc}") from None
    if len(raw) != n:
        raise InvalidEntryError(path, "truncated inside the safetensors header")
    try:
        header = loads_bounded(raw, max_bytes=MAX_HEADER)
    except ValueError as exc:
        raise InvalidEntryError(path, f"the safetensors header is unusable: {_clip(exc)}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise InvalidEntryError(path, "no metadata: not an exl3rt cache entry")
    for k, v in meta.items():
        if not isinstance(v, str):
            raise InvalidEntryError(path, f"metadata {_short(k)} is not a string")
    return meta, st.st_size


def read_header(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of the entry at ``path``, reading only its header; raises InvalidEntryError.

    Only a regular file is read (a symbolic link, directory or FIFO is an invalid entry); the header is
    parsed with :func:`loads_bounded` (at most :data:`MAX_HEADER` bytes, nested at most 8 levels).
    """
    return _read_header(path)[0]


@dataclasses.dataclass
class EntryMetadata:
    """What :func:`check_metadata` parsed out of an entry's metadata."""

    key: CacheKey
    info: dict[str, Any]
    proxy_err: Optional[float]
    encode_seconds: Optional[float]
    created: float


def _number(meta: dict[str, str], field: str, path: Path, *, empty_ok: bool, finite: bool = True) -> Optional[float]:
    raw = meta[field]
    if raw == "" and empty_ok:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidEntryError(path, f"metadata {field}={_short(raw)} is not a number") from None
    if finite and not math.isfinite(value):
        raise InvalidEntryError(path, f"metadata {field}={_short(raw)} is not a finite number")
    return value


def check_metadata(meta: dict[str, str], path: Path, key: Optional[CacheKey] = None) -> EntryMetadata:
    """Check every metadata field of the entry at ``path``; raise InvalidEntryError naming the first bad one.

    With ``key`` (a load), the stored ``key`` must be its canonical JSON byte for byte; with ``key=None``
    (``exl3rt cache verify``, ``ls``), the stored key must parse, be canonical, and its digest name the
    file. Fields that need the tensors (``payload_digest``, ``bits`` against the trellis) are compared
    against them by :func:`read_entry`; here they are only checked for form.
    """
    if meta.get("format") != FORMAT:
        raise InvalidEntryError(path, f"format tag is {_short(meta.get('format'))}, expected {FORMAT!r}")
    missing = [f for f in METADATA_FIELDS if f not in meta]
    if missing:
        raise InvalidEntryError(path, f"metadata field(s) {', '.join(missing)} missing")
    unknown = sorted(set(meta) - set(METADATA_FIELDS))
    if unknown:
        raise InvalidEntryError(path, f"unknown metadata field(s) {', '.join(_short(u) for u in unknown[:5])}")
    if meta["schema"] != str(SCHEMA):
        raise InvalidEntryError(path, f"metadata schema={_short(meta['schema'])}, expected '{SCHEMA}'")
    stored = meta["key"]
    if key is not None:
        if stored != key.canonical_json():
            raise InvalidEntryError(path, "key metadata does not match the expected key (hash collision of "
                                    "the file name, a forged or a misplaced entry)")
    else:
        try:
            key = CacheKey.from_json(stored)
        except Exception as exc:  # CacheError mostly; hostile values can raise others (OverflowError, ...)
            raise InvalidEntryError(path, f"metadata key is unusable: {_clip(exc)}") from None
        if stored != key.canonical_json():
            raise InvalidEntryError(path, "metadata key is not in canonical form (edited)")
    if key.schema != SCHEMA:
        raise InvalidEntryError(path, f"the key's schema {key.schema} is not {SCHEMA}")
    digest = key.digest()
    if meta["key_digest"] != digest:
        raise InvalidEntryError(path, f"metadata key_digest={_short(meta['key_digest'])} differs from the key's "
                                f"digest {digest}")
    if path.name != digest + SUFFIX:
        raise InvalidEntryError(path, f"file name does not match its key digest {digest} "
                                f"(renamed, or metadata forged)")
    if meta["codebook"] != key.codebook:
        raise InvalidEntryError(path, f"metadata codebook={_short(meta['codebook'])} differs from the key's "
                                f"{key.codebook!r}")
    for field, want in (("bits", key.bits), ("in_features", key.in_features), ("out_features", key.out_features)):
        if meta[field] != str(want):
            raise InvalidEntryError(path, f"metadata {field}={_short(meta[field])} differs from the key's {want}")
    proxy_err = _number(meta, "proxy_err", path, empty_ok=True, finite=False)  # NaN: "non-finite" in read_entry
    encode_seconds = _number(meta, "encode_seconds", path, empty_ok=True)
    created = _number(meta, "created", path, empty_ok=False)
    if not _HEX64.fullmatch(meta["payload_digest"]):
        raise InvalidEntryError(path, f"metadata payload_digest={_short(meta['payload_digest'])} is not a "
                                f"64-digit hex digest")
    try:
        info = loads_bounded(meta["info"], max_bytes=MAX_FIELD_JSON)
    except ValueError as exc:
        raise InvalidEntryError(path, f"metadata info is unusable: {_clip(exc)}") from None
    if not isinstance(info, dict):
        raise InvalidEntryError(path, f"metadata info is a JSON {type(info).__name__}, not an object")
    for k, v in info.items():
        if not (v is None or isinstance(v, (bool, int, float, str))):
            raise InvalidEntryError(path, f"metadata info[{_short(k)}] is not a scalar")
    if not _VERSION.fullmatch(meta["exl3rt_version"]):
        raise InvalidEntryError(path, f"metadata exl3rt_version={_short(meta['exl3rt_version'])} is not a version")
    return EntryMetadata(key, info, proxy_err, encode_seconds, created)  # type: ignore[arg-type]


@dataclasses.dataclass
class LoadedEntry:
    """A validated entry: the encoding and the entry's metadata."""

    encoded: EncodedLinear
    metadata: dict[str, str]
    nbytes: int


def read_entry(path: Path, key: Optional[CacheKey] = None) -> LoadedEntry:
    """Load and validate the entry at ``path``; raise InvalidEntryError saying what is wrong.

    Checks, in order: a regular file, header and format tag, every metadata field
    (:func:`check_metadata`: key equal to ``key``'s canonical JSON, or with ``key=None``, as ``exl3rt
    cache verify`` does, a canonical stored key whose digest is the file name), tensor names, dtypes
    and shapes against the key, K from the trellis shape, payload digest, finiteness of
    suh/svh/proxy_err, and finally :class:`EncodedLinear`'s own validation.
    """
    meta, size = _read_header(path)
    checked = check_metadata(meta, path, key)
    key = checked.key
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if (f.metadata() or {}) != meta:  # replaced between the two opens: check what we load
                raise InvalidEntryError(path, "the file changed while it was being read")
            names = set(f.keys())
            if names != set(TENSOR_NAMES):
                raise InvalidEntryError(path, f"tensors are {sorted(names)[:8]}, expected {list(TENSOR_NAMES)}")
            tensors = {n: f.get_tensor(n) for n in TENSOR_NAMES}
    except InvalidEntryError:
        raise
    except Exception as exc:  # safetensors raises its own error type for torn/corrupt files
        raise InvalidEntryError(path, f"cannot be read as safetensors (truncated or corrupt): "
                                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    expect = {"trellis": (torch.int16, key.trellis_shape), "suh": (torch.float16, (key.in_padded,)),
              "svh": (torch.float16, (key.out_padded,))}
    for name, (dtype, shape) in expect.items():
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise InvalidEntryError(path, f"tensor {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
    try:
        trellis_bits = bits_from_trellis(tensors["trellis"])
    except FormatError as exc:
        raise InvalidEntryError(path, str(exc)) from None
    if str(trellis_bits) != meta["bits"]:
        raise InvalidEntryError(path, f"metadata bits={_short(meta['bits'])} differs from K={trellis_bits} of the "
                                f"trellis shape")
    if meta["payload_digest"] != payload_digest(tensors["trellis"], tensors["suh"], tensors["svh"]):
        raise InvalidEntryError(path, "payload digest mismatch: the tensor bytes are corrupt (or payload_digest "
                                "was edited)")
    bad = nonfinite_reason(tensors["suh"], tensors["svh"], checked.proxy_err)
    if bad:
        raise InvalidEntryError(path, f"non-finite: {bad}")
    try:
        enc = EncodedLinear(trellis=tensors["trellis"], suh=tensors["suh"], svh=tensors["svh"],
                            codebook=key.codebook, in_features=key.in_features, out_features=key.out_features)
    except FormatError as exc:
        raise InvalidEntryError(path, str(exc)) from None
    info = dict(checked.info)
    if checked.proxy_err is not None:
        info["proxy_err"] = checked.proxy_err
    info["encode_seconds"] = checked.encode_seconds
    info["cache_path"] = str(path)
    enc.info = info
    return LoadedEntry(enc, meta, size)


@dataclasses.dataclass
class CacheEntryInfo:
    """One name under ``<root>/v1`` as ``exl3rt cache ls`` shows it (from the header only)."""

    path: Path
    digest: str
    size: int
    mtime: float               # last publish or (readwrite) last hit
    key: Optional[dict[str, Any]] = None
    proxy_err: Optional[float] = None
    encode_seconds: Optional[float] = None
    error: Optional[str] = None  # set when the header or its metadata is bad, or this is not a regular file
    regular: bool = True         # False: a directory, link, FIFO … named like an entry (never read or removed)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        return d


def entry_info(path: Path, st: Optional[os.stat_result] = None) -> CacheEntryInfo:
    """Header-level facts of the entry at ``path`` (never raises for a bad entry: sets ``error``).

    ``st`` is the entry's ``lstat`` if the caller has it. Every metadata field is checked
    (:func:`check_metadata`), so ``error`` is set for any entry whose header ``verify`` would reject.
    """
    digest = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.name
    if st is None:
        try:
            st = os.lstat(path)
        except OSError as exc:
            return CacheEntryInfo(path, digest, 0, 0.0, error=f"unreadable: {exc.strerror or exc}")
    if not stat.S_ISREG(st.st_mode):
        return CacheEntryInfo(path, digest, 0, st.st_mtime, error=f"not a regular file ({file_kind(st.st_mode)})",
                              regular=False)
    info = CacheEntryInfo(path, digest, st.st_size, st.st_mtime)
    try:
        meta = read_header(path)
        try:
            stored = loads_bounded(meta.get("key", ""), max_bytes=MAX_FIELD_JSON)
            info.key = stored if isinstance(stored, dict) else None
        except ValueError:
            pass
        checked = check_metadata(meta, path)
        info.proxy_err, info.encode_seconds = checked.proxy_err, checked.encode_seconds
    except InvalidEntryError as exc:
        info.error = exc.reason
    return info


def remove_quietly(path: Path) -> bool:
    """Unlink ``path``; True if it was removed."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
