"""Incoherence processing: random signs, 128-block Hadamards, channel scales, and the global scale.

For W (``[in_p, out_p]``, fp32) and seeded sign vectors ``su0`` (in), ``sv0`` (out):

1. ``out_rms_n`` = RMS of column n, normalized to mean 1 (all-zero columns: 0.1);
   ``sv = sv0 · out_rms + 1e-10`` (or just ``sv0`` without output scales); ``W ← W / sv`` per column;
   then ``sv[zero columns] = 0``;
2. ``W ← W · Hn`` (blockwise Hadamard on the output side);
3. ``in_rms_k`` = RMS of row k (zeros: 0.1); ``su = su0 · in_rms / (−1.24371088) + 1e-10``; ``W ← W / su``;
4. ``W ← Hk · W``: W now has RMS ≈ 1.2437, the codebooks' RMS;
5. global scale g (:func:`search_global_scale` on :func:`sample_tiles`): ``W ← g·W``, ``su ← su / g``.

Then ``W_original = diag(su) · Hk · W_r · Hn · diag(sv)``, which is exactly the reconstruction
formula with ``suh = su``, ``svh = sv`` once ``W_r`` is replaced by the decoded Q.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ..format.codebooks import CODEBOOK_SCALE
from ..format.hadamard import hadamard_blocks
from ..format.tiles import matrix_to_tiles

#: encode_tiles(targets [T, 256] fp32, bits, codebook) -> (states int16 [T, 256], values fp32 [T, 256])
TileEncoder = Callable[[torch.Tensor, object, str], tuple[torch.Tensor, torch.Tensor]]

#: LDLQ drift factor applied to the g-search samples in calibrated mode (exllamav3 1.6.x)
DRIFT = {1: 1.08, 1.5: 1.035, 2: 1.018, 2.5: 1.009, 3: 1.004}


def random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    """±1 (fp32, CPU) from the signs of ``randn``; zero draws count as +1."""
    return torch.where(torch.randn(n, generator=generator) < 0, -1.0, 1.0)


def _rms(w: torch.Tensor, dim: int) -> torch.Tensor:
    return w.square().mean(dim=dim).sqrt()


@dataclasses.dataclass
class Regularized:
    """The rotated, scaled weight and the scales that undo it."""

    w: torch.Tensor    # [in_p, out_p] fp32, rotated basis, RMS ≈ 1.2437 · g
    su: torch.Tensor   # [in_p] fp32 (sign · scale / g)
    sv: torch.Tensor   # [out_p] fp32 (sign · scale; 0 for all-zero columns)
    g: float = 1.0


def regularize(w: torch.Tensor, su_sign: torch.Tensor, sv_sign: torch.Tensor, *,
               out_scales: bool = True) -> Regularized:
    """Steps 1–4 of the module docstring (the global scale is applied separately)."""
    w = w.to(torch.float32)
    su_sign = su_sign.to(w.device, torch.float32)
    sv_sign = sv_sign.to(w.device, torch.float32)
    col_rms = _rms(w, 0)
    zero_cols = col_rms == 0
    if out_scales:
        out_rms = torch.where(zero_cols, torch.full_like(col_rms, 0.1), col_rms)
        out_rms = out_rms / out_rms.mean()
        sv = sv_sign * out_rms + 1e-10
    else:
        sv = sv_sign.clone()
    w = w / sv[None, :]
    sv = torch.where(zero_cols, torch.zeros_like(sv), sv)
    w = hadamard_blocks(w, dim=1)
    row_rms = _rms(w, 1)
    row_rms = torch.where(row_rms == 0, torch.full_like(row_rms, 0.1), row_rms)
    su = su_sign * row_rms / (-CODEBOOK_SCALE) + 1e-10
    w = w / su[:, None]
    w = hadamard_blocks(w, dim=0)
    return Regularized(w=w, su=su, sv=sv)


#: the g search samples at most this many tiles, or 1/32 of the layer's tiles if that is more
#: (on small layers the reference's sample set costs up to one more whole encode)
SAMPLE_TILES = 128


def sample_tiles(w: torch.Tensor, max_tiles: Optional[int] = None) -> torch.Tensor:
    """Tiles for the g search, in stream order ``[S, 256]``.

    The reference's set: a wrapped diagonal of width 3 over the tile grid (every tile row and
    column appears) plus the ``max(8, 3·diag_len/16)`` highest- and lowest-RMS tiles. When that is
    more than ``max_tiles`` (default ``max(SAMPLE_TILES, tiles // 32)``), the diagonal alone,
    thinned evenly in stream order to ``max_tiles``: the extreme tiles pull g low (the
    highest-RMS tiles dominate the mean error), which a smaller set would feel more.
    """
    tiles = matrix_to_tiles(w)  # [tk, tn, 256]
    tk, tn, _ = tiles.shape
    flat = tiles.reshape(-1, 256)
    cap = max(SAMPLE_TILES, flat.shape[0] // 32) if max_tiles is None else max(1, int(max_tiles))
    diag_len = max(tk, tn)
    diag = sorted({(d % tk) * tn + (d + j) % tn for d in range(diag_len) for j in range(3)})
    rms = _rms(flat, 1)
    extra = min(max(8, 3 * diag_len // 16), flat.shape[0])
    order = torch.argsort(rms)
    ids = set(diag) | set(order[:extra].tolist()) | set(order[-extra:].tolist())
    if len(ids) > cap:
        ids = {diag[(j * len(diag)) // cap] for j in range(min(cap, len(diag)))}
    return flat[sorted(ids)]


def _descend(n: int, start: int, f: Callable[[int], float]) -> dict[int, float]:
    """Evaluate ``f`` on grid indices ``0..n-1`` lazily: from ``start`` and its neighbours, walk
    downhill until the best evaluated point has both neighbours evaluated (or is at a grid end).

    For an objective that is unimodal on the grid this finds the same minimum as evaluating the
    whole grid, at a fraction of the cost (3–4 points instead of all of them, typically).
    """
    errs: dict[int, float] = {}
    todo = [i for i in (start - 1, start, start + 1) if 0 <= i < n]
    while todo:
        for i in todo:
            errs[i] = f(i)
        best = min(errs, key=lambda i: (errs[i], i))
        todo = [j for j in (best - 1, best + 1) if 0 <= j < n and j not in errs]
    return errs


class _TileErrors:
    """Per-tile mean squared error of the samples quantized at scale g (in the unscaled domain),
    computed on demand and remembered per (g, tile), so a tile is never encoded twice at one g.

    With an encoder that has ``open_cost`` (numba, torch) the error of a tile is its pass-1
    open-path minimum (free start and end) instead of the tail-biting encode's: half the work, no
    states; it runs ~4 % below the tail-biting error, nearly uniformly in g, so the minimizing g
    is the same to ~0.5 % (< 0.01 % of MSE). Other encoders (triton) run the full encode.
    """

    def __init__(self, encode: TileEncoder, tiles: torch.Tensor, bits, codebook: str):
        self.encode, self.tiles, self.bits, self.codebook = encode, tiles, bits, codebook
        self.open_cost = getattr(encode, "open_cost", None)
        self.done: dict[float, torch.Tensor] = {}

    def mean(self, g: float, idx: torch.Tensor) -> float:
        errs = self.done.setdefault(g, torch.full((self.tiles.shape[0],), float("nan"), dtype=torch.float64))
        need = idx[torch.isnan(errs[idx])]
        if need.numel():
            t = self.tiles[need]
            if self.open_cost is not None:
                cost = self.open_cost((t * g).contiguous(), self.bits, self.codebook)
                errs[need] = cost.to("cpu", torch.float64) / (g * g * t.shape[1])
            else:
                _, values = self.encode((t * g).contiguous(), self.bits, self.codebook)
                errs[need] = (values.to(t.device) / g - t).double().square().mean(1).cpu()
        return float(errs[idx].mean())


def search_global_scale(encode: TileEncoder, samples: torch.Tensor, bits, codebook: str, *,
                        drift: float = 1.0) -> float:
    """g minimizing ``mean((Q(g·T)/g − T)²)`` over sample tiles T (already multiplied by ``drift``).

    The reference's search: coarse grid g ∈ {0.1, 0.3, …, 1.9} on every 3rd sample; points spaced
    0.075 (±2 steps) around the coarse best on all samples; parabolic refinement through the best
    fine point and its neighbours, the offset clipped to ±0.5 step. Both grids are walked
    downhill from their middle (:func:`_descend`) instead of evaluated whole: the objective is
    unimodal in g, so the result is the same and the search costs about half.

    Differences from the reference (encoder version 2): the fine grid spans ±4 steps, so a
    coarse best on the wrong side of a near-tie (g* ≈ 1.0 at K2) still ends at a refined
    minimum instead of at the grid's end (the walk only goes there when it is downhill); the
    fine point at the coarse best reuses the coarse samples' errors; Q's error is the open-path
    estimate of :class:`_TileErrors` where the backend has one.

    Samples without energy have no minimum (Q(0) ≠ 0, so the error only falls as g grows):
    quantize_weight does not search for a weight whose fp16 scales vanish (e.g. all zero).
    """
    t = samples * drift
    errs = _TileErrors(encode, t, bits, codebook)
    n = t.shape[0]
    every = torch.arange(n)
    sub = every[::3] if n >= 3 else every
    coarse = [0.1 + 0.2 * i for i in range(10)]
    cerrs = _descend(len(coarse), 4, lambda i: errs.mean(coarse[i], sub))
    g0 = coarse[min(cerrs, key=lambda i: (cerrs[i], i))]
    step = 0.075
    fine = [g for g in (g0 + step * d for d in range(-4, 5)) if g > 0]
    ferrs = _descend(len(fine), fine.index(g0), lambda i: errs.mean(fine[i], every))
    i = min(ferrs, key=lambda j: (ferrs[j], j))
    g = fine[i]
    if i - 1 in ferrs and i + 1 in ferrs:
        e0, e1, e2 = ferrs[i - 1], ferrs[i], ferrs[i + 1]
        denom = e0 - 2 * e1 + e2
        if denom > 0:
            offset = 0.5 * (e0 - e2) / denom
            g += step * max(-0.5, min(0.5, offset))
    return g
