"""Trellis bitstream: packed int16 tiles <-> 16-bit states in stream order.

One tile is a tail-biting ring of ``R = 256·K`` bits (``bits.py``). Conventions (exllamav3
``exl3_dq.cuh`` / ``pack.cu``, verified against the golden data):

- stream bit ``p`` is bit ``31 − (p mod 32)`` (MSB-first) of 32-bit word ``p div 32``;
- 32-bit word ``w`` is the little-endian pair of stored int16s: ``u32[w] = u16[2w] | u16[2w+1] << 16``
  (i.e. the int16 row viewed as uint32 on a little-endian machine);
- position ``t`` consumes ``D(t)`` new bits (K, or alternating KA / KA+1 for half-integer K), ending
  at ``S(t) = D(0) + … + D(t)``; its 16-bit state is the ring window ``[S(t) − 16, S(t)) mod R``,
  earliest bit as the MSB. Equivalently ``s_t = ((s_{t−1} << D(t)) | c_t) & 0xFFFF`` with the
  tail-biting wrap ``s_{−1} = s_255``.

All functions work on any torch device and any number of leading dimensions.
"""

from __future__ import annotations

import functools

import torch

from .bits import Bits, TILE_WEIGHTS, normalize_bits, ring_bits, step_bits, words16_per_tile
from .errors import FormatError

_CHUNK_TILES = 16384  # tiles processed at once: bounds temporary memory to ~100 MB


@functools.lru_cache(maxsize=None)
def _layout(bits: Bits) -> dict[str, torch.Tensor]:
    """Per-position index tables for bitrate ``bits`` (CPU tensors; moved to the device on use)."""
    steps = step_bits(bits)
    r = ring_bits(bits)
    nw = r // 32
    ends, starts, acc = [], [], 0
    for d in steps:
        starts.append(acc)  # first new bit of this position
        acc += d
        ends.append(acc)
    assert acc == r
    window_start = torch.tensor([(e - 16) % r for e in ends], dtype=torch.int64)
    new_start = torch.tensor(starts, dtype=torch.int64)
    d = torch.tensor(steps, dtype=torch.int64)
    # window: the 16 bits live in words (wi, wi+1 mod nw) at MSB-first offset o
    wi = window_start // 32
    # new bits: [start, start + D) never wrap the ring; they span word w0 and possibly w0 + 1
    w0 = new_start // 32
    off = new_start % 32
    spill = (off + d - 32).clamp(min=0)  # bits that fall into the next word
    return {
        "w_hi": wi,
        "w_lo": (wi + 1) % nw,
        "shift": 32 - window_start % 32,
        "d": d,
        "w0": w0,
        "w1": torch.where(spill > 0, w0 + 1, w0).clamp(max=nw - 1),
        "sh0": (32 - off - d).clamp(min=0),  # left shift into w0 when it fits
        "rs0": spill,                        # right shift into w0 when it spills
        "sh1": (32 - spill) % 32,            # left shift of the spilled low bits into w1
        "has1": spill > 0,
    }


def _to_uint16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int64) & 0xFFFF


def _to_int16(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFF
    return torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)


def _check_trellis(trellis: torch.Tensor, bits: Bits) -> None:
    if trellis.dtype != torch.int16:
        raise FormatError(f"trellis: dtype must be torch.int16, got {trellis.dtype}")
    w = words16_per_tile(bits)
    if trellis.dim() < 1 or trellis.shape[-1] != w:
        raise FormatError(
            f"trellis: last dimension must be 16·K = {w} for K = {bits}, got shape {tuple(trellis.shape)}"
        )


