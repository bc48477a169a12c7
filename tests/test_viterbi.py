"""Tail-biting Viterbi tile encoder: torch reference and numba backend against independent truth.

* tiny synthetic trellises (state width L = 5..6, N = 6..8 positions, random codebook): brute
  force over every ring / every open path;
* full size (L = 16, N = 256): the ideal-encode property (a decoded valid tile re-encodes with
  zero error) for every codebook and bit width, numba == reference, ring validity.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exl3rt.encode import viterbi_ref as ref
from exl3rt.encode.viterbi_numba import encode_tiles, encode_tiles_custom, open_costs, open_costs_custom
from exl3rt.format.codebooks import CODEBOOKS, codebook_values

pytest.importorskip("numba")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The reference runs many small torch ops: one intra-op thread is faster and keeps the test
    time stable on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

ALL_BITS = [(cb, k) for cb in CODEBOOKS for k in range(1, 9)] + [("mul1", k) for k in (1.5, 2.5, 3.5)]


def _bits_of(x: np.ndarray, nbits: int) -> np.ndarray:
    """[n] integers -> [n, nbits] bits, MSB first."""
    return ((x[:, None] >> np.arange(nbits - 1, -1, -1)[None, :]) & 1).astype(np.uint8)


def _open_paths(order: list[int], shifts: list[int], L: int) -> np.ndarray:
    """Every open path over positions ``order`` (free first state, then shifts[i] new bits per
    step): int64 states [n_paths, N] indexed by position."""
    nb = L + sum(shifts[i] for i in order[1:])
    x = np.arange(1 << nb, dtype=np.int64)
    states = np.zeros((x.shape[0], len(shifts)), dtype=np.int64)
    used = L
    cur = x >> (nb - L)
    states[:, order[0]] = cur
    for i in order[1:]:
        c = (x >> (nb - used - shifts[i])) & ((1 << shifts[i]) - 1)
        used += shifts[i]
        cur = ((cur << shifts[i]) | c) & ((1 << L) - 1)
        states[:, i] = cur
    return states


def _costs(states: np.ndarray, w: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[B, n_paths] float64 squared error of every path for every target row."""
    t64, w64 = table.astype(np.float64), w.astype(np.float64)
    out = np.zeros((w.shape[0], states.shape[0]))
    for i in range(states.shape[1]):
        out += (t64[states[:, i]][None, :] - w64[:, i, None]) ** 2
    return out


# (L, shifts): integer K = 2; half-integer-style alternating 1/2 (the 0xAAAA rule); K = 2/3
# alternating with no shared middle bits (M = 0).
TINY = [(6, [2] * 8), (6, ref.shifts_for_bits(1.5, 8)), (5, [2, 3] * 3)]


@pytest.fixture(scope="module", params=TINY, ids=lambda p: f"L{p[0]}-" + "".join(map(str, p[1])))
def tiny(request):
    L, shifts = request.param
    rng = np.random.default_rng(1234 + L + sum(shifts))
    table = rng.standard_normal(1 << L).astype(np.float32)
    w = (rng.standard_normal((24, len(shifts))) * 1.1).astype(np.float32)
    R = sum(shifts)
    ring_states = ref.states_from_ring(_bits_of(np.arange(1 << R, dtype=np.int64), R), shifts, L)
    assert ref.is_valid_ring(ring_states, shifts, L).all()
    ring_costs = _costs(ring_states, w, table)
    return L, shifts, table, w, ring_states, ring_costs


def test_brute_force_open_paths(tiny):
    """(a) free-start Viterbi == min over every open path (natural and pass-1 rolled order)."""
    L, shifts, table, w, _, _ = tiny
    w = w[:8]
    N = len(shifts)
    half = N // 2
    for order in (list(range(N)), [(half + j) % N for j in range(N)]):
        paths = _open_paths(order, shifts, L)
        bf = _costs(paths, w, table).min(1)
        cost, states = ref.viterbi_open(w, shifts, table, L, order=order)
        np.testing.assert_allclose(cost.numpy(), bf, rtol=1e-5, atol=1e-6)
        # the returned path is an open path achieving that cost
        st = np.zeros((w.shape[0], N), dtype=np.int64)
        st[:, order] = states.numpy()
        np.testing.assert_allclose(ref.ring_cost(st, w, table), bf, rtol=1e-5, atol=1e-6)
        if order[0] == half:
            # pass 1 of both backends is this rolled open Viterbi
            for kind in ("A", "B"):
                _, _, info = encode_tiles_custom(w, shifts, table, L, kind=kind, return_info=True)
                np.testing.assert_allclose(info["cost1"], bf, rtol=1e-5, atol=1e-6)
            _, _, rinfo = ref.encode_tiles_ref_custom(w, shifts, table, L, return_info=True)
            np.testing.assert_allclose(rinfo["cost1"].numpy(), bf, rtol=1e-5, atol=1e-6)


