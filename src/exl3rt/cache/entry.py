"""One cache entry: a safetensors file holding an encoding, and its validation.

Tensors (exactly these names)::

    trellis  int16 [in_p/16, out_p/16, 16·K]
    suh      fp16  [in_p]
    svh      fp16  [out_p]

Metadata (all strings): ``format`` = ``exl3rt-encoding-cache``, ``schema``, ``key`` (the key's canonical
JSON), ``key_digest``, ``codebook``, ``bits``, ``in_features``, ``out_features``, ``proxy_err``
(``repr(float)`` or ``""``), ``encode_seconds``, ``payload_digest`` (BLAKE3 over the three tensors:
catches flipped bits that leave shapes and finiteness intact), ``info`` (JSON of the encoder's scalar
facts), ``created`` (unix time), ``exl3rt_version``.

The bias is not stored: the caller attaches the checkpoint's bias after loading.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..format.encoded import EncodedLinear
from ..format.errors import FormatError
from .errors import InvalidEntryError
from .key import SCHEMA, CacheKey, _hasher, tensor_bytes

FORMAT = "exl3rt-encoding-cache"
TENSOR_NAMES = ("trellis", "suh", "svh")
SUFFIX = ".safetensors"
MAX_HEADER = 1 << 20  # an entry header is ~2 KB; anything past 1 MiB is not ours


def payload_digest(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> str:
    """BLAKE3 over (name, dtype, shape, bytes) of the three stored tensors, in a fixed order."""
    tensors = (trellis, suh, svh)
    h = _hasher(sum(t.numel() * t.element_size() for t in tensors))
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
    """Write one entry file at ``path`` (the caller publishes it atomically)."""
    save_file(tensors, str(path), metadata=metadata)


def read_header(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, reading only its header; raises InvalidEntryError."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise InvalidEntryError(path, "truncated: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise InvalidEntryError(path, f"header length {n} is implausible (not an entry or corrupt)")
            raw = f.read(n)
    except OSError as exc:
        raise InvalidEntryError(path, f"unreadable: {exc.strerror or exc}") from None
    if len(raw) != n:
        raise InvalidEntryError(path, "truncated inside the safetensors header")
    try:
        header = json.loads(raw)
    except ValueError:
        raise InvalidEntryError(path, "the safetensors header is not JSON (corrupt)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise InvalidEntryError(path, "no metadata: not an exl3rt cache entry")
    return {str(k): str(v) for k, v in meta.items()}


def _parse_float(meta: dict[str, str], field: str, path: Path) -> Optional[float]:
    raw = meta.get(field, "")
    if raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise InvalidEntryError(path, f"metadata {field}={raw!r} is not a number") from None


@dataclasses.dataclass
class LoadedEntry:
    """A validated entry: the encoding and the entry's metadata."""

    encoded: EncodedLinear
    metadata: dict[str, str]
    nbytes: int


