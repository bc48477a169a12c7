"""Reference (slow, readable, torch-vectorized) tail-biting Viterbi encoder for trellis tiles.

This is the algorithm of exllamav3's ``quantize_tiles`` (spec §4.6), written for clarity and
parametrized so tests can run it on tiny synthetic trellises.

Model
-----
* A tile is a ring of ``R = sum(shifts)`` bits. Position ``i`` (``0 <= i < N``) consumes
  ``shifts[i]`` new bits; its *state* is the ``L``-bit window of ring bits ending after them,
  earliest bit as the MSB. Equivalently ``s_i = ((s_{i-1} << shifts[i]) | c_i) & (2^L - 1)``
  with the ring closing from position ``N - 1`` back to position ``0``.
  Integer ``K``: ``shifts[i] = K``. Half-integer ``K = KA + 1/2``:
  ``shifts[i] = KA + ((0xAAAA >> (i & 15)) & 1)`` (odd positions take one extra bit).
* *Edges*: the in-edge of position ``i`` is the top ``L - shifts[i]`` bits of ``s_i`` (the
  bits shared with ``s_{i-1}``); its out-edge is the low ``L - shifts[i+1]`` bits (shared with
  ``s_{i+1}``). For out-edge ``e`` of width ``W = L - D'`` (``D' = shifts[i+1]``) the
  candidate states are ``s = (k << W) | e`` for ``k < 2^D'``; the predecessor (in-)edge is
  ``s >> D`` (``D = shifts[i]``).
* Cost: ``cost_i[e] = min_k (cb[s] - w_i)^2 + cost_{i-1}[s >> D]`` in fp32, evaluated as
  ``d = cb[s] - w; d * d + prev`` (no fused multiply-add, so the fast backend can match it bit
  for bit). Ties: strict ``<`` over ``k`` ascending (the smallest ``k`` wins).
* Tail-biting, two passes:
  1. Positions ``N/2 .. N-1, 0 .. N/2-1`` with a free start (cost 0 on every in-edge of
     position ``N/2``). Argmin of the final cost (strict ``<``, first index wins; all
     non-finite -> edge 0), backtrack down to position 0: ``e* = s_0 >> shifts[0]``, the
     overlap at the ``N-1 -> 0`` junction.
  2. Positions ``0 .. N-1`` with only in-edge ``e*`` allowed (cost 0 there, +inf elsewhere);
     backtrack from out-edge ``e*`` at position ``N - 1``. The result is a valid ring:
     ``s_0 >> shifts[0] == s_{N-1} & (2^(L - shifts[0]) - 1)``.
  This is not guaranteed to be the optimal ring, but pass 2 is the exact optimum among rings
  whose junction overlap is ``e*``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch

__all__ = [
    "shifts_for_bits",
    "ring_bits",
    "states_from_ring",
    "ring_cost",
    "is_valid_ring",
    "viterbi_pass",
    "viterbi_open",
    "viterbi_fixed_boundary",
    "encode_tiles_ref",
    "encode_tiles_ref_custom",
]

Bits = Union[int, float]

_CHUNK = 16  # tiles per batch (memory: backpointers are N * 2^(L - K) bytes per tile)


def shifts_for_bits(bits: Bits, n: int = 256) -> list[int]:
    """Per-position shift ``D(i)`` for ``i < n``: ``K`` for integer ``K``; ``KA`` at even and
    ``KA + 1`` at odd positions for ``K = KA + 0.5`` (exllamav3 ``0xAAAA`` pattern)."""
    k2 = float(bits) * 2
    if k2 != int(k2):
        raise ValueError(f"bits must be an integer or a half-integer, got {bits!r}")
    k2 = int(k2)
    if k2 % 2 == 0:
        return [k2 // 2] * n
    ka = k2 // 2
    return [ka + ((0xAAAA >> (i & 15)) & 1) for i in range(n)]


def check_bits(bits: Bits, codebook: str) -> list[int]:
    """Validate an EXL3 (bits, codebook) pair and return the 256 per-position shifts."""
    k2 = float(bits) * 2
    if k2 != int(k2) or not (2 <= k2 <= 16):
        raise ValueError(f"bits must be one of 1..8 or 1.5/2.5/3.5, got {bits!r}")
    if int(k2) % 2 == 1:
        if int(k2) not in (3, 5, 7):
            raise ValueError(f"half-integer bits must be 1.5, 2.5 or 3.5, got {bits!r}")
        if codebook != "mul1":
            raise ValueError(f"half-integer bits ({bits}) exist only for the mul1 codebook, got {codebook!r}")
    return shifts_for_bits(bits, 256)


def ring_bits(shifts: Sequence[int]) -> int:
    return int(sum(shifts))


def states_from_ring(ring: np.ndarray, shifts: Sequence[int], L: int) -> np.ndarray:
    """States of a ring of bits. ``ring``: uint8/bool array ``[..., R]`` (ring bit p at index p).

    State ``i`` = ring bits ``[S(i) - L, S(i)) mod R`` with ``S(i) = shifts[0] + ... + shifts[i]``,
    earliest bit as the MSB. Returns int64 ``[..., N]``.
    """
    ring = np.asarray(ring).astype(np.int64)
    R = ring.shape[-1]
    ends = np.cumsum(np.asarray(shifts, dtype=np.int64))
    assert ends[-1] == R, "ring length must equal sum(shifts)"
    idx = (ends[:, None] - L + np.arange(L)[None, :]) % R          # [N, L], MSB first
    bits = ring[..., idx]                                            # [..., N, L]
    weights = (1 << np.arange(L - 1, -1, -1)).astype(np.int64)
    return (bits * weights).sum(-1)


def is_valid_ring(states: np.ndarray, shifts: Sequence[int], L: int) -> np.ndarray:
    """Whether each row of ``states`` ([..., N], unsigned values < 2^L) is a tail-biting ring:
    ``s_i >> shifts[i] == s_{i-1} & (2^(L - shifts[i]) - 1)`` for every ``i`` (incl. ``i = 0``)."""
    s = np.asarray(states).astype(np.int64) & ((1 << L) - 1)
    d = np.asarray(shifts, dtype=np.int64)
    prev = np.roll(s, 1, axis=-1)
    ok = (s >> d) == (prev & ((1 << (L - d)) - 1))
    return ok.all(-1)


def ring_cost(states: np.ndarray, targets: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Sum over positions of ``(table[s] - w)^2`` in float64."""
    v = np.asarray(table, dtype=np.float64)[np.asarray(states, dtype=np.int64)]
    return ((v - np.asarray(targets, dtype=np.float64)) ** 2).sum(-1)


