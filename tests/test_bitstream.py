"""Bitstream unpack/pack against the golden states, the spec's tile vectors and a bit-by-bit brute force."""

import pytest
import torch

from exl3rt.format import ALL_BITS, FormatError, pack_states, tail_biting_violations, unpack_states
from exl3rt.format.bits import bits_from_trellis, step_bits, words16_per_tile
from exl3rt.format.codebooks import codebook_values
from exl3rt.format.tiles import tile_to_stream

from conftest import LAYER_FILES, load_golden


@pytest.mark.parametrize("name", LAYER_FILES)
def test_golden_states_and_repack(name):
    g, meta = load_golden(name)
    k = bits_from_trellis(g["trellis"])
    assert float(k) == float(meta["K"])
    states = unpack_states(g["trellis"], k)
    if "states" in g:  # integer K only
        assert torch.equal(states, g["states"])
    assert not tail_biting_violations(states, k).any()
    assert torch.equal(pack_states(states, k), g["trellis"])


def brute_states(words16: list[int], bits) -> list[int]:
    """Slow, literal reading of the spec: ring bits from MSB-first uint32 words made of LE int16 pairs."""
    u16 = [w & 0xFFFF for w in words16]
    ring = []
    for w in range(len(u16) // 2):
        u32 = u16[2 * w] | (u16[2 * w + 1] << 16)
        ring += [(u32 >> (31 - i)) & 1 for i in range(32)]
    r, end, out = len(ring), 0, []
    for d in step_bits(bits):
        end += d
        s = 0
        for p in range(end - 16, end):
            s = (s << 1) | ring[p % r]
        out.append(s)
    return out


def lcg_words(n: int, seed: int) -> list[int]:
    x, out = seed, []
    for _ in range(n):
        x = (1664525 * x + 1013904223) % 2**32
        out.append(x >> 16)
    return out


def as_int16(words: list[int]) -> torch.Tensor:
    return torch.tensor([w - 65536 if w >= 32768 else w for w in words], dtype=torch.int16)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpack_matches_brute_force(bits):
    g = torch.Generator().manual_seed(int(bits * 10))
    trellis = torch.randint(-32768, 32768, (2, 3, words16_per_tile(bits)), dtype=torch.int16, generator=g)
    states = unpack_states(trellis, bits)
    for a in range(2):
        for b in range(3):
            want = brute_states([int(w) for w in trellis[a, b]], bits)
            assert [int(s) & 0xFFFF for s in states[a, b]] == want


# exl3_format.md §8.2: one tile filled from the LCG (seed 12345); states at tile positions (r, c)
TILE_VECTORS = {
    1: (0x6632, 0x0a73, 0xcc64, 0x8c82, 0xb319), 2: (0x3f08, 0x2c30, 0xfc20, 0x810f, 0x4fc2),
    3: (0x6eb8, 0x47bc, 0x75c1, 0x8780, 0xedd7), 4: (0xe040, 0xef2c, 0x0404, 0xc053, 0xbe04),
    5: (0x06c0, 0x1357, 0xd810, 0x29cd, 0xd036), 6: (0xe6c1, 0x8cc4, 0xb043, 0xe68a, 0xe39b),
    7: (0x5002, 0x9fba, 0x010f, 0x4513, 0x36a0), 8: (0xf004, 0x19f5, 0x043c, 0x898b, 0x56f0),
}
Q00 = {1: (0.33203125, 0.289306640625, 1.3515625), 2: (0.9189453125, 0.43017578125, -0.2454833984375),
       3: (-0.459228515625, -0.036376953125, 0.478759765625), 4: (-0.5498046875, -1.2685546875, -1.15234375),
       5: (0.24365234375, 0.0792236328125, 0.471923828125), 6: (0.21630859375, 0.458740234375, 0.458251953125),
       7: (-2.169921875, 1.0703125, -1.4228515625), 8: (0.85546875, -0.80126953125, -0.3671875)}
HALF_VECTORS = {1.5: (24, 0xd884, 0x4513, 0x6210, 0x6c42), 2.5: (40, 0x3580, 0x732b, 0xac00, 0x4d60),
                3.5: (56, 0x8ab8, 0x6303, 0xab82, 0x7157)}


def _tile_states(bits):
    words = lcg_words(words16_per_tile(bits), 12345)
    assert words[:4] == [0x0539, 0x043C, 0x8B0C, 0xA289]
    st = unpack_states(as_int16(words).reshape(1, 1, -1), bits)[0, 0]
    return lambda r, c: int(st[tile_to_stream(r, c)]) & 0xFFFF


@pytest.mark.parametrize("bits", sorted(TILE_VECTORS))
def test_spec_tile_vectors_integer(bits):
    at = _tile_states(bits)
    assert tuple(at(r, c) for r, c in ((0, 0), (0, 1), (1, 0), (8, 8), (15, 15))) == TILE_VECTORS[bits]
    for cb, want in zip(("3inst", "mcg", "mul1"), Q00[bits]):
        assert float(codebook_values(cb)[at(0, 0)]) == want


@pytest.mark.parametrize("bits", sorted(HALF_VECTORS))
def test_spec_tile_vectors_half(bits):
    width, *want = HALF_VECTORS[bits]
    assert words16_per_tile(bits) == width
    at = _tile_states(bits)
    assert [at(r, c) for r, c in ((0, 0), (0, 1), (1, 0), (15, 15))] == want


def random_valid_states(bits, tiles: int, seed: int) -> torch.Tensor:
    """Valid tail-biting states built by the shift register from random new bits (independent of unpack)."""
    g = torch.Generator().manual_seed(seed)
    steps = step_bits(bits)
    out = torch.empty((tiles, 256), dtype=torch.int64)
    for i in range(tiles):
        new = [int(torch.randint(0, 1 << d, (1,), generator=g)) for d in steps]
        s = 0
        for _ in range(2):  # run the ring twice so the state before position 0 is the ring's end
            for t, d in enumerate(steps):
                s = ((s << d) | new[t]) & 0xFFFF
                out[i, t] = s
    return out


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_unpack_identity_on_valid_states(bits):
    states = random_valid_states(bits, 5, seed=int(bits * 100))
    assert not tail_biting_violations(states, bits).any()
    packed = pack_states(states, bits)
    assert packed.dtype == torch.int16 and packed.shape == (5, words16_per_tile(bits))
    assert torch.equal(unpack_states(packed, bits).to(torch.int64) & 0xFFFF, states)
    # and unpack∘pack on arbitrary bit patterns
    g = torch.Generator().manual_seed(7)
    trellis = torch.randint(-32768, 32768, (4, 6, words16_per_tile(bits)), dtype=torch.int16, generator=g)
    assert torch.equal(pack_states(unpack_states(trellis, bits), bits), trellis)


def test_pack_rejects_states_that_are_not_a_ring():
    states = random_valid_states(4, 3, seed=1)
    states[1, 17] ^= 0x8000  # an upper bit that the previous state does not carry
    with pytest.raises(FormatError, match="1 tile.*not valid tail-biting rings.*position 17"):
        pack_states(states, 4)
    # validate=False keeps only the low K bits of each state
    loose = pack_states(states, 4, validate=False)
    fixed = states.clone()
    fixed[1, 17] ^= 0x8000
    assert torch.equal(loose, pack_states(fixed, 4))


def test_pack_input_errors():
    with pytest.raises(FormatError, match="last dimension must be 256"):
        pack_states(torch.zeros(3, 255, dtype=torch.int16), 4)
    with pytest.raises(FormatError, match="integer dtype"):
        pack_states(torch.zeros(1, 256), 4)
    with pytest.raises(FormatError, match="0..65535"):
        pack_states(torch.full((1, 256), 70000), 2, validate=False)
    with pytest.raises(FormatError, match="unsupported bitrate 4.5"):
        pack_states(torch.zeros(1, 256, dtype=torch.int16), 4.5)


def test_unpack_input_errors():
    with pytest.raises(FormatError, match="dtype must be torch.int16"):
        unpack_states(torch.zeros(1, 1, 64, dtype=torch.int32), 4)
    with pytest.raises(FormatError, match="last dimension must be 16·K = 64"):
        unpack_states(torch.zeros(1, 1, 48, dtype=torch.int16), 4)
