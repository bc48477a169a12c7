"""Cache keys: what identifies one encoding, and the tensor digests they are built from.

A key holds everything that changes the bytes an encode produces (see :class:`CacheKey` for why each
field is there). Its canonical JSON is stored in every entry and its SHA-256 names the entry file, so
an entry can only be found, and only validates, under the exact inputs that made it.

Tensor contents are hashed with BLAKE3 (``benchmarks/bench_cache.py`` on a 100 MB bf16 tensor, 2 shared
cores: blake3 2.8–4.5 GB/s, sha256 1.2–1.8, blake2b 0.5–0.9, xxh3_128 29–32, xxh64 9–14). XXH3 is faster
but not collision resistant: with a non-cryptographic digest, a crafted checkpoint could collide with
another model's weight and get its own encoding served for it. BLAKE3 is cryptographic and above disk
read rates; tensors of 1 MiB and more are hashed on all cores (same digest).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib
from typing import Any, Mapping, Optional

import torch

from ..format.bits import Bits, normalize_bits
from ..format.codebooks import check_codebook
from ..format.encoded import padded_width
from ..format.errors import FormatError


def module_seed(name: str, seed: int) -> int:
    """The encoding seed of module ``name`` under base ``seed``: from the name alone, never from the order in which
    modules are processed, so an online load, an offline conversion and a cache lookup agree (it is part of the
    cache key)."""
    return (zlib.crc32(name.encode()) + int(seed)) & 0x7FFFFFFF
from .errors import CacheError
from ..util.safejson import loads_bounded

try:
    import blake3 as _blake3
except ImportError:  # pragma: no cover - blake3 is a dependency; message says how to fix
    _blake3 = None

#: Version of the key layout and entry format; part of every key and of the directory name (``v1``).
SCHEMA = 1

#: Largest key JSON accepted from an entry (a real key is a few hundred bytes).
MAX_KEY_JSON = 64 << 10

#: Name of the content hash (recorded in entry metadata).
HASH_NAME = "blake3"

_MT_THRESHOLD = 1 << 20  # hash tensors of 1 MiB and more on all cores (same digest either way)


def new_hasher(nbytes: int = 0) -> Any:
    """A BLAKE3 hasher for ``nbytes`` of data (multithreaded for large inputs)."""
    if _blake3 is None:
        raise CacheError("the encoding cache needs the 'blake3' package (pip install blake3), "
                         "or set EXL3RT_CACHE_MODE=off")
    if nbytes >= _MT_THRESHOLD:
        return _blake3.blake3(max_threads=_blake3.blake3.AUTO)
    return _blake3.blake3()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (copied to CPU and made contiguous if needed; any dtype incl. bf16)."""
    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        raise CacheError(f"cannot hash a {t.layout} tensor; pass a dense tensor")
    if t.device.type == "meta":
        raise CacheError("cannot hash a tensor on the meta device: load the weight before computing its cache key")
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_digest(t: torch.Tensor) -> str:
    """BLAKE3 hex digest of ``t``'s dtype, shape and raw bytes.

    Two tensors have the same digest iff they have the same dtype, shape and bytes (a bf16 weight and
    its fp16 cast differ; so do the same bytes viewed with another shape). Strides and device do not
    matter: the bytes are those of the contiguous CPU copy.
    """
    data = tensor_bytes(t)
    h = new_hasher(data.nbytes)
    h.update(json.dumps([str(t.dtype), list(t.shape)], separators=(",", ":")).encode())
    h.update(b"\0")
    h.update(data)
    return h.hexdigest()


def _canon_bits(bits: Any) -> Bits:
    try:
        return normalize_bits(bits, name="cache key bits")
    except FormatError as exc:
        raise CacheError(str(exc)) from None