def _as_f32_tensor(x, device=None) -> torch.Tensor:
    """fp32 contiguous tensor; a tensor keeps its device unless ``device`` is given."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device or x.device, torch.float32).contiguous()
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))


def viterbi_pass(
    w: torch.Tensor,
    positions: Sequence[int],
    shifts: Sequence[int],
    table: torch.Tensor,
    L: int,
    start_cost: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward Viterbi over ``positions`` (indices into the ring, in order).

    ``w``: fp32 ``[B, N]`` targets; ``start_cost``: fp32 ``[B, 2^(L - shifts[positions[0]])]``
    cost of each in-edge of the first position. Returns the cost of each out-edge of the last
    position, ``[B, 2^(L - shifts[next])]``, and the per-step backpointers (uint8 ``k`` indexed
    by out-edge, natural order).
    """
    N = len(shifts)
    prev = start_cost
    bps: list[torch.Tensor] = []
    cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for i in positions:
        D = shifts[i]
        Dn = shifts[(i + 1) % N]
        W = L - Dn
        assert prev.shape[1] == 1 << (L - D)
        if (D, Dn) not in cache:
            k = torch.arange(1 << Dn, dtype=torch.int64, device=w.device)[:, None]
            e = torch.arange(1 << W, dtype=torch.int64, device=w.device)[None, :]
            s = (k << W) | e                                        # [2^D', 2^W] candidate states
            cache[(D, Dn)] = (table[s], s >> D)                     # their values, predecessor edges
        tv, pred = cache[(D, Dn)]
        d = tv[None] - w[:, i, None, None]                          # [B, 2^D', 2^W]
        v = d * d + prev[:, pred]
        best, arg = _min_first(v)
        bps.append(arg)
        prev = best
    return prev, bps


