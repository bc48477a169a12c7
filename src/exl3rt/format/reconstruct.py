"""Decode a trellis to the rotated-basis matrix Q, and reconstruct the weight W.

    Q[16a + r, 16b + c] = codebook(state of tile (a, b) at stream position t(r, c))      (fp16, exact)
    W = diag(suh) · Hk · Q · Hn · diag(svh)                                              ([in_p, out_p])
    Hk = I ⊗ H128/√128 (in_p/128 blocks),  Hn = I ⊗ H128/√128 (out_p/128 blocks)
    y = x · W + bias        (the Hugging Face weight is Wᵀ[:out, :in])

Only Q is bit-exact across implementations; W depends on the evaluation order at the ~1e-6
(fp32) level. This module is the reference every kernel is tested against.
"""

from __future__ import annotations

import torch

from .bits import Bits, bits_from_trellis, normalize_bits
from .bitstream import unpack_states
from .codebooks import check_codebook, codebook_values_fp16
from .errors import FormatError
from .hadamard import hadamard_blocks
from .tiles import tiles_to_matrix


def decode_stream(trellis: torch.Tensor, bits: Bits, codebook: str) -> torch.Tensor:
    """Values of every tile in stream order: fp16 ``[tk, tn, 256]``."""
    states = unpack_states(trellis, bits)
    lut = codebook_values_fp16(check_codebook(codebook)).to(trellis.device)
    return lut[states.to(torch.int64) & 0xFFFF]


def decode(trellis: torch.Tensor, bits: Bits, codebook: str) -> torch.Tensor:
    """Q, the decoded matrix in the rotated basis: fp16 ``[in_p, out_p]``, bit-exact with the reference.

    ``bits`` must agree with the trellis shape (K is defined by the shape; passing it is a check).
    """
    bits = normalize_bits(bits)
    shape_bits = bits_from_trellis(trellis)
    if shape_bits != bits:
        raise FormatError(
            f"trellis: bits={bits} does not follow from the trellis shape {tuple(trellis.shape)}, "
            f"which encodes K = {shape_bits}"
        )
    return tiles_to_matrix(decode_stream(trellis, bits, codebook))


def _check_scales(name: str, v: torch.Tensor, n: int) -> None:
    if v.dim() != 1 or v.shape[0] != n:
        raise FormatError(f"{name}: expected shape [{n}] to match the trellis, got {tuple(v.shape)}")


def reconstruct(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str,
                *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = diag(suh)·Hk·Q·Hn·diag(svh) in ``dtype`` (fp32 by default), shape ``[in_p, out_p]``.

    K comes from the trellis shape. Use ``dtype=torch.float64`` for an exact reference.
    """
    q = decode(trellis, bits_from_trellis(trellis), codebook).to(dtype)
    _check_scales("suh", suh, q.shape[0])
    _check_scales("svh", svh, q.shape[1])
    w = hadamard_blocks(hadamard_blocks(q, dim=0), dim=1)
    return w * suh.to(dtype)[:, None] * svh.to(dtype)[None, :]
