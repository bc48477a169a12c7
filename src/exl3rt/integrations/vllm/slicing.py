"""A rank's piece of a stored EXL3 matrix (pure torch: no vLLM import).

``W = diag(suh)·Hk·Q·Hn·diag(svh)`` (``[in_p, out_p]``) with block-diagonal 128-Hadamards, so for
block-aligned ranges the sub-matrix ``W[c0:c1, r0:r1]`` is again an EXL3 matrix with the stored
pieces ``trellis[c0/16:c1/16, r0/16:r1/16]``, ``suh[c0:c1]``, ``svh[r0:r1]``. ``bounds`` are those of
:class:`~exl3rt.integrations.vllm.shards.ShardSpec`: rows = output features (``svh``, trellis dim 1),
columns = input features (``suh``, trellis dim 0). A range ending at the logical width (not a multiple of
128) runs to the padded end of the stored codes (the piece's logical width is trimmed as for a whole matrix).
"""

from __future__ import annotations

import torch

from ...format.encoded import padded_width, unpack_signs
from .shards import ShardSpec

#: stored tensor parts of one linear that the plugin loads (markers are read, not sliced)
PARTS = ("trellis", "suh", "svh", "su", "sv")


def rank_piece(part: str, tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The piece of stored tensor ``part`` this rank keeps (legacy ``su``/``sv`` come back as ``suh``/``svh``)."""
    if part in ("su", "sv"):
        tensor = unpack_signs(tensor, name=f"{spec.name}.{part}")
        part = "suh" if part == "su" else "svh"
    if spec.is_whole:
        return tensor
    r0, r1, c0, c1 = spec.bounds
    rows_split = (r0, r1) != (0, spec.full_out)
    cols_split = (c0, c1) != (0, spec.full_in)
    if r1 == spec.full_out:
        r1 = padded_width(r1)  # to the padded end of the stored codes
    if c1 == spec.full_in:
        c1 = padded_width(c1)
    if part == "trellis":
        if cols_split:
            tensor = tensor[c0 // 16: c1 // 16]
        if rows_split:
            tensor = tensor[:, r0 // 16: r1 // 16]
        return tensor.contiguous()
    if part == "suh":
        return tensor[c0:c1].contiguous() if cols_split else tensor
    if part == "svh":
        return tensor[r0:r1].contiguous() if rows_split else tensor
    raise ValueError(f"{spec.name}: unknown stored part {part!r} (expected one of {', '.join(PARTS)})")


__all__ = ["PARTS", "rank_piece"]
