"""Tests of the Triton (GPU) Viterbi backend, ``exl3rt.encode.viterbi_triton``.

Without a CUDA device the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set
here before triton is imported unless already set). The interpreter is slow (~5-10 s per full 65536-state
tile), so full-size tiles are few; the algorithm is checked in detail on small trellises
(state width L = 6..8 bits) with the very same kernel.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

_ON_GPU = torch.cuda.is_available()
if not _ON_GPU:
    # @triton.jit reads TRITON_INTERPRET when it decorates: set it before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from exl3rt.encode import viterbi_triton as vt  # noqa: E402

if not _ON_GPU and not vt._interpreting():
    pytest.skip("no GPU, and exl3rt.encode.viterbi_triton was imported before TRITON_INTERPRET=1 "
                "could be set (run this file alone or set TRITON_INTERPRET=1)",
                allow_module_level=True)

from exl3rt.format.bitstream import pack_states, tail_biting_violations  # noqa: E402
from exl3rt.format.codebooks import codebook_values  # noqa: E402

DEV = "cuda" if _ON_GPU else "cpu"


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------

def np_encode(targets: np.ndarray, K: int, table: np.ndarray, L: int):
    """Plain numpy two-pass tail-biting Viterbi (same fp32 arithmetic, ties to the smallest k).

    Returns (states [T, N] int64, ring cost [T] float64)."""
    T, N = targets.shape
    NK, E = 1 << K, 1 << (L - K)
    table = table.astype(np.float32)
    s_all = np.arange(1 << L)
    in_edge = s_all >> K
    cols = np.arange(E)

    def run(w, order, start):
        cost, bps = start, {}
        for t in order:
            d = table - np.float32(w[t])
            cand = (d * d + cost[in_edge]).reshape(NK, E)          # state k*E + e -> [k, e]
            k = np.argmin(cand, axis=0)                            # first k on ties
            cost, bps[t] = cand[k, cols], k
        return cost, bps

    out = np.zeros((T, N), dtype=np.int64)
    for i in range(T):
        w = targets[i].astype(np.float32)
        order = [(N // 2 + j) % N for j in range(N)]
        cost, bps = run(w, order, np.zeros(E, np.float32))
        e = int(np.argmin(cost))
        for t in range(N // 2 - 1, -1, -1):
            e = ((int(bps[t][e]) << (L - K)) | e) >> K
        estar = e
        start = np.full(E, np.inf, np.float32)
        start[estar] = 0
        _, bps = run(w, range(N), start)
        e = estar
        for t in range(N - 1, -1, -1):
            s = (int(bps[t][e]) << (L - K)) | e
            out[i, t] = s
            e = s >> K
    err = ((table.astype(np.float64)[out] - targets.astype(np.float64)) ** 2).sum(1)
    return out, err


def ring_ok(states: np.ndarray, K: int, L: int) -> np.ndarray:
    s = np.asarray(states, dtype=np.int64) & ((1 << L) - 1)
    prev = np.roll(s, 1, axis=-1)
    return ((s >> K) == (prev & ((1 << (L - K)) - 1))).all(-1)


def random_ring_states(T: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """States of random valid 256-position rings (the K new bits of each position are random)."""
    c = torch.randint(0, 1 << K, (T, 256), generator=gen)
    states = torch.zeros((T, 256), dtype=torch.int64)
    for j in range(-(-16 // K)):                      # enough symbols to fill 16 bits
        states |= torch.roll(c, j, dims=1) << (K * j)
    return states & 0xFFFF


# ------------------------------------------------------------------------------------------
# codebook decoders inside the kernel
# ------------------------------------------------------------------------------------------

def _decode_all(out_ptr, CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr,
                ASM: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + s, vt._cb_value(s, out_ptr, CB, MULT, ADD, ASM))


_decode_all_kernel = triton.jit(_decode_all)


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_inline_codebook_decode_is_exact(codebook):
    cb = vt.CODEBOOK_IDS[codebook]
    mult, add = vt._CB_AFFINE[cb]
    out = torch.empty(65536, dtype=torch.float32, device=DEV)
    _decode_all_kernel[(65536 // 8192,)](out, CB=cb, MULT=mult, ADD=add,
                                         ASM=not vt._interpreting(), BLOCK=8192)
    assert torch.equal(out.cpu(), codebook_values(codebook))


# ------------------------------------------------------------------------------------------
# the algorithm on small trellises (same kernel, state width L)
# ------------------------------------------------------------------------------------------

SMALL = [  # K, L, N, launch options
    (1, 8, 24, dict(recomp=False)),
    (2, 8, 16, dict(recomp=False, chunk=32)),            # 2 chunks per step
    (2, 8, 32, dict(recomp=True, tpp=2)),
    (3, 8, 16, dict(recomp=True, chunk=16, order=1)),
    (3, 8, 16, dict(recomp=False, tpp=2, order=1)),
    (4, 8, 16, dict(recomp=True, tpp=4)),                # EH = 1, like K = 8 at L = 16
    (2, 8, 16, dict(recomp=False, tpp=4, chunk=16)),
    (2, 10, 16, dict(recomp=False, k_static=False)),
    (2, 8, 16, dict(recomp=False, fuse2=True, tpp=2, chunk=32)),
    (1, 8, 24, dict(recomp=False, fuse2=True, order=1)),
    (3, 8, 8, dict(recomp=False, fuse2=True, tpp=2, lut="fp16")),
]


@pytest.mark.parametrize("K,L,N,kw", SMALL)
def test_matches_reference_small(K, L, N, kw):
    gen = torch.Generator().manual_seed(1000 * K + L + N)
    table = torch.randn(1 << L, generator=gen).half().float()  # exact in an fp16 table too
    targets = torch.randn(3, N, generator=gen)                   # 3 tiles: tpp=2 leaves one odd
    states, values = vt.encode_tiles_custom(targets.to(DEV), K, table, L, **kw)
    states = states.cpu().numpy()
    assert ring_ok(states, K, L).all()
    assert torch.equal(values.cpu(), table[torch.from_numpy(states)])
    want, _ = np_encode(targets.numpy(), K, table.numpy(), L)
    if _ON_GPU:  # the GPU may fuse d*d + prev into an FMA: compare costs, not paths
        got = ((table.double()[torch.from_numpy(states)] - targets.double()) ** 2).sum(1)
        ref = ((table.double()[torch.from_numpy(want)] - targets.double()) ** 2).sum(1)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(states, want)
    try:
        from exl3rt.encode.viterbi_ref import encode_tiles_ref_custom, shifts_for_bits
    except ImportError:  # the reference module is optional here
        return
    ref_states, _ = encode_tiles_ref_custom(targets, shifts_for_bits(K, N), table, L)
    if not _ON_GPU:
        np.testing.assert_array_equal(states, ref_states.numpy())


SMALL16 = [  # fp16 cost scratch: K, L, N, launch options
    (1, 8, 24, dict(recomp=False, fuse2=True, tpp=2)),
    (2, 8, 16, dict(recomp=False, tpp=2, chunk=32)),
    (2, 8, 32, dict(recomp=False, tpp=4, chunk=16)),
    (2, 8, 16, dict(recomp=False, fuse2=True, tpp=2, chunk=32)),
    (3, 8, 16, dict(recomp=True, tpp=4)),
]


@pytest.mark.parametrize("K,L,N,kw", SMALL16)
def test_cost16_small(K, L, N, kw):
    gen = torch.Generator().manual_seed(77 * K + L + N)
    table = torch.randn(1 << L, generator=gen).half().float()
    targets = torch.randn(5, N, generator=gen)
    states, values = vt.encode_tiles_custom(targets.to(DEV), K, table, L, cost16=True, **kw)
    states = states.cpu().numpy()
    assert ring_ok(states, K, L).all()
    assert torch.equal(values.cpu(), table[torch.from_numpy(states)])
    want, _ = np_encode(targets.numpy(), K, table.numpy(), L)
    got = ((table.double()[torch.from_numpy(states)] - targets.double()) ** 2).sum(1)
    ref = ((table.double()[torch.from_numpy(want)] - targets.double()) ** 2).sum(1)
    assert (got >= ref - 1e-6).all()                 # pass 2 is optimal for its junction
    assert torch.allclose(got, ref, rtol=1e-2, atol=1e-2)  # fp16 rounding can move near-ties


def test_pass2_is_optimal_for_its_junction_bruteforce():
    """Every ring of a tiny trellis: the result is the best ring through its own junction
    overlap (what pass 2 guarantees) and no better than the best ring overall."""
    K, L, N = 2, 6, 8
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(1 << L, generator=gen).double()
    targets = torch.randn(4, N, generator=gen)
    states, _ = vt.encode_tiles_custom(targets.to(DEV), K, table.float(), L, tpp=2, recomp=True)
    states = states.cpu()
    # all 4^8 rings: symbol c_t = the K new bits of position t; s_t = (c_{t-2}, c_{t-1}, c_t)
    syms = torch.tensor(list(itertools.product(range(1 << K), repeat=N)))       # [R, N]
    rings = sum(torch.roll(syms, j, dims=1) << (K * j) for j in range(L // K))  # [R, N]
    junction = rings[:, 0] >> K
    for i in range(targets.shape[0]):
        cost = ((table[rings] - targets[i].double()) ** 2).sum(1)
        got = float(((table[states[i]] - targets[i].double()) ** 2).sum())
        assert ring_ok(states[i].numpy(), K, L)
        same = junction == (int(states[i, 0]) >> K)
        assert got == pytest.approx(float(cost[same].min()), rel=1e-6)
        assert got >= float(cost.min()) - 1e-9


# ------------------------------------------------------------------------------------------
# full-size tiles (65536 states)
# ------------------------------------------------------------------------------------------

# chunks above the default 1024 edges; in the CPU interpreter 4096 is the cheap one for the stored-argmin
# variant (K2 3inst on a 2-core CI machine: 1 << 14 292 s, 1 << 13 161 s, 1 << 12 100 s, 1 << 11 93 s,
# 1 << 10 134 s; 2026-12-01)
@pytest.mark.parametrize("K,codebook,kw", [
    (2, "3inst", dict(recomp=False, tpp=1, chunk=1 << 12)),
    (3, "mul1", dict(recomp=True, tpp=1, chunk=1 << 13)),
])
def test_ideal_encode_full_size(K, codebook, kw):
    """Decode a random valid ring and re-encode it: zero error, valid ring."""
    gen = torch.Generator().manual_seed(K)
    states0 = random_ring_states(1, K, gen)
    targets = codebook_values(codebook)[states0]
    states, values = vt.encode_tiles(targets.to(DEV), K, codebook, programs=1, **kw)
    assert states.dtype == torch.int16 and values.dtype == torch.float32
    assert states.shape == values.shape == (1, 256)
    states, values = states.cpu(), values.cpu()
    assert torch.equal(values, targets)                          # exactly zero error
    assert not tail_biting_violations(states, K).any()
    assert torch.equal(codebook_values(codebook)[states.to(torch.int64) & 0xFFFF], values)
    pack_states(states, K)                                       # validates the ring too


def test_errors():
    x = torch.zeros(1, 256, device=DEV)
    with pytest.raises(NotImplementedError, match="half-integer"):
        vt.encode_tiles(x, 2.5, "mul1")
    with pytest.raises(ValueError):
        vt.encode_tiles(torch.zeros(1, 128, device=DEV), 2, "mcg")
    with pytest.raises(ValueError):
        vt.encode_tiles(x, 9, "mcg")
    with pytest.raises(Exception):
        vt.encode_tiles(x, 2, "nope")
    with pytest.raises(TypeError):
        vt.encode_tiles(x, 2, "mcg", no_such_option=1)
    with pytest.raises(ValueError):
        vt.encode_tiles(x, 2, "mcg", fuse2=True, recomp=True)
    s, v = vt.encode_tiles(torch.zeros(0, 256, device=DEV), 3, "mcg")
    assert s.shape == v.shape == (0, 256)
