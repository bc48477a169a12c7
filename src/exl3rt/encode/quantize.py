"""quantize_weight: one linear weight -> EncodedLinear (the reference quantizer's algorithm).

    weight [in, out] fp32 ──pad to 128──► regularize (signs, Hadamards, channel scales) ──► g search
        ──► tiles: Viterbi (uncalibrated) or LDLQ with the block-LDL of the rotated Hessian
        ──► pack, fp16 scales ──► (calibrated: least-squares scale refit) ──► EncodedLinear

``info`` on the result records: proxy_err, g_scale, seed, backend, calibrated, seconds.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from ..format.bits import Bits, is_half, normalize_bits
from ..format.bitstream import pack_states
from ..format.codebooks import check_codebook
from ..format.encoded import EncodedLinear, padded_width
from ..format.errors import FormatError
from ..format.hadamard import hadamard_blocks
from .backends import get_tile_encoder
from .errors import EncodeError
from .ldl import SIGMA_REG, block_ldl_feedback, damp, rotate
from .ldlq import quantize_ldlq, quantize_straight
from .refit import refit_scales
from .regularize import DRIFT, random_signs, regularize, sample_tiles, search_global_scale

log = logging.getLogger("exl3rt.encode")

#: bump when anything that changes the encoding for the same inputs changes (cache keys use it).
#: 2: the g search samples at most max(128, tiles/32) tiles and uses open-path errors (regularize.py)
ENCODER_VERSION = 2


def _check_weight(weight: torch.Tensor, name: str) -> None:
    label = name or "weight"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise EncodeError(f"{label}: expected a 2-D [in, out] tensor, got {getattr(weight, 'shape', type(weight))}")
    if not weight.dtype.is_floating_point:
        raise EncodeError(f"{label}: expected a floating-point weight, got {weight.dtype}")
    if weight.numel() == 0:
        raise EncodeError(f"{label}: empty weight {tuple(weight.shape)}")
    bad = int((~torch.isfinite(weight)).sum())
    if bad:
        raise EncodeError(f"{label}: {bad} non-finite value(s) (NaN/inf) in the weight; the source checkpoint "
                          f"is corrupt or was saved after a diverged update")


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def proxy_error(w: torch.Tensor, wq: torch.Tensor, h: Optional[torch.Tensor] = None) -> float:
    """``tr(Eᵀ H E) / tr(Wᵀ H W)`` with E = W − Wq (``[in, out]``); relative MSE when ``h`` is None.

    Computed in float64. A weight with no energy (all zero) has relative error 0 when the
    reconstruction is exact too (E = 0), and ``inf`` otherwise (any error is infinitely large
    relative to nothing).
    """
    e = (w - wq).double()
    w = w.double()
    if h is None:
        num, den = e.square().sum(), w.square().sum()
    else:
        h = h.double()
        num, den = (e * (h @ e)).sum(), (w * (h @ w)).sum()
    if float(den) == 0.0:
        return 0.0 if float(num) == 0.0 else float("inf")
    return float(num / den)


#: g is never below 1/40 (the lowest point of the search grid), so |su / g| <= 64·|su|
_MAX_INV_G = 64.0


def _scales_vanish(reg) -> bool:
    """True when every fp16 output scale, or every fp16 input scale for any g, rounds to zero (checked
    before the g search, which has nothing to measure then; the exact check on su / g follows it)."""
    return not bool(reg.sv.half().any()) or not bool((reg.su * _MAX_INV_G).half().any())


def _zero_encoding(weight: torch.Tensor, w: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, g: float, bits: Bits,
                   codebook: str, h_damped: Optional[torch.Tensor], seed: int, name: str, encode, backend: str,
                   t0: float, progress: Optional[Callable[[int], None]]) -> EncodedLinear:
    """All-zero codes and the vanishing scales: the reconstruction is exactly 0.

    Its proxy error is that of the zero reconstruction: 0 for an all-zero weight, 1 (all of it lost) for
    one too small for fp16 scales to represent.
    """
    in_p, out_p = w.shape
    states = torch.zeros((in_p // 16, out_p // 16, 256), dtype=torch.int16, device=w.device)
    if progress:
        progress(states.shape[0] * states.shape[1])
    err = proxy_error(w, torch.zeros_like(w), h_damped)
    result = EncodedLinear(
        trellis=pack_states(states, bits), suh=su.to(torch.float16), svh=sv.to(torch.float16),
        codebook=codebook, in_features=weight.shape[0], out_features=weight.shape[1], name=name,
    )
    result.info = {
        "proxy_err": err, "g_scale": g, "seed": int(seed), "backend": getattr(encode, "backend", backend),
        "calibrated": h_damped is not None, "seconds": time.perf_counter() - t0, "encoder_version": ENCODER_VERSION,
    }
    if err:
        log.info("%s: weight too small for fp16 scales; encoded as zero", name or "weight")
    return result


def quantize_weight(weight: torch.Tensor, bits: Bits, codebook: str = "mcg", hessian: Optional[torch.Tensor] = None,
                    seed: int = 0, *, backend: str = "auto", out_scales: bool = True, refit: bool = True,
                    sigma_reg: float = SIGMA_REG, name: str = "",
                    progress: Optional[Callable[[int], None]] = None) -> EncodedLinear:
    """Encode ``weight`` (``[in, out]``, EXL3 orientation; the HF weight transposed) at K = ``bits``.

    ``hessian`` (``[in, in]`` = XᵀX/n of the layer's inputs) turns on calibrated mode: LDLQ error
    feedback and the scale refit. Without it every tile is encoded on its own (the online path).
    Widths that are not multiples of 128 are zero-padded (recorded as logical widths in the result).
    ``progress(n)`` is called as tiles finish (``(in_p/16)·(out_p/16)`` in all).

    A weight that fp16 scales cannot carry (all zero, or every row or column scale below fp16's
    smallest value: magnitudes below ~1e-8) gets all-zero codes and its vanishing scales (``svh = 0``
    for all-zero columns); its reconstruction is exactly 0, and ``info["proxy_err"]`` is that of
    the zero reconstruction: 0 for an all-zero weight, 1 for a tiny nonzero one. All-zero rows or
    columns of an otherwise ordinary weight take the ordinary path. A weight too large for fp16
    scales raises :class:`EncodeError`.
    """
    t0 = time.perf_counter()
    _check_weight(weight, name)
    try:
        bits = normalize_bits(bits, name=f"{name or 'weight'}: bits")
        check_codebook(codebook)
    except FormatError as exc:
        raise EncodeError(str(exc)) from None
    if is_half(bits) and codebook != "mul1":
        raise EncodeError(f"{name or 'weight'}: half-integer bits ({bits}) need codebook='mul1', not {codebook!r}")
    n_in, n_out = weight.shape
    in_p, out_p = padded_width(n_in), padded_width(n_out)
    device = weight.device
    w = _pad(weight.detach().to(torch.float32), in_p, out_p)

    gen = torch.Generator().manual_seed(int(seed))
    su_sign = random_signs(in_p, gen).to(device)
    sv_sign = random_signs(out_p, gen).to(device)

    h_damped = None
    if hessian is not None:
        if hessian.shape != (n_in, n_in):
            raise EncodeError(f"{name or 'weight'}: hessian shape {tuple(hessian.shape)} does not match "
                              f"in_features {n_in} (expected [{n_in}, {n_in}])")
        h_damped = damp(_pad(hessian.detach().to(device, torch.float64), in_p, in_p), sigma_reg)
        if h_damped is None:
            log.info("%s: hessian carries no signal (zero or non-finite diagonal); encoding uncalibrated", name)
    calibrated = h_damped is not None

    encode = get_tile_encoder(backend, device, bits)
    reg = regularize(w, su_sign, sv_sign, out_scales=out_scales)
    if _scales_vanish(reg):
        # the reconstruction is exactly zero whatever the codes: nothing to search or encode
        return _zero_encoding(weight, w, reg.su, reg.sv, 1.0, bits, codebook, h_damped, seed, name, encode, backend,
                              t0, progress)
    drift = DRIFT.get(bits, 1.0) if calibrated else 1.0
    g = search_global_scale(encode, sample_tiles(reg.w), bits, codebook, drift=drift)
    w_r = reg.w * g
    su = reg.su / g
    sv = reg.sv
    if not bool(su.half().any()):
        return _zero_encoding(weight, w, su, sv, g, bits, codebook, h_damped, seed, name, encode, backend, t0,
                              progress)
    if not bool(torch.isfinite(su.half()).all()):
        raise EncodeError(f"{name or 'weight'}: input-channel scales up to {float(su.abs().max()):.3g} exceed fp16's "
                          f"range (65504): the weight (max |w| {float(weight.abs().max()):.3g}) is too large for EXL3")

    if calibrated:
        feedback = block_ldl_feedback(rotate(h_damped, su_sign), sigma_reg, name=name)
        states, q = quantize_ldlq(w_r, feedback, encode, bits, codebook, progress)
    else:
        states, q = quantize_straight(w_r, encode, bits, codebook, progress)
    trellis = pack_states(states, bits)

    if calibrated:
        basis = hadamard_blocks(hadamard_blocks(q.double(), dim=0), dim=1)  # Hk·Q·Hn
        if refit:
            su, sv = refit_scales(w, basis, su, sv, h_damped)
        wq = basis * su.double().half().double()[:, None] * sv.double().half().double()[None, :]
        err = proxy_error(w, wq, h_damped)
    else:
        err = proxy_error(w_r, q)

    result = EncodedLinear(
        trellis=trellis, suh=su.to(torch.float16), svh=sv.to(torch.float16), codebook=codebook,
        in_features=n_in, out_features=n_out, name=name,
    )
    result.info = {
        "proxy_err": err, "g_scale": g, "seed": int(seed), "backend": getattr(encode, "backend", backend),
        "calibrated": calibrated, "seconds": time.perf_counter() - t0, "encoder_version": ENCODER_VERSION,
    }
    return result