def _min_first(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min over dim 1 with the rule "strict < over k ascending" (start from k = 0)."""
    if not torch.isnan(v).any():
        # no NaN: the running strict-< minimum is the first index of the minimum, which is what
        # torch.min(dim) returns on ties (documented)
        best, arg = v.min(dim=1)
        return best, arg.to(torch.uint8)
    best = v[:, 0].clone()
    arg = torch.zeros(best.shape, dtype=torch.int64, device=v.device)
    for k in range(1, v.shape[1]):
        better = v[:, k] < best
        best = torch.where(better, v[:, k], best)
        arg = torch.where(better, torch.full_like(arg, k), arg)
    return best, arg.to(torch.uint8)


def _backtrack(
    bps: list[torch.Tensor], positions: Sequence[int], shifts: Sequence[int], L: int,
    end_edge: torch.Tensor, stop: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk backpointers from out-edge ``end_edge`` ([B]) of the last position.

    Returns the states at the visited positions ([B, n] in the order of ``positions``; positions
    not visited are 0) and the in-edge of the last visited one. ``stop``: the number of steps
    from the end to walk (default all).
    """
    N = len(shifts)
    n = len(positions)
    B = end_edge.shape[0]
    states = torch.zeros((B, n), dtype=torch.int64, device=end_edge.device)
    e = end_edge.clone()
    rows = torch.arange(B, device=end_edge.device)
    steps = n if stop is None else stop
    for j in range(n - 1, n - 1 - steps, -1):
        i = positions[j]
        D, Dn = shifts[i], shifts[(i + 1) % N]
        k = bps[j][rows, e].to(torch.int64)
        s = (k << (L - Dn)) | e
        states[:, j] = s
        e = s >> D
    return states, e


def _argmin_first(cost: torch.Tensor) -> torch.Tensor:
    """Row-wise index of the smallest finite value (first one on ties); 0 if none is finite."""
    c = torch.where(torch.isfinite(cost), cost, torch.full_like(cost, float("inf")))
    m = c.min(dim=1, keepdim=True).values
    hit = (c == m) & torch.isfinite(c)
    idx = torch.where(hit.any(1), hit.to(torch.int8).argmax(1), torch.zeros(cost.shape[0], dtype=torch.int64, device=cost.device))
    return idx


def viterbi_open(targets, shifts: Sequence[int], table, L: int, order: Optional[Sequence[int]] = None):
    """Free-start, free-end Viterbi over ``order`` (default ``0..N-1``): the minimum over all
    open paths (no ring closure). Returns ``(cost [B] float32, states [B, N] int64 in the order
    of ``order``)``."""
    w = _as_f32_tensor(targets)
    tab = _as_f32_tensor(table, w.device)
    N = len(shifts)
    order = list(range(N)) if order is None else list(order)
    B = w.shape[0]
    start = torch.zeros((B, 1 << (L - shifts[order[0]])), dtype=torch.float32, device=w.device)
    cost, bps = viterbi_pass(w, order, shifts, tab, L, start)
    e = _argmin_first(cost)
    states, _ = _backtrack(bps, order, shifts, L, e)
    return cost[torch.arange(B, device=w.device), e], states


def viterbi_fixed_boundary(targets, shifts: Sequence[int], table, L: int, edge):
    """Pass 2: the optimum over rings whose junction overlap ``s_0 >> shifts[0]`` equals
    ``edge`` ([B] or int). Returns ``(cost [B] float32, states [B, N] int64)``."""
    w = _as_f32_tensor(targets)
    tab = _as_f32_tensor(table, w.device)
    N = len(shifts)
    B = w.shape[0]
    rows = torch.arange(B, device=w.device)
    edge = torch.as_tensor(edge, dtype=torch.int64, device=w.device).expand(B).clone()
    start = torch.full((B, 1 << (L - shifts[0])), float("inf"), dtype=torch.float32, device=w.device)
    start[rows, edge] = 0.0
    cost, bps = viterbi_pass(w, list(range(N)), shifts, tab, L, start)
    states, _ = _backtrack(bps, list(range(N)), shifts, L, edge)
    return cost[rows, edge], states


def encode_tiles_ref_custom(targets, shifts: Sequence[int], table, L: int, return_info: bool = False):
    """Two-pass tail-biting Viterbi on a generic trellis (state width ``L``, ``N = len(shifts)``
    positions, codebook ``table`` of ``2^L`` values).

    Returns int64 states ``[B, N]`` (values ``< 2^L``), fp32 values ``[B, N]`` and, with
    ``return_info``, a dict with ``cost1`` (pass-1 minimum), ``estar`` and ``cost2`` (pass-2
    cost, i.e. the result's squared error as accumulated in fp32).
    """
    w = _as_f32_tensor(targets)
    if w.ndim != 2 or w.shape[1] != len(shifts):
        raise ValueError(f"targets must be [T, {len(shifts)}], got {tuple(w.shape)}")
    if len(shifts) < 2:
        raise ValueError("need at least 2 positions")
    tab = _as_f32_tensor(table, w.device)
    assert tab.numel() == 1 << L
    if w.shape[0] > _CHUNK:
        parts = [encode_tiles_ref_custom(w[c : c + _CHUNK], shifts, tab, L, True)
                 for c in range(0, w.shape[0], _CHUNK)]
        states = torch.cat([p[0] for p in parts])
        values = torch.cat([p[1] for p in parts])
        if return_info:
            return states, values, {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]}
        return states, values
    N = len(shifts)
    B = w.shape[0]
    half = N // 2
    order = [(half + j) % N for j in range(N)]
    start = torch.zeros((B, 1 << (L - shifts[half])), dtype=torch.float32, device=w.device)
    cost1, bps = viterbi_pass(w, order, shifts, tab, L, start)
    e_end = _argmin_first(cost1)
    c1 = cost1[torch.arange(B, device=w.device), e_end]
    # walk back over positions half-1 .. 0 (the last `half` entries of `order`)
    _, estar = _backtrack(bps, order, shifts, L, e_end, stop=half)
    cost2, states = viterbi_fixed_boundary(w, shifts, tab, L, estar)
    values = tab[states]
    if return_info:
        return states, values, {"cost1": c1, "estar": estar, "cost2": cost2}
    return states, values


