"""A set of safetensors files read lazily: a model directory (with or without an index) or one file.

A directory's files are those its index names, else ``model.safetensors`` alone when it exists, else every
``*.safetensors`` in it. Every tensor of every one of those files is listed, as transformers and vLLM load them:
a tensor stored in two files is an error naming both, even when the index names only one of them (the loaders
would read the other copy). A directory holding both ``model.safetensors`` and an index that names other files is
refused too: transformers reads ``model.safetensors``, an index reader the shards.

Only headers are read at open; each tensor is memory-mapped and read on request (:meth:`TensorFiles.chunks` reads
one in bounded pieces).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors import safe_open

from .names import file_name_problem
from .safejson import loads_bounded

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

#: bytes per element of each safetensors dtype label
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: the floating-point safetensors dtypes (their values can be NaN or inf)
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})


class TensorFileError(ValueError):
    """A missing, unreadable or inconsistent safetensors file or index."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Header facts of one stored tensor (no data read)."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _DTYPE_BYTES.get(self.dtype, 0)


#: a model's config.json or weight index: far below these in practice (an index of 100k tensors is ~10 MB)
MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = 64


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model directory, size and nesting bounded (a crafted file is an error, not a
    RecursionError)."""
    with open(path, "rb") as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    try:
        data = loads_bounded(raw, max_bytes=MAX_JSON_BYTES, max_depth=MAX_JSON_DEPTH, strict=False)
    except ValueError as exc:
        raise TensorFileError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TensorFileError(f"{path}: expected a JSON object")
    return data


MAX_HEADER_BYTES = 100 << 20     # the safetensors library's own header limit


def truncated_tensor(fpath: Path) -> Optional[str]:
    """If the safetensors file ``fpath`` is shorter than its own header says, a line naming the first tensor cut
    off (the usual result of an interrupted download or copy); else None."""
    import struct

    try:
        size = fpath.stat().st_size
        with open(fpath, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > min(size, MAX_HEADER_BYTES):
                return None
            header = loads_bounded(f.read(hlen).decode("utf-8"), max_bytes=MAX_HEADER_BYTES, strict=False)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    spans = []
    for name, meta in header.items():
        offsets = meta.get("data_offsets") if isinstance(meta, dict) and name != "__metadata__" else None
        if isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets):
            spans.append((offsets[1], offsets[0], name))
    have = size - 8 - hlen
    cut = [s for s in spans if s[0] > have]
    if not cut:
        return None
    end, start, name = min(cut, key=lambda s: s[1])
    return (f"{name}: cut off in {fpath} (the file has {have} data bytes, the tensor needs bytes {start}-{end}; "
            f"{len(cut)} tensor(s) incomplete); the file is truncated: download or copy it again")


def natural_key(name: str) -> list[tuple[int, Any]]:
    """Sort ``layers.10`` after ``layers.9`` (numbers before words at the same depth)."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in name.split(".")]