def read_entry(path: Path, key: Optional[CacheKey] = None) -> LoadedEntry:
    """Load and validate the entry at ``path``; raise InvalidEntryError saying what is wrong.

    Checks, in order: header and format tag, key metadata equal to ``key``'s canonical JSON (with
    ``key=None``, as ``exl3rt cache verify`` does, the stored key must parse and its digest must be
    the file name), tensor names, dtypes and shapes against the key, payload digest, finiteness of
    suh/svh/proxy_err, and finally :class:`EncodedLinear`'s own validation.
    """
    meta = read_header(path)
    if meta.get("format") != FORMAT:
        raise InvalidEntryError(path, f"format tag is {meta.get('format')!r}, expected {FORMAT!r}")
    stored_key = meta.get("key", "")
    if key is None:
        try:
            key = CacheKey.from_json(stored_key)
        except ValueError as exc:
            raise InvalidEntryError(path, f"stored key is unusable: {exc}") from None
        if path.name != key.digest() + SUFFIX:
            raise InvalidEntryError(path, f"file name does not match its key digest {key.digest()} "
                                    f"(renamed, or metadata forged)")
    elif stored_key != key.canonical_json():
        raise InvalidEntryError(path, "key metadata does not match the expected key (hash collision of "
                                "the file name, a forged or a misplaced entry)")
    try:
        size = path.stat().st_size
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = set(f.keys())
            if names != set(TENSOR_NAMES):
                raise InvalidEntryError(path, f"tensors are {sorted(names)}, expected {list(TENSOR_NAMES)}")
            tensors = {n: f.get_tensor(n) for n in TENSOR_NAMES}
    except InvalidEntryError:
        raise
    except Exception as exc:  # safetensors raises its own error type for torn/corrupt files
        raise InvalidEntryError(path, f"cannot be read as safetensors (truncated or corrupt): {exc}") from None
    expect = {"trellis": (torch.int16, key.trellis_shape), "suh": (torch.float16, (key.in_padded,)),
              "svh": (torch.float16, (key.out_padded,))}
    for name, (dtype, shape) in expect.items():
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise InvalidEntryError(path, f"tensor {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
    stored_payload = meta.get("payload_digest", "")
    if stored_payload != payload_digest(tensors["trellis"], tensors["suh"], tensors["svh"]):
        raise InvalidEntryError(path, "payload digest mismatch: the tensor bytes are corrupt")
    proxy_err = _parse_float(meta, "proxy_err", path)
    bad = nonfinite_reason(tensors["suh"], tensors["svh"], proxy_err)
    if bad:
        raise InvalidEntryError(path, f"non-finite: {bad}")
    if meta.get("codebook") != key.codebook:
        raise InvalidEntryError(path, f"codebook metadata {meta.get('codebook')!r} differs from the key's {key.codebook!r}")
    try:
        enc = EncodedLinear(trellis=tensors["trellis"], suh=tensors["suh"], svh=tensors["svh"],
                            codebook=key.codebook, in_features=key.in_features, out_features=key.out_features)
    except FormatError as exc:
        raise InvalidEntryError(path, str(exc)) from None
    try:
        info = json.loads(meta.get("info") or "{}")
    except ValueError:
        info = {}
    info = info if isinstance(info, dict) else {}
    if proxy_err is not None:
        info["proxy_err"] = proxy_err
    info["encode_seconds"] = _parse_float(meta, "encode_seconds", path)
    info["cache_path"] = str(path)
    enc.info = info
    return LoadedEntry(enc, meta, size)


@dataclasses.dataclass
class CacheEntryInfo:
    """One file under ``<root>/v1`` as ``exl3rt cache ls`` shows it (from the header only)."""

    path: Path
    digest: str
    size: int
    mtime: float               # last publish or (readwrite) last hit
    key: Optional[dict[str, Any]] = None
    proxy_err: Optional[float] = None
    encode_seconds: Optional[float] = None
    error: Optional[str] = None  # set when the header cannot be read

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        return d


def entry_info(path: Path) -> CacheEntryInfo:
    """Header-level facts of the entry at ``path`` (never raises for a bad entry: sets ``error``)."""
    digest = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.name
    try:
        st = path.stat()
    except OSError as exc:
        return CacheEntryInfo(path, digest, 0, 0.0, error=f"unreadable: {exc.strerror or exc}")
    info = CacheEntryInfo(path, digest, st.st_size, st.st_mtime)
    try:
        meta = read_header(path)
        info.key = json.loads(meta.get("key", "null"))
        info.proxy_err = float(meta["proxy_err"]) if meta.get("proxy_err") else None
        info.encode_seconds = float(meta["encode_seconds"]) if meta.get("encode_seconds") else None
    except InvalidEntryError as exc:
        info.error = exc.reason
    except (ValueError, KeyError) as exc:
        info.error = f"bad metadata: {exc}"
    return info


def remove_quietly(path: Path) -> bool:
    """Unlink ``path``; True if it was removed."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