def unpack_states(trellis: torch.Tensor, bits: Bits) -> torch.Tensor:
    """Unpack ``trellis`` int16 ``[..., 16·K]`` into states int16 ``[..., 256]`` (uint16 values, stream order)."""
    bits = normalize_bits(bits)
    _check_trellis(trellis, bits)
    lead = trellis.shape[:-1]
    flat = trellis.reshape(-1, trellis.shape[-1])
    lay = {k: v.to(trellis.device) for k, v in _layout(bits).items()}
    out = torch.empty((flat.shape[0], TILE_WEIGHTS), dtype=torch.int16, device=trellis.device)
    for a in range(0, flat.shape[0], _CHUNK_TILES):
        u16 = _to_uint16(flat[a:a + _CHUNK_TILES])
        u32 = u16[:, 0::2] | (u16[:, 1::2] << 16)
        # 48-bit view of the word pair (drops the 16 low bits of the second word, never needed)
        y = (u32[:, lay["w_hi"]] << 16) | (u32[:, lay["w_lo"]] >> 16)
        out[a:a + _CHUNK_TILES] = _to_int16(y >> lay["shift"])
    return out.reshape(*lead, TILE_WEIGHTS)


def tail_biting_violations(states: torch.Tensor, bits: Bits) -> torch.Tensor:
    """Boolean ``[..., 256]``: True where state t does not continue state t−1 (with the ring wrap).

    A valid tile satisfies ``s_t >> D(t) == s_{t−1} & (2^(16−D(t)) − 1)`` at every position.
    """
    bits = normalize_bits(bits)
    d = _layout(bits)["d"].to(states.device)
    s = _to_uint16(states)
    prev = torch.roll(s, 1, dims=-1)
    return (s >> d) != (prev & ((1 << (16 - d)) - 1))


def pack_states(states: torch.Tensor, bits: Bits, *, validate: bool = True) -> torch.Tensor:
    """Pack states ``[..., 256]`` (int16 holding uint16, or any integer dtype in 0..65535) into int16 ``[..., 16·K]``.

    Keeps the ``D(t)`` new low bits of each state, in stream order. With ``validate`` (default) the
    states must form a valid tail-biting ring; otherwise the upper bits are silently dropped.
    """
    bits = normalize_bits(bits)
    if states.dtype.is_floating_point or states.dtype == torch.bool or states.dtype.is_complex:
        raise FormatError(f"states: integer dtype required, got {states.dtype}")
    if states.dim() < 1 or states.shape[-1] != TILE_WEIGHTS:
        raise FormatError(f"states: last dimension must be 256 (one tile in stream order), got {tuple(states.shape)}")
    if states.dtype != torch.int16:
        if states.numel() and (int(states.min()) < 0 or int(states.max()) > 0xFFFF):
            raise FormatError("states: values must lie in 0..65535 (or be int16 holding uint16 bits)")
    if validate:
        bad = tail_biting_violations(states, bits)
        if bool(bad.any()):
            tiles = int(bad.reshape(-1, TILE_WEIGHTS).any(dim=-1).sum())
            first = int(bad.reshape(-1).nonzero()[0]) % TILE_WEIGHTS
            raise FormatError(
                f"states: {tiles} tile(s) are not valid tail-biting rings for K = {bits} "
                f"(first break at position {first}: s_t >> D(t) must equal the low bits of s_(t-1))"
            )
    lead = states.shape[:-1]
    flat = states.reshape(-1, TILE_WEIGHTS)
    lay = {k: v.to(states.device) for k, v in _layout(bits).items()}
    nw = ring_bits(bits) // 32
    out = torch.empty((flat.shape[0], 2 * nw), dtype=torch.int16, device=states.device)
    mask = (1 << lay["d"]) - 1
    for a in range(0, flat.shape[0], _CHUNK_TILES):
        c = _to_uint16(flat[a:a + _CHUNK_TILES]) & mask
        part0 = torch.where(lay["has1"], c >> lay["rs0"], c << lay["sh0"])
        part1 = torch.where(lay["has1"], (c << lay["sh1"]) & 0xFFFFFFFF, torch.zeros_like(c))
        words = torch.zeros((c.shape[0], nw), dtype=torch.int64, device=states.device)
        words.index_add_(1, lay["w0"], part0)  # new-bit ranges are disjoint: sum == bitwise or
        words.index_add_(1, lay["w1"], part1)
        u16 = torch.stack([words & 0xFFFF, words >> 16], dim=-1).reshape(c.shape[0], 2 * nw)
        out[a:a + _CHUNK_TILES] = _to_int16(u16)
    return out.reshape(*lead, 2 * nw)
