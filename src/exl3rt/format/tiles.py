"""Tile grid and the order of weights inside a tile.

The rotated weight Q (``in_p × out_p``) is cut into 16×16 tiles; tile (a, b) covers
``Q[16a:16a+16, 16b:16b+16]`` (rows = input index k, columns = output index n) and is stored in
``trellis[a, b, :]``. Inside a tile the 256 weights are coded in stream order ``t = 8·L + j``
(L = lane 0..31, j = 0..7), the mma.m16n8k16 B-fragment order::

    r = 2·(L mod 4) + (j & 1) + 8·((j >> 1) & 1)
    c = (L div 4) + 8·((j >> 2) & 1)

Inverse: ``L = 4·(c mod 8) + (r mod 8) div 2``, ``j = (r & 1) | (r >> 3) << 1 | (c >> 3) << 2``.
"""

from __future__ import annotations

import functools

import torch

from .bits import TILE, TILE_WEIGHTS
from .errors import FormatError


def stream_to_tile(t: int) -> tuple[int, int]:
    """(row, column) inside the tile of stream position ``t``."""
    lane, j = divmod(t, 8)
    r = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = lane // 4 + 8 * ((j >> 2) & 1)
    return r, c


def tile_to_stream(r: int, c: int) -> int:
    """Stream position of tile element (row ``r``, column ``c``)."""
    lane = 4 * (c % 8) + (r % 8) // 2
    j = (r & 1) | ((r >> 3) << 1) | ((c >> 3) << 2)
    return 8 * lane + j


@functools.lru_cache(maxsize=None)
def _perm() -> torch.Tensor:
    return torch.tensor([16 * r + c for r, c in map(stream_to_tile, range(TILE_WEIGHTS))], dtype=torch.int64)


def tensor_core_perm() -> torch.Tensor:
    """``perm[t] = 16·r + c``: the row-major tile index of stream position t (int64 [256])."""
    return _perm()


@functools.lru_cache(maxsize=None)
def _inv_perm() -> torch.Tensor:
    return torch.argsort(_perm())


def tiles_to_matrix(stream: torch.Tensor) -> torch.Tensor:
    """``[tk, tn, 256]`` values in stream order -> matrix ``[16·tk, 16·tn]``."""
    if stream.dim() != 3 or stream.shape[-1] != TILE_WEIGHTS:
        raise FormatError(f"tiles: expected [tk, tn, 256], got {tuple(stream.shape)}")
    tk, tn, _ = stream.shape
    rowmajor = stream[..., _inv_perm().to(stream.device)]  # rowmajor[16r+c] = stream[t(r,c)]
    return rowmajor.reshape(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


def matrix_to_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """Matrix ``[16·tk, 16·tn]`` -> ``[tk, tn, 256]`` in stream order (inverse of :func:`tiles_to_matrix`)."""
    if matrix.dim() != 2 or matrix.shape[0] % TILE or matrix.shape[1] % TILE:
        raise FormatError(f"matrix: expected 2-D with both sides multiples of 16, got {tuple(matrix.shape)}")
    k, n = matrix.shape
    rowmajor = matrix.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(k // TILE, n // TILE, TILE_WEIGHTS)
    return rowmajor[..., _perm().to(matrix.device)]
