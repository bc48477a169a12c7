"""Bitrates: which K exist, and how K follows from a trellis shape.

A tile is a tail-biting ring of ``R`` bits holding 256 weights:

- integer K in 1..8: ``R = 256·K`` bits, stored as ``16·K`` int16 per tile;
- half-integer K = KA + 1/2 (KA in 1..3, ``mul1`` codebook only): position ``i`` advances by
  ``D(i) = KA + ((0xAAAA >> (i & 15)) & 1)`` bits (odd positions take one more bit), so
  ``R = 256·KA + 128`` bits, stored as ``16·KA + 8`` int16 per tile.

The stored width therefore determines K uniquely; K is always derived from the trellis shape,
never from config.json.
"""

from __future__ import annotations

from typing import Union

import torch

from .errors import FormatError

Bits = Union[int, float]

INTEGER_BITS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_BITS: tuple[float, ...] = (1.5, 2.5, 3.5)
ALL_BITS: tuple[Bits, ...] = INTEGER_BITS + HALF_BITS

TILE = 16          # a tile is 16 x 16 weights
TILE_WEIGHTS = 256  # weights per tile, coded in stream order t = 0..255


def normalize_bits(bits: Bits, *, name: str = "bits") -> Bits:
    """Return K as ``int`` (1..8) or half-integer ``float`` (1.5, 2.5, 3.5); raise FormatError otherwise."""
    try:
        value = float(bits)
    except (TypeError, ValueError):
        raise FormatError(f"{name}: {bits!r} is not a bitrate; use an integer 1..8 or 1.5, 2.5, 3.5") from None
    if value.is_integer() and int(value) in INTEGER_BITS:
        return int(value)
    if value in HALF_BITS:
        return value
    raise FormatError(
        f"{name}: unsupported bitrate {bits!r}; EXL3 supports integer K = 1..8 and, with the "
        f"mul1 codebook, K = 1.5, 2.5, 3.5"
    )


def is_half(bits: Bits) -> bool:
    """True for the half-integer bitrates."""
    return not float(bits).is_integer()


def words16_per_tile(bits: Bits) -> int:
    """Stored int16 per tile (the trellis last dimension): ``16·K``, or ``16·KA + 8`` for K = KA + 1/2."""
    k = normalize_bits(bits)
    return int(16 * k)


def ring_bits(bits: Bits) -> int:
    """Bits in one tile's ring: ``256·K``."""
    return int(256 * normalize_bits(bits))


def bits_from_width(width: int, *, name: str = "trellis") -> Bits:
    """K from the trellis last dimension (16·K int16 per tile)."""
    for k in ALL_BITS:
        if words16_per_tile(k) == width:
            return k
    raise FormatError(
        f"{name}: last dimension {width} is not 16·K for any supported K "
        f"(expected one of {sorted(words16_per_tile(k) for k in ALL_BITS)})"
    )


def bits_from_trellis(trellis: torch.Tensor, *, name: str = "trellis") -> Bits:
    """K from a trellis tensor's shape ``[in/16, out/16, 16·K]``."""
    if trellis.dim() != 3:
        raise FormatError(f"{name}: expected 3 dimensions [in/16, out/16, 16*K], got shape {tuple(trellis.shape)}")
    return bits_from_width(int(trellis.shape[-1]), name=name)


def step_bits(bits: Bits) -> list[int]:
    """Bits consumed at each of the 256 positions: K everywhere, or alternating KA, KA + 1 for K = KA + 1/2."""
    k = normalize_bits(bits)
    if not is_half(k):
        return [int(k)] * TILE_WEIGHTS
    ka = int(k)
    return [ka + ((0xAAAA >> (i & 15)) & 1) for i in range(TILE_WEIGHTS)]