def _canon_option(name: str, value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise CacheError(f"cache key option {name}={value!r} is not finite")
        return int(value) if value.is_integer() else value
    raise CacheError(f"cache key option {name}={value!r}: options must be str, int, float, bool or None")


def exact_bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bf16 when it is a float32 or float16 tensor holding only bf16 values (a BF16 checkpoint loaded with
    ``dtype=float32``), else ``t``. The encoder reads every weight as float32, so such a load encodes to exactly the
    codes of the BF16 load: keyed as bf16, both find one cache entry instead of encoding the model again."""
    if t.dtype not in (torch.float32, torch.float16):
        return t
    head = t.detach().reshape(-1)[:4096]       # a genuine fp16/fp32 weight fails here, before a pass over all of it
    if not torch.equal(head.to(torch.bfloat16).to(t.dtype), head):
        return t
    narrow = t.to(torch.bfloat16)
    return narrow if torch.equal(narrow.to(t.dtype), t) else t


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """Everything that determines the bytes of one encoding. Why each field is there:

    - ``source_digest`` / ``source_dtype`` / ``source_shape``: the source weight's *content* (BLAKE3 of
      its bytes, as loaded: HF ``[out, in]``, its own dtype; a float32/float16 weight holding only bf16 values
      as bf16, :func:`exact_bf16`). A changed or re-downloaded checkpoint can never hit a stale entry, and
      identical weights (tied, shared, copied models, a BF16 model loaded in float32) share entries.
    - ``bits``: K, the trellis width (int for integer K so 4 and 4.0 are one key).
    - ``codebook``: 3inst / mcg / mul1 decode states differently.
    - ``seed``: drives the random Hadamard signs.
    - ``encoder_version``: :data:`exl3rt.encode.quantize.ENCODER_VERSION`; bumped whenever the encoder's
      output changes, so old entries stop matching instead of being served.
    - ``hessian_digest``: calibrated encodes depend on the Hessian (LDLQ feedback, refit); "" = none.
    - ``in_features`` / ``out_features``: logical widths of the encoded slice (``[in, out]``).
    - ``in_padded`` / ``out_padded``: the padded widths the trellis covers; a different padding
      policy (e.g. padding for tensor parallelism) changes the encoding.
    - ``tp_size`` / ``tp_rank`` / ``tp_bounds``: which slice of the source this rank encodes,
      ``(row_start, row_end, col_start, col_end)`` of the HF ``[out, in]`` source (``(0,0,0,0)`` =
      the whole tensor). Size and rank are kept even when the bounds say it all, so that two
      slicing schemes can never share an entry by accident.
    - ``out_scales``: the encoder option that turns the output channel scales on/off.
    - ``options``: any other non-default encoder option (e.g. ``refit``, ``sigma_reg``) as sorted
      ``(name, value)`` pairs; empty for the defaults.
    - ``schema``: the key and entry layout version.

    Not in the key, on purpose: the encoder backend (any backend's result is a valid encoding of the
    same inputs; numba is tested bit-identical to the reference, the GPU search may break ties
    differently; the entry's ``info`` records which one made it), the device, the torch version, the
    layer's name (identical weights share an entry).
    """

    source_digest: str
    source_dtype: str
    source_shape: tuple[int, ...]
    bits: float
    codebook: str
    seed: int
    encoder_version: int
    hessian_digest: str = ""
    in_features: int = 0
    out_features: int = 0
    in_padded: int = 0
    out_padded: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    tp_bounds: tuple[int, int, int, int] = (0, 0, 0, 0)
    out_scales: bool = True
    schema: int = SCHEMA
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        set_ = lambda f, v: object.__setattr__(self, f, v)  # noqa: E731 (frozen dataclass)
        set_("bits", _canon_bits(self.bits))
        try:
            check_codebook(self.codebook)
        except FormatError as exc:
            raise CacheError(f"cache key: {exc}") from None
        set_("source_digest", str(self.source_digest))
        set_("source_dtype", str(self.source_dtype))
        set_("hessian_digest", str(self.hessian_digest or ""))
        set_("source_shape", tuple(int(s) for s in self.source_shape))
        for f in ("seed", "encoder_version", "in_features", "out_features", "in_padded", "out_padded",
                  "tp_size", "tp_rank", "schema"):
            value = getattr(self, f)
            if isinstance(value, bool) or int(value) != value:
                raise CacheError(f"cache key field {f}={value!r} must be an integer")
            set_(f, int(value))
        bounds = tuple(int(b) for b in self.tp_bounds)
        if len(bounds) != 4:
            raise CacheError(f"cache key tp_bounds={self.tp_bounds!r} must be (row_start, row_end, col_start, col_end)")
        set_("tp_bounds", bounds)
        set_("out_scales", bool(self.out_scales))
        opts = dict(self.options.items() if isinstance(self.options, Mapping) else self.options)
        set_("options", tuple(sorted((str(k), _canon_option(str(k), v)) for k, v in opts.items())))
        if not 0 <= self.tp_rank < self.tp_size:
            raise CacheError(f"cache key: tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")

    # ---- serialization ------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples as lists, options as a dict)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["source_shape"] = list(self.source_shape)
        d["tp_bounds"] = list(self.tp_bounds)
        d["options"] = dict(self.options)
        return d

    def canonical_json(self) -> str:
        """Compact JSON, keys sorted, ASCII: identical bytes for identical keys in any process."""
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False)

    def digest(self) -> str:
        """SHA-256 hex of :meth:`canonical_json` (names the entry file; reproducible with ``sha256sum``)."""
        return hashlib.sha256(self.canonical_json().encode("ascii")).hexdigest()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CacheKey":
        """Inverse of :meth:`as_dict`; unknown or missing fields raise CacheError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise CacheError(f"cache key has unknown field(s) {sorted(unknown)} (written by a newer exl3rt?)")
        try:
            return cls(**dict(data))
        except TypeError as exc:
            raise CacheError(f"cache key is incomplete: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> "CacheKey":
        try:
            data = loads_bounded(text, max_bytes=MAX_KEY_JSON)
        except ValueError as exc:
            raise CacheError(f"cache key is not usable JSON: {exc}") from None
        if not isinstance(data, dict):
            raise CacheError("cache key JSON is not an object")
        return cls.from_dict(data)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def for_weight(cls, weight_hf: torch.Tensor, *, bits: Bits, codebook: str = "mcg", seed: int = 0,
                   hessian: Optional[torch.Tensor] = None, tp_size: int = 1, tp_rank: int = 0,
                   tp_bounds: Optional[tuple[int, int, int, int]] = None, out_scales: bool = True,
                   options: Optional[Mapping[str, Any]] = None) -> "CacheKey":
        """The key for encoding ``weight_hf`` (HF ``[out, in]``, exactly as loaded: its bytes are hashed).

        Widths: ``in = shape[1]``, ``out = shape[0]``; with ``tp_bounds = (r0, r1, c0, c1)`` (rows =
        output features, columns = input features of ``weight_hf``) the slice ``weight_hf[r0:r1, c0:c1]``
        is what gets encoded, so ``out = r1 - r0`` and ``in = c1 - c0``. ``hessian`` (``[in, in]``) is
        hashed as given. Padded widths follow :func:`exl3rt.format.encoded.padded_width`.
        """
        from ..encode.quantize import ENCODER_VERSION  # lazy: keeps `import exl3rt.cache` light

        if not isinstance(weight_hf, torch.Tensor) or weight_hf.dim() != 2:
            shape = tuple(weight_hf.shape) if isinstance(weight_hf, torch.Tensor) else type(weight_hf).__name__
            raise CacheError(f"cache key: the source weight must be a 2-D [out, in] tensor, got {shape}")
        rows, cols = int(weight_hf.shape[0]), int(weight_hf.shape[1])
        bounds = (0, 0, 0, 0) if tp_bounds is None else tuple(int(b) for b in tp_bounds)
        if len(bounds) != 4:
            raise CacheError(f"cache key: tp_bounds={tp_bounds!r} must be (row_start, row_end, col_start, col_end)")
        if bounds == (0, 0, 0, 0):
            out_f, in_f = rows, cols
        else:
            r0, r1, c0, c1 = bounds
            if not (0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols):
                raise CacheError(f"cache key: tp_bounds={bounds} is not a non-empty slice of the "
                                 f"[{rows}, {cols}] source weight (row_start, row_end, col_start, col_end)")
            out_f, in_f = r1 - r0, c1 - c0
        source = exact_bf16(weight_hf)
        return cls(
            source_digest=tensor_digest(source), source_dtype=str(source.dtype),
            source_shape=(rows, cols), bits=bits, codebook=codebook, seed=int(seed),
            encoder_version=ENCODER_VERSION,
            hessian_digest="" if hessian is None else tensor_digest(hessian),
            in_features=in_f, out_features=out_f, in_padded=padded_width(in_f), out_padded=padded_width(out_f),
            tp_size=tp_size, tp_rank=tp_rank, tp_bounds=bounds, out_scales=out_scales,
            options=tuple((options or {}).items()),
        )

    # ---- derived facts ---------------------------------------------------------------------
    @property
    def trellis_shape(self) -> tuple[int, int, int]:
        """Expected trellis shape ``[in_p/16, out_p/16, 16·K]``."""
        return (self.in_padded // 16, self.out_padded // 16, int(16 * self.bits))

    def describe(self) -> str:
        """Short human form: ``[in x out] K=4 mcg seed 0 (tp 1/4)``."""
        tp = f" tp {self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        cal = " calibrated" if self.hessian_digest else ""
        return (f"[{self.in_features} x {self.out_features}] K={self.bits} {self.codebook} "
                f"seed {self.seed}{cal}{tp}")
