"""Tile quantization of the regularized weight: straight (uncalibrated) or with LDLQ error feedback.

LDLQ (calibrated): with ``H_r = L D Lᵀ`` (L unit block-lower-triangular, ``F = L − I``), process
16-row blocks from the last rows upward; block i is quantized from the target

    T_i = W_i + F[below, i]ᵀ · (W − Q)[below]

which makes the block's contribution to ``tr(Eᵀ H_r E)`` depend only on its own rounding.
Uncalibrated mode is the same with F = 0 (every tile independent), so all tiles go in one batch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..format.tiles import matrix_to_tiles, tiles_to_matrix
from .regularize import TileEncoder

BLOCK = 16
#: tiles per encoder call in uncalibrated mode: small on the CPU (progress granularity), large on a GPU
#: (the Triton backend schedules its own waves and sizes its scratch to the device)
BATCH_TILES = {"cpu": 4096, "cuda": 1 << 20}

Progress = Optional[Callable[[int], None]]  # called with the number of tiles just finished


def quantize_straight(w: torch.Tensor, encode: TileEncoder, bits, codebook: str,
                      progress: Progress = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tile on its own. Returns (states int16 [tk, tn, 256], Q fp32 [in_p, out_p])."""
    tiles = matrix_to_tiles(w)
    tk, tn, _ = tiles.shape
    flat = tiles.reshape(-1, 256).contiguous()
    states = torch.empty(flat.shape, dtype=torch.int16, device=w.device)
    values = torch.empty(flat.shape, dtype=torch.float32, device=w.device)
    batch = BATCH_TILES.get(w.device.type, BATCH_TILES["cpu"])
    for a in range(0, flat.shape[0], batch):
        s, v = encode(flat[a:a + batch], bits, codebook)
        states[a:a + batch] = s.to(w.device)
        values[a:a + batch] = v.to(w.device)
        if progress:
            progress(s.shape[0])
    return states.reshape(tk, tn, 256), tiles_to_matrix(values.reshape(tk, tn, 256))


def quantize_ldlq(w: torch.Tensor, feedback: torch.Tensor, encode: TileEncoder, bits, codebook: str,
                  progress: Progress = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LDLQ from the last 16-row block upward. ``feedback`` is ``L − I`` (``[in_p, in_p]``)."""
    n_in, n_out = w.shape
    fb = feedback.to(w.device, torch.float32)
    err = torch.zeros_like(w)
    q = torch.empty_like(w)
    states = torch.empty((n_in // BLOCK, n_out // BLOCK, 256), dtype=torch.int16, device=w.device)
    for i in range(n_in - BLOCK, -1, -BLOCK):
        target = w[i:i + BLOCK]
        if i + BLOCK < n_in:
            target = target + fb[i + BLOCK:, i:i + BLOCK].T @ err[i + BLOCK:]
        tiles = matrix_to_tiles(target)  # [1, tn, 256]
        s, v = encode(tiles.reshape(-1, 256).contiguous(), bits, codebook)
        states[i // BLOCK] = s.to(w.device)
        q[i:i + BLOCK] = tiles_to_matrix(v.to(w.device).reshape(1, -1, 256))
        err[i:i + BLOCK] = w[i:i + BLOCK] - q[i:i + BLOCK]
        if progress:
            progress(s.shape[0])
    return states, q
