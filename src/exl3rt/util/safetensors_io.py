"""Write a safetensors file ourselves, streamed, into exactly the path we name.

``safetensors.torch.save_file`` writes to a temporary file of its own (``.tmpXXXXXX``) beside the target
and renames it: a kill during the write leaves that file where our sweeps do not look, and the rename
replaces the file we created (and its permission bits). Writing the format here keeps every byte in the
path the caller chose (an :func:`exl3rt.util.fs.atomic_path` temporary) and never holds a second copy of a
shard in memory.

The layout (as the safetensors library writes it, byte for byte but for the order of the metadata keys,
which it takes from a hash map): an 8-byte little-endian header length,
the JSON header (``__metadata__`` first, then each tensor's dtype, shape and ``[begin, end)`` offsets into
the data), padded with spaces to a multiple of 8, then the tensors' bytes back to back, ordered by dtype
(widest first, so every tensor starts aligned to its element size) and then by name.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Mapping, Optional

import torch

# the safetensors dtype codes in that library's own order (the order it sorts tensors by, widest last)
_DTYPES: tuple[tuple[torch.dtype, str], ...] = tuple((d, code) for d, code in (
    (torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"),
    (getattr(torch, "float8_e5m2", None), "F8_E5M2"), (getattr(torch, "float8_e4m3fn", None), "F8_E4M3"),
    (torch.int16, "I16"), (getattr(torch, "uint16", None), "U16"), (torch.float16, "F16"),
    (torch.bfloat16, "BF16"), (torch.int32, "I32"), (getattr(torch, "uint32", None), "U32"),
    (torch.float32, "F32"), (torch.float64, "F64"), (torch.int64, "I64"), (getattr(torch, "uint64", None), "U64"),
) if d is not None)
_CODE = {d: code for d, code in _DTYPES}
_RANK = {d: i for i, (d, _) in enumerate(_DTYPES)}
_CHUNK = 64 << 20  # bytes per write call: bounded temporaries for very large tensors


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor],
                      metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write ``tensors`` (and string ``metadata``) to ``path`` in the safetensors format; return the file size.

    The file at ``path`` is created or truncated and written in place (no other file is touched); the
    caller publishes it (fsync, rename). Raises ValueError for a dtype safetensors cannot store, a
    non-string metadata value or a sparse tensor.
    """
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise ValueError(f"{name}: only dense tensors can be written to safetensors")
        if t.dtype not in _CODE:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
    order = sorted(tensors, key=lambda n: (-_RANK[tensors[n].dtype], n))
    header: dict[str, object] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"safetensors metadata must map str to str, got {k!r}: {type(v).__name__}")
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _CODE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            data = _flat_bytes(tensors[name])
            for start in range(0, data.numel(), _CHUNK):
                f.write(memoryview(data[start:start + _CHUNK].numpy()))
    return 8 + len(raw) + offset
