"""Reading EXL3 checkpoints: a model directory (sharded safetensors + index + config.json) or one file.

Layout (exllamav3 ``conversion/compile.py``):

- ``config.json`` with ``quantization_config = {"quant_method": "exl3", "bits": …, "head_bits": …, …}``;
- ``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json`` (``weight_map``),
  or any set of ``*.safetensors`` files without an index;
- optional ``quantization_config.json`` (per-module ``tensor_storage``; informational).

A linear is EXL3 iff it has ``<key>.trellis`` plus ``suh`` (or legacy ``su``) plus ``svh`` (or ``sv``); a
trellis with ``<key>.signs`` is a quantized table (exllamav3's quantized embeddings), listed in ``tables``.
A linear's scales without its trellis (or the reverse), or a tensor under a linear's name that EXL3 does not
define, is a FormatError naming the tensor: listing never silently drops part of a checkpoint.
Listing reads only the safetensors headers, and checks what they tell: each EXL3 tensor's dtype exactly as the
format stores it (``STORED_DTYPES``: nothing is cast), suh/svh/bias/marker shapes against the trellis, each tensor
in exactly one file (:class:`~exl3rt.util.tensorfiles.TensorFiles`), and a ``transformers_weights`` entry of
config.json that would make transformers read other files than these. Tensors are memory-mapped and loaded one linear
at a time. K always comes from the trellis shape, never from config.json. :mod:`exl3rt.format.validate` adds the
checks of config.json against the tensors and of the tensors' values, which every loader and ``inspect`` share.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator, Optional

import torch

from ..util.names import module_path_problem
from ..util.tensorfiles import CONFIG_NAME, INDEX_NAME, TensorFileError, TensorFiles, TensorInfo, natural_key, read_json
from .bits import Bits, bits_from_width, is_half
from .codebooks import MARKERS
from .encoded import PAD, STORED_DTYPES, EncodedLinear, codebook_from_markers
from .errors import FormatError

QCONFIG_NAME = "quantization_config.json"
QUANT_METHOD = "exl3"   # quantization_config.quant_method of an EXL3 checkpoint
__all__ = ["CONFIG_NAME", "INDEX_NAME", "QCONFIG_NAME", "QUANT_METHOD", "Exl3Checkpoint", "LinearInfo", "TensorInfo"]

_LINEAR_PARTS = ("trellis", "suh", "svh", "su", "sv", "bias", *MARKERS)
_EXL3_PARTS = frozenset(_LINEAR_PARTS) - {"bias"}     # parts that only an EXL3 linear stores
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
        try:
            self.files = TensorFiles(path)
        except TensorFileError as exc:
            raise FormatError(str(exc)) from None
        self.path = self.files.path
        self.root = self.files.root
        self.config: Optional[dict[str, Any]] = self.files.config
        self.storage_config: Optional[dict[str, Any]] = None
        if self.path.is_dir() and (self.path / QCONFIG_NAME).exists():
            try:
                self.storage_config = read_json(self.path / QCONFIG_NAME)
            except TensorFileError as exc:
                raise FormatError(str(exc)) from None
        self._check_quant_method()
        self._check_weights_file()
        for n in self.files.names():   # names become module paths in every loader
            problem = module_path_problem(n)
            if problem:
                raise FormatError(f"tensor {n!r} in {self.path}: the name {problem}; not a valid checkpoint "
                                  f"(tensor names are module paths of [A-Za-z0-9_-] segments joined by dots)")
        self._tensors: dict[str, TensorInfo] = {n: self.files.info(n) for n in self.files.names()}
        self._linears = self._find_linears()

    def _check_quant_method(self) -> None:
        qc = self.quantization_config
        if qc is None:
            return
        method = qc.get("quant_method")
        if method != QUANT_METHOD:
            raise FormatError(
                f"{self.root / CONFIG_NAME}: quantization_config.quant_method is {method!r}, not {QUANT_METHOD!r}; "
                f"this is not an EXL3 checkpoint"
            )

    def _check_weights_file(self) -> None:
        """config.json's ``transformers_weights`` makes transformers load that file instead of what this reader
        lists; unless it names what is read here, loaders would disagree on the weights."""
        if self.config is None or "transformers_weights" not in self.config:
            return
        named = self.config["transformers_weights"]
        reads = self.files.source or (self.files.file_names[0] if len(self.files.file_names) == 1 else None)
        if named != reads:
            what = self.files.source or ", ".join(self.files.file_names[:3])
            raise FormatError(f"{self.root / CONFIG_NAME}: transformers_weights names {named!r}, but the checkpoint's "
                              f"weights are read from {what}; transformers would load other tensors than every other "
                              f"EXL3 loader: remove transformers_weights from config.json (or make it name {what})")

    def _check_parts(self, key: str, have: set[str]) -> tuple[int, int]:
        """Dtype (exact, from the header) and shape of every stored part of linear ``key``; its padded widths."""
        trellis = self._tensors[f"{key}.trellis"]
        if len(trellis.shape) != 3:
            raise FormatError(f"{key}.trellis: expected shape [in/16, out/16, 16*K], got {trellis.shape}")
        in_p, out_p = trellis.shape[0] * 16, trellis.shape[1] * 16
        for side, n in (("input", in_p), ("output", out_p)):
            if n == 0 or n % PAD:
                raise FormatError(f"{key}.trellis: shape {list(trellis.shape)} in {self.root / trellis.file} gives a "
                                  f"padded {side} width of {n}, not a positive multiple of {PAD}; the tensor is "
                                  f"corrupt")
        shapes = {"suh": (in_p,), "svh": (out_p,), "su": (in_p // 16,), "sv": (out_p // 16,), "bias": (out_p,)}
        for part in sorted(have & set(_LINEAR_PARTS)):
            info = self._tensors[f"{key}.{part}"]
            want = STORED_DTYPES[part]
            if info.dtype not in want:
                raise FormatError(f"{key}.{part}: stored as {info.dtype} in {self.root / info.file}, but EXL3 stores "
                                  f"it as {' or '.join(want)}; the tensor is mislabelled or from another format and is "
                                  f"not cast: convert the checkpoint again")
            if part in MARKERS:
                ok, want_s = info.numel == 1 and len(info.shape) <= 1, "[] (an int32 scalar)"
            elif part in shapes:
                ok, want_s = info.shape == shapes[part], str(list(shapes[part]))
            else:
                continue
            if not ok:
                raise FormatError(f"{key}.{part}: shape {list(info.shape)} in {self.root / info.file}, but the trellis "
                                  f"{list(trellis.shape)} makes it {want_s}; the checkpoint is corrupt (download or "
                                  f"convert it again)")
        return in_p, out_p

    def _find_linears(self) -> dict[str, LinearInfo]:
        parts: dict[str, set[str]] = {}
        for name in self._tensors:
            key, _, part = name.rpartition(".")
            parts.setdefault(key, set()).add(part)
        out: dict[str, LinearInfo] = {}
        self.tables: list[str] = []
        for key, have in parts.items():
            exl3_parts = have & _EXL3_PARTS
            if "trellis" not in have:
                if exl3_parts:     # scales or a marker without codes: a tensor went missing
                    raise FormatError(f"{key}.trellis: missing from {self.path}, which stores "
                                      f"{', '.join(f'{key}.{p}' for p in sorted(exl3_parts))}; the checkpoint is "
                                      f"incomplete (download or convert it again)")
                continue
            if "signs" in have:
                self.tables.append(key)     # a quantized table (exllamav3 --embed_bits): another format
                continue
            for need, legacy in (("suh", "su"), ("svh", "sv")):
                if need not in have and legacy not in have:
                    raise FormatError(f"{key}.{need}: missing from {self.path} ({key}.trellis is there); the "
                                      f"checkpoint is incomplete (download or convert it again)")
            unknown = sorted(have - _EXL3_PARTS - {"bias"})
            if unknown:
                raise FormatError(f"{key}.{unknown[0]}: not a tensor an EXL3 linear stores (trellis, suh/svh or su/sv, "
                                  f"bias, and an mcg or mul1 codebook marker or none for 3inst); an unknown codebook "
                                  f"marker, or a checkpoint from a newer exllamav3")
            in_p, out_p = self._check_parts(key, have)
            info = self._tensors[f"{key}.trellis"]
            markers = [m for m in MARKERS if m in have]
            if len(markers) > 1:
                raise FormatError(f"{key}: both .mcg and .mul1 markers present")
            bits = bits_from_width(info.shape[2], name=f"{key}.trellis")
            codebook = markers[0] if markers else "3inst"
            if is_half(bits) and codebook != "mul1":
                raise FormatError(f"{key}.trellis: half-integer K = {bits} (from its shape) needs the mul1 codebook, "
                                  f"but the linear's codebook is {codebook}; the checkpoint is corrupt")
            stored = [f"{key}.{p}" for p in _LINEAR_PARTS if p in have]
            out[key] = LinearInfo(
                name=key, in_padded=in_p, out_padded=out_p, bits=bits, codebook=codebook,
                nbytes=sum(self._tensors[p].nbytes for p in stored), has_bias="bias" in have,
            )
        return dict(sorted(out.items(), key=lambda kv: natural_key(kv[0])))

    def check_markers(self) -> None:
        """Read every codebook marker (one int32 each) and check its value, as :meth:`load_linear` does; loaders
        that map the other tensors straight into a model call this, so a wrong marker fails before any use."""
        for info in self._linears.values():
            if info.codebook in MARKERS:
                name = f"{info.name}.{info.codebook}"
                codebook_from_markers({info.codebook: self.tensor(name)}, info.name)

    # ---- public API ----------------------------------------------------------------------------
    @property
    def quantization_config(self) -> Optional[dict[str, Any]]:
        """``config.json``'s ``quantization_config`` (None if absent)."""
        if self.config is None:
            return None
        qc = self.config.get("quantization_config")
        return qc if isinstance(qc, dict) else None

    def tensor_names(self) -> list[str]:
        return sorted(self._tensors, key=natural_key)

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise FormatError(f"{name}: no such tensor in {self.path}") from None

    def tensor(self, name: str) -> torch.Tensor:
        """Load one tensor (memory-mapped read of just that tensor)."""
        self.tensor_info(name)
        return self.files.tensor(name)

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