def encode_tiles_ref(targets, bits: Bits, codebook: str):
    """Reference ``encode_tiles``: ``targets`` fp32 ``[T, 256]`` (stream order), ``bits`` in
    1..8 or 1.5/2.5/3.5 (mul1), ``codebook`` in {3inst, mcg, mul1}.

    Returns ``(states int16 [T, 256], values float32 [T, 256])``; torch in -> torch out (on the
    input's device; runs there), numpy in -> numpy out. Memory: about ``16 * 2^16 * 4`` bytes of
    temporaries plus ``256 * 2^(16 - K)`` bytes of backpointers per tile, in batches of 16 tiles.
    """
    from exl3rt.format.codebooks import codebook_values

    shifts = check_bits(bits, codebook)
    is_torch = isinstance(targets, torch.Tensor)
    w = _as_f32_tensor(targets)
    if w.ndim != 2 or w.shape[1] != 256:
        raise ValueError(f"targets must be [T, 256], got {tuple(w.shape)}")
    table = codebook_values(codebook)
    states, values = encode_tiles_ref_custom(w, shifts, table, 16)
    states16 = torch.where(states >= 0x8000, states - 0x10000, states).to(torch.int16)  # two's complement
    if is_torch:
        return states16, values
    return states16.numpy(), values.numpy()