class TensorFiles:
    """Lazy access to the tensors of a model directory or a single ``.safetensors`` file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.exists():
            raise TensorFileError(f"{self.path}: no such file or directory")
        self.config: Optional[dict[str, Any]] = None
        #: where the file list came from: the index, ``model.safetensors`` alone, or None (every ``*.safetensors`` of
        #: the directory, or the one file given)
        self.source: Optional[str] = None
        if self.path.is_dir():
            self.root = self.path
            if (self.path / CONFIG_NAME).exists():
                self.config = read_json(self.path / CONFIG_NAME)
            files = self._shard_files()
        else:
            if self.path.suffix != ".safetensors":
                raise TensorFileError(f"{self.path}: expected a model directory or a .safetensors file")
            self.root = self.path.parent
            files = {self.path.name: None}
        self.file_names: list[str] = list(files)
        self._handles: dict[str, Any] = {}
        self._expected: dict[str, Optional[set[str]]] = {}
        self._tensors: dict[str, TensorInfo] = {}
        for fname, expected in files.items():
            self._read_header(fname, expected)

    def _shard_files(self) -> dict[str, Optional[set[str]]]:
        index_path = self.path / INDEX_NAME
        if index_path.exists():
            wmap = read_json(index_path).get("weight_map")
            if not isinstance(wmap, dict) or not wmap:
                raise TensorFileError(f"{index_path}: missing or empty 'weight_map'")
            files: dict[str, Optional[set[str]]] = {}
            for tname, fname in wmap.items():
                problem = file_name_problem(fname)
                if problem:
                    raise TensorFileError(f"{index_path}: the shard of tensor {tname!r}, {fname!r}, {problem}")
                files.setdefault(fname, set()).add(tname)
            for fname in files:
                if not (self.path / fname).is_file():
                    raise TensorFileError(f"{index_path}: shard {fname!r} is listed but missing from {self.path}")
            if (self.path / SINGLE_NAME).is_file() and set(files) != {SINGLE_NAME}:
                # transformers prefers model.safetensors, this reader the index: two models in one directory
                other = sorted(set(files) - {SINGLE_NAME}, key=natural_key)
                raise TensorFileError(f"{self.path}: holds both {SINGLE_NAME} and {INDEX_NAME}, which names other "
                                      f"shards ({other[0]}{', ...' if len(other) > 1 else ''}); transformers would "
                                      f"load {SINGLE_NAME}, exl3rt the index: remove the one that is not this model")
            self.source = INDEX_NAME
            return files
        if (self.path / SINGLE_NAME).is_file():
            # as transformers reads it: other safetensors beside it are not the model's
            self.source = SINGLE_NAME
            return {SINGLE_NAME: None}
        found = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not found:
            raise TensorFileError(f"{self.path}: no .safetensors files (and no {INDEX_NAME})")
        return {f: None for f in found}

    def _read_header(self, fname: str, expected: Optional[set[str]]) -> None:
        fpath = self.root / fname
        try:
            handle = safe_open(str(fpath), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            cut = truncated_tensor(fpath)
            if cut:
                raise TensorFileError(cut) from None
            raise TensorFileError(f"{fpath}: not a readable safetensors file ({exc})") from None
        self._handles[fname] = handle
        self._expected[fname] = expected
        keys = set(handle.keys())
        if expected is not None and not expected <= keys:
            missing = sorted(expected - keys, key=natural_key)
            raise TensorFileError(f"{missing[0]}: missing from {fpath}, where {INDEX_NAME} places it "
                                  f"({len(missing)} tensor(s) missing); the checkpoint is incomplete (download or "
                                  f"copy it again)")
        for name in sorted(keys, key=natural_key):
            # every tensor of the file counts, whatever the index says: transformers and vLLM load them all
            if name in self._tensors:
                first = self._tensors[name].file
                where = self._index_note(name, first, fname)
                raise TensorFileError(f"{name}: stored twice, in {self.root / first} and in {fpath}{where}; a tensor "
                                      f"must be in exactly one shard (a loader may read either copy): remove the "
                                      f"stale copy, or download or copy the checkpoint again")
            sl = handle.get_slice(name)
            self._tensors[name] = TensorInfo(name, fname, sl.get_dtype(), tuple(sl.get_shape()))

    def _index_note(self, name: str, *files: str) -> str:
        if self.source != INDEX_NAME:
            return ""
        named = [f for f in files if name in (self._expected.get(f) or ())]
        return f" ({INDEX_NAME} names {named[0]})" if named else ""

    def names(self) -> list[str]:
        return sorted(self._tensors, key=natural_key)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise TensorFileError(f"{name}: no such tensor in {self.path}") from None

    def tensor(self, name: str) -> torch.Tensor:
        """Load one tensor (memory-mapped read of just that tensor)."""
        return self._handles[self.info(name).file].get_tensor(name)

    def chunks(self, name: str, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        """Tensor ``name`` in consecutive slices along its first dimension, each at most ``max_bytes`` (or one row),
        so that a scan of a large tensor holds one slice at a time."""
        info = self.info(name)
        handle = self._handles[info.file]
        if not info.shape or info.numel == 0:
            yield handle.get_tensor(name)
            return
        rows = info.shape[0]
        step = max(1, max_bytes // max(1, info.nbytes // rows))
        sl = handle.get_slice(name)
        for start in range(0, rows, step):
            yield sl[start:start + step]
