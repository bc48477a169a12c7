"""The 128-block Sylvester Hadamard transform used on both sides of every EXL3 linear.

``H128[i, j] = (−1)^popcount(i & j)`` (natural-order Sylvester, built recursively
``[[h, h], [h, −h]]``), scaled by ``1/√128``: symmetric and orthonormal, hence its own inverse.
Blocks are aligned at multiples of 128 along the transformed dimension; nothing mixes across blocks.
"""

from __future__ import annotations

import functools
import math

import torch

from .errors import FormatError

HAD_BLOCK = 128
HAD_SCALE = 1.0 / math.sqrt(HAD_BLOCK)


@functools.lru_cache(maxsize=None)
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_128(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 *, scaled: bool = True) -> torch.Tensor:
    """The 128×128 Hadamard matrix, scaled by 1/√128 unless ``scaled=False`` (then entries are ±1)."""
    h = _sylvester(HAD_BLOCK)
    if scaled:
        h = h * HAD_SCALE
    return h.to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def _hadamard_cached(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The scaled matrix, built once per (dtype, device); only :func:`hadamard_blocks` uses it (never mutated)."""
    return hadamard_128(dtype, device)


def hadamard_blocks(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Apply the scaled 128-block Hadamard along ``dim`` (length must be a multiple of 128).

    Computes in ``x``'s dtype (use fp32 or fp64 inputs for accuracy); returns a new tensor.
    """
    n = x.shape[dim]
    if n % HAD_BLOCK:
        raise FormatError(f"hadamard: dimension {dim} has length {n}, not a multiple of {HAD_BLOCK}; pad it first")
    xt = x.movedim(dim, -1)
    shape = xt.shape
    h = _hadamard_cached(xt.dtype, xt.device)
    y = (xt.reshape(*shape[:-1], n // HAD_BLOCK, HAD_BLOCK) @ h).reshape(shape)
    return y.movedim(-1, dim)