def test_brute_force_fixed_boundary(tiny):
    """(b) pass 2 == the optimum among rings whose junction overlap is the given edge (every edge)."""
    L, shifts, table, w, ring_states, ring_costs = tiny
    boundary = ring_states[:, 0] >> shifts[0]
    for e in range(1 << (L - shifts[0])):
        bf = ring_costs[:, boundary == e].min(1)
        cost, states = ref.viterbi_fixed_boundary(w, shifts, table, L, e)
        np.testing.assert_allclose(cost.numpy(), bf, rtol=1e-5, atol=1e-6)
        s = states.numpy()
        assert ref.is_valid_ring(s, shifts, L).all()
        assert ((s[:, 0] >> shifts[0]) == e).all()
        np.testing.assert_allclose(ref.ring_cost(s, w, table), bf, rtol=1e-5, atol=1e-6)


def test_brute_force_tail_biting(tiny):
    """(c) the two-pass result: a valid ring, exact optimum for its junction e*, >= the global
    optimum, and close to it on average; both backends identical for both numba kernels."""
    L, shifts, table, w, ring_states, ring_costs = tiny
    s_ref, v_ref, info_ref = ref.encode_tiles_ref_custom(w, shifts, table, L, return_info=True)
    s_ref = s_ref.numpy()
    assert ref.is_valid_ring(s_ref, shifts, L).all()
    np.testing.assert_array_equal(v_ref.numpy(), table[s_ref])
    cost = ref.ring_cost(s_ref, w, table)
    gmin = ring_costs.min(1)
    assert (cost >= gmin * (1 - 1e-6)).all()
    ratio = cost / gmin
    assert np.median(ratio) <= 1.3 and ratio.mean() <= 1.6, ratio
    boundary = ring_states[:, 0] >> shifts[0]
    estar = info_ref["estar"].numpy()
    np.testing.assert_array_equal(estar, s_ref[:, 0] >> shifts[0])
    fixmin = np.array([ring_costs[b, boundary == estar[b]].min() for b in range(w.shape[0])])
    np.testing.assert_allclose(cost, fixmin, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(info_ref["cost2"].numpy(), cost, rtol=1e-5, atol=1e-6)
    for kind in (None, "A", "B"):
        s, v, info = encode_tiles_custom(w, shifts, table, L, kind=kind, return_info=True)
        np.testing.assert_array_equal(s, s_ref)
        np.testing.assert_array_equal(v, table[s_ref])
        np.testing.assert_array_equal(info["estar"], estar)
        np.testing.assert_array_equal(info["cost2"], info_ref["cost2"].numpy())


def test_tiny_nonfinite_targets():
    """NaN / inf targets: still a valid ring, and both backends agree."""
    L, shifts = 6, [2] * 8
    rng = np.random.default_rng(7)
    table = rng.standard_normal(1 << L).astype(np.float32)
    w = rng.standard_normal((5, 8)).astype(np.float32)
    w[0, 3] = np.nan
    w[1, :] = np.nan
    w[2, 5] = np.inf
    w[3, 0] = -np.inf
    s_ref, _ = ref.encode_tiles_ref_custom(w, shifts, table, L)
    for kind in ("A", "B"):
        s, _ = encode_tiles_custom(w, shifts, table, L, kind=kind)
        assert ref.is_valid_ring(s, shifts, L).all()
        np.testing.assert_array_equal(s, s_ref.numpy())


# ---------------------------------------------------------------------------------------- full size


def _random_valid_tiles(n: int, bits, rng) -> np.ndarray:
    shifts = ref.shifts_for_bits(bits, 256)
    ring = rng.integers(0, 2, size=(n, sum(shifts)), dtype=np.uint8)
    return ref.states_from_ring(ring, shifts, 16)


def _check_ring16(states16: np.ndarray, bits) -> None:
    assert states16.dtype == np.int16
    s = states16.astype(np.int64) & 0xFFFF
    assert ref.is_valid_ring(s, ref.shifts_for_bits(bits, 256), 16).all()


@pytest.mark.parametrize("codebook,bits", ALL_BITS, ids=lambda x: str(x))
def test_ideal_encode(codebook, bits):
    """A valid tile, decoded and re-encoded, is reproduced with zero error."""
    rng = np.random.default_rng(int(bits * 2) + 17 * CODEBOOKS.index(codebook))
    table = codebook_values(codebook).numpy()
    states = _random_valid_tiles(3, bits, rng)
    w = table[states]
    s, v = encode_tiles(w, bits, codebook)
    _check_ring16(s, bits)
    np.testing.assert_array_equal(v, w)
    np.testing.assert_array_equal(table[s.astype(np.int64) & 0xFFFF], v)


MATCH = [("mcg", 2), ("3inst", 2), ("mul1", 2), ("mcg", 1), ("3inst", 3), ("mul1", 4),
         ("mcg", 5), ("3inst", 8), ("mul1", 2.5), ("mul1", 3.5)]


@pytest.mark.parametrize("codebook,bits", MATCH, ids=lambda x: str(x))
def test_numba_matches_reference(codebook, bits):
    """Gaussian tiles at full size: identical states and values from both backends; torch in ->
    torch out; thread count does not change the result."""
    rng = np.random.default_rng(99 + int(bits * 2))
    w = torch.from_numpy((rng.standard_normal((3, 256)) * 1.24).astype(np.float32))
    s_ref, v_ref = ref.encode_tiles_ref(w, bits, codebook)
    s, v = encode_tiles(w, bits, codebook, num_threads=2)
    assert isinstance(s, torch.Tensor) and s.dtype == torch.int16 and v.dtype == torch.float32
    assert torch.equal(s, s_ref) and torch.equal(v, v_ref)
    _check_ring16(s.numpy(), bits)
    s1, v1 = encode_tiles(w.numpy(), bits, codebook, num_threads=1)
    assert isinstance(s1, np.ndarray)
    np.testing.assert_array_equal(s1, s.numpy())
    np.testing.assert_array_equal(v1, v.numpy())


@pytest.mark.parametrize("bits", [2, 4, 6, 2.5])
def test_valid_rings_and_quality(bits):
    """Returned states are valid tail-biting rings; values are the codebook's; the MSE on
    Gaussian tiles is close to the rate-distortion floor 2^(-2K)."""
    codebook = "mul1" if bits != int(bits) else "mcg"
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((5, 256)) * 1.24).astype(np.float32)
    s, v = encode_tiles(w, bits, codebook)
    _check_ring16(s, bits)
    table = codebook_values(codebook).numpy()
    np.testing.assert_array_equal(v, table[s.astype(np.int64) & 0xFFFF])
    rel_mse = float(((v - w) ** 2).mean() / (w ** 2).mean())
    db_over_floor = 10 * np.log10(rel_mse / 2.0 ** (-2 * bits))
    assert 0 < db_over_floor < 3.5, db_over_floor


