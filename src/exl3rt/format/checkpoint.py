"""Reading EXL3 checkpoints: a model directory (sharded safetensors + index + config.json) or one file.

Layout (exllamav3 ``conversion/compile.py``):

- ``config.json`` with ``quantization_config = {"quant_method": "exl3", "bits": …, "head_bits": …, …}``;
- ``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json`` (``weight_map``),
  or any set of ``*.safetensors`` files without an index;
- optional ``quantization_config.json`` (per-module ``tensor_storage``; informational).

A linear is EXL3 iff it has ``<key>.trellis`` plus ``suh`` (or legacy ``su``) plus ``svh`` (or ``sv``).
Listing reads only the safetensors headers; tensors are memory-mapped and loaded one linear at a
time. K always comes from the trellis shape, never from config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors import safe_open

from .bits import Bits, bits_from_width
from .codebooks import MARKERS
from .encoded import EncodedLinear
from .errors import FormatError

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
QCONFIG_NAME = "quantization_config.json"

_LINEAR_PARTS = ("trellis", "suh", "svh", "su", "sv", "bias", *MARKERS)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Header facts of one stored tensor (no data read)."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _DTYPE_BYTES.get(self.dtype, 0)


@dataclasses.dataclass(frozen=True)
class LinearInfo:
    """One quantized linear as listed from headers: padded widths, K from the trellis shape, codebook."""

    name: str
    in_padded: int
    out_padded: int
    bits: Bits
    codebook: str
    nbytes: int
    has_bias: bool

    @property
    def num_weights(self) -> int:
        return self.in_padded * self.out_padded

    @property
    def trellis_bits(self) -> int:
        return int(self.num_weights * self.bits)


class Exl3Checkpoint:
    """A lazily read EXL3 checkpoint. ``path`` is a model directory or a single ``.safetensors`` file.

    >>> ckpt = Exl3Checkpoint("model-exl3")          # doctest: +SKIP
    >>> [l.name for l in ckpt.linears()][:1]          # doctest: +SKIP
    ['model.layers.0.self_attn.q_proj']
    >>> lin = ckpt.load_linear("model.layers.0.self_attn.q_proj")   # EncodedLinear   # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.exists():
            raise FormatError(f"{self.path}: no such file or directory")
        self.config: Optional[dict[str, Any]] = None
        self.storage_config: Optional[dict[str, Any]] = None
        if self.path.is_dir():
            self.root = self.path
            self.config = _read_json(self.path / CONFIG_NAME) if (self.path / CONFIG_NAME).exists() else None
            if (self.path / QCONFIG_NAME).exists():
                self.storage_config = _read_json(self.path / QCONFIG_NAME)
            files = self._shard_files()
        else:
            if self.path.suffix != ".safetensors":
                raise FormatError(f"{self.path}: expected a model directory or a .safetensors file")
            self.root = self.path.parent
            files = {self.path.name: None}
        self._check_quant_method()
        self._handles: dict[str, Any] = {}
        self._tensors: dict[str, TensorInfo] = {}
        for fname, expected in files.items():
            self._read_header(fname, expected)
        self._linears = self._find_linears()

    # ---- discovery -----------------------------------------------------------------------------
    def _shard_files(self) -> dict[str, Optional[set[str]]]:
        index_path = self.path / INDEX_NAME
        if index_path.exists():
            index = _read_json(index_path)
            wmap = index.get("weight_map")
            if not isinstance(wmap, dict) or not wmap:
                raise FormatError(f"{index_path}: missing or empty 'weight_map'")
            files: dict[str, Optional[set[str]]] = {}
            for tname, fname in wmap.items():
                files.setdefault(fname, set()).add(tname)
            for fname in files:
                if not (self.path / fname).is_file():
                    raise FormatError(f"{index_path}: shard {fname!r} is listed but missing from {self.path}")
            return files
        found = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not found:
            raise FormatError(f"{self.path}: no .safetensors files (and no {INDEX_NAME})")
        return {f: None for f in found}

    def _check_quant_method(self) -> None:
        qc = self.quantization_config
        if qc is None:
            return
        method = qc.get("quant_method")
        if method != "exl3":
            raise FormatError(
                f"{self.root / CONFIG_NAME}: quantization_config.quant_method is {method!r}, not 'exl3'; "
                f"this is not an EXL3 checkpoint"
            )

    def _read_header(self, fname: str, expected: Optional[set[str]]) -> None:
        fpath = self.root / fname
        try:
            handle = safe_open(str(fpath), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise FormatError(f"{fpath}: not a readable safetensors file ({exc})") from None
        self._handles[fname] = handle
        keys = set(handle.keys())
        if expected is not None and not expected <= keys:
            missing = sorted(expected - keys)[:3]
            raise FormatError(f"{fpath}: the index lists tensors missing from this shard, e.g. {missing}")
        for name in keys:
            if expected is not None and name not in expected:
                continue  # not this shard's per the index
            if name in self._tensors:
                raise FormatError(f"{name}: stored twice ({self._tensors[name].file} and {fname})")
            sl = handle.get_slice(name)
            self._tensors[name] = TensorInfo(name, fname, sl.get_dtype(), tuple(sl.get_shape()))

    def _find_linears(self) -> dict[str, LinearInfo]:
        out: dict[str, LinearInfo] = {}
        for name, info in self._tensors.items():
            if not name.endswith(".trellis"):
                continue
            key = name[: -len(".trellis")]
            has = lambda part: f"{key}.{part}" in self._tensors  # noqa: E731
            if not ((has("suh") or has("su")) and (has("svh") or has("sv"))):
                continue  # e.g. a quantized embedding (trellis + signs): a different format
            if len(info.shape) != 3:
                raise FormatError(f"{name}: expected shape [in/16, out/16, 16*K], got {info.shape}")
            markers = [m for m in MARKERS if has(m)]
            if len(markers) > 1:
                raise FormatError(f"{key}: both .mcg and .mul1 markers present")
            parts = [f"{key}.{p}" for p in _LINEAR_PARTS if has(p)]
            out[key] = LinearInfo(
                name=key, in_padded=info.shape[0] * 16, out_padded=info.shape[1] * 16,
                bits=bits_from_width(info.shape[2], name=name),
                codebook=markers[0] if markers else "3inst",
                nbytes=sum(self._tensors[p].nbytes for p in parts), has_bias=has("bias"),
            )
        return dict(sorted(out.items(), key=lambda kv: _natural_key(kv[0])))

    # ---- public API ----------------------------------------------------------------------------
    @property
    def quantization_config(self) -> Optional[dict[str, Any]]:
        """``config.json``'s ``quantization_config`` (None if absent)."""
        if self.config is None:
            return None
        qc = self.config.get("quantization_config")
        return qc if isinstance(qc, dict) else None

    def tensor_names(self) -> list[str]:
        return sorted(self._tensors, key=_natural_key)

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise FormatError(f"{name}: no such tensor in {self.path}") from None

    def tensor(self, name: str) -> torch.Tensor:
        """Load one tensor (memory-mapped read of just that tensor)."""
        info = self.tensor_info(name)
        return self._handles[info.file].get_tensor(name)

    def linears(self) -> list[LinearInfo]:
        """Every quantized linear, in natural name order."""
        return list(self._linears.values())

    def linear_info(self, name: str) -> LinearInfo:
        try:
            return self._linears[name]
        except KeyError:
            raise FormatError(f"{name}: not a quantized linear in {self.path}") from None

    def load_linear(self, name: str, *, device: torch.device | str = "cpu") -> EncodedLinear:
        """Load and validate one linear as an :class:`EncodedLinear` (logical widths = padded widths)."""
        self.linear_info(name)
        tensors = {p: self.tensor(f"{name}.{p}").to(device) for p in _LINEAR_PARTS if f"{name}.{p}" in self._tensors}
        return EncodedLinear.from_state_dict(tensors, name)

    def iter_linears(self, *, device: torch.device | str = "cpu") -> Iterator[tuple[str, EncodedLinear]]:
        """Load the linears one at a time (only one is held by this iterator at once)."""
        for name in self._linears:
            yield name, self.load_linear(name, device=device)

    def other_tensor_names(self) -> list[str]:
        """Tensors that do not belong to a quantized linear (embeddings, norms, routers, …)."""
        owned = {f"{k}.{p}" for k in self._linears for p in _LINEAR_PARTS}
        return [n for n in self.tensor_names() if n not in owned]

    def summary(self) -> dict[str, Any]:
        """Totals: linears, weights, trellis bits and bytes, average K (bits per weight)."""
        lins = self.linears()
        weights = sum(li.num_weights for li in lins)
        tbits = sum(li.trellis_bits for li in lins)
        lbytes = sum(li.nbytes for li in lins)
        other = sum(self._tensors[n].nbytes for n in self.other_tensor_names())
        by_cb: dict[str, int] = {}
        for li in lins:
            by_cb[li.codebook] = by_cb.get(li.codebook, 0) + 1
        return {
            "path": str(self.path),
            "linears": len(lins),
            "weights": weights,
            "bpw": tbits / weights if weights else 0.0,
            "bpw_with_scales": 8 * lbytes / weights if weights else 0.0,
            "linear_bytes": lbytes,
            "other_bytes": other,
            "total_bytes": lbytes + other,
            "codebooks": by_cb,
            "config_bits": (self.quantization_config or {}).get("bits"),
        }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return data


def _natural_key(name: str) -> list[tuple[int, Any]]:
    """Sort ``layers.10`` after ``layers.9`` (numbers before words at the same depth)."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in name.split(".")]
