"""Least-squares refit of the scale vectors with the trellis fixed (exllamav3 1.6.x, calibrated mode).

With B = Hk·Q·Hn (the decoded weight before scaling), ``Wq = diag(su)·B·diag(sv)`` and the
damped, unrotated Hessian H, alternate two rounds of

- per output column n: ``c_n = (q_nᵀ H w_n) / (q_nᵀ H q_n)``, ``sv ← sv·c``;
- per input row: solve ``((Wq Wqᵀ) ∘ H + ridge·I) r = rowsum(Wq ∘ (H W))`` (ridge = 1e-6·mean diag H),
  ``su ← su·r``;

replacing non-finite or non-positive factors by 1. Each step minimizes ``tr((W − Wq)ᵀ H (W − Wq))``
over its own factors exactly.
"""

from __future__ import annotations

import torch


def _safe(f: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(f) & (f > 0), f, torch.ones_like(f))


def refit_scales(w: torch.Tensor, basis: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, h: torch.Tensor,
                 rounds: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Return refitted (su, sv). ``w``: original weight, ``basis``: Hk·Q·Hn, both ``[in_p, out_p]``."""
    w, basis, h = w.double(), basis.double(), h.double()
    su, sv = su.double().clone(), sv.double().clone()
    hw = h @ w
    ridge = 1e-6 * float(torch.diagonal(h).mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(rounds):
        wq = basis * su[:, None] * sv[None, :]
        c = _safe((wq * hw).sum(0) / (wq * (h @ wq)).sum(0))
        sv = sv * c
        wq = wq * c[None, :]
        a = (wq @ wq.T) * h + ridge * eye
        b = (wq * hw).sum(1)
        r = _safe(torch.linalg.solve(a, b))
        su = su * r
    return su, sv