def test_api_edge_cases():
    empty_s, empty_v = encode_tiles(np.zeros((0, 256), np.float32), 3, "mcg")
    assert empty_s.shape == (0, 256) and empty_v.shape == (0, 256)
    with pytest.raises(ValueError):
        encode_tiles(np.zeros((1, 256), np.float32), 2.5, "mcg")   # half-integer needs mul1
    with pytest.raises(ValueError):
        encode_tiles(np.zeros((1, 256), np.float32), 9, "mcg")
    with pytest.raises(ValueError):
        encode_tiles(np.zeros((1, 128), np.float32), 2, "mcg")


def test_open_costs_brute_force(tiny):
    """Pass 1 alone (the g search's error estimate) == min over every open path in pass-1 order,
    for both numba kernels; odd tile counts and one or two threads."""
    L, shifts, table, w, _, _ = tiny
    w = w[:7]
    N = len(shifts)
    order = [(N // 2 + j) % N for j in range(N)]
    bf = _costs(_open_paths(order, shifts, L), w, table).min(1)
    for kind in ("A", "B"):
        for nt in (1, 2):
            got = open_costs_custom(w, shifts, table, L, kind=kind, num_threads=nt)
            assert got.dtype == np.float32 and got.shape == (7,)
            np.testing.assert_allclose(got, bf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("codebook,bits", [("mcg", 1), ("mcg", 2), ("3inst", 4), ("mcg", 6), ("mul1", 2.5)],
                         ids=lambda x: str(x))
def test_open_costs_full_size(codebook, bits):
    """At full size: bit-identical to the full encoder's pass-1 cost and to the torch
    reference's open Viterbi from position 128; below the tail-biting result's error."""
    rng = np.random.default_rng(11 + int(bits * 2))
    w = (rng.standard_normal((5, 256)) * 1.24).astype(np.float32)
    table = codebook_values(codebook).numpy()
    shifts = ref.shifts_for_bits(bits, 256)
    _, v, info = encode_tiles_custom(w, shifts, table, 16, return_info=True)
    got = open_costs(torch.from_numpy(w), bits, codebook, num_threads=2)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), info["cost1"])
    order = [(128 + j) % 256 for j in range(256)]
    cost_ref, _ = ref.viterbi_open(w, shifts, table, 16, order=order)
    np.testing.assert_array_equal(got.numpy(), cost_ref.numpy())
    assert (got.numpy() <= ((v - w) ** 2).sum(1) * (1 + 1e-5)).all()
    assert open_costs(np.zeros((0, 256), np.float32), bits, codebook).shape == (0,)
