"""Hessian preparation for LDLQ: damping, rotation into the Hadamard basis, block LDL (block 16).

Given H (``[in, in]``, = XᵀX/n) and the input sign vector ``su``:

1. fall back to uncalibrated mode (return ``None``) if the mean diagonal is non-finite or < 1e-20;
2. damp: ``H += sigma_reg · mean(diag H) · I`` (sigma_reg = 0.025);
3. rotate: ``H_r = Hk · diag(su) · H · diag(su) · Hk``;
4. Cholesky ``H_r = L Lᵀ`` (on failure add ``2·sigma_reg·mean(diag)`` and retry, at most 10 times);
5. ``L ← L · blockdiag(L_bb)⁻¹`` so that every 16×16 diagonal block is I, i.e. ``H_r = L D Lᵀ``
   with L unit block-lower-triangular; return ``L − I`` (zero diagonal blocks), the feedback matrix.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..format.hadamard import hadamard_blocks
from .errors import EncodeError

BLOCK = 16
SIGMA_REG = 0.025


def damp(h: torch.Tensor, sigma_reg: float = SIGMA_REG) -> Optional[torch.Tensor]:
    """``H + sigma_reg·mean(diag)·I`` in fp64, or None when H carries no usable signal."""
    h = h.to(torch.float64)
    mean_diag = float(torch.diagonal(h).mean())
    if not (mean_diag == mean_diag) or mean_diag in (float("inf"), float("-inf")) or mean_diag < 1e-20:
        return None
    return h + sigma_reg * mean_diag * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)


def rotate(h: torch.Tensor, su_sign: torch.Tensor) -> torch.Tensor:
    """``Hk · diag(su) · H · diag(su) · Hk`` (blockwise Hadamard on both sides)."""
    s = su_sign.to(h.dtype)
    hs = h * s[:, None] * s[None, :]
    return hadamard_blocks(hadamard_blocks(hs, dim=0), dim=1)


def block_ldl_feedback(h_rot: torch.Tensor, sigma_reg: float = SIGMA_REG, *, name: str = "") -> torch.Tensor:
    """Return ``L − I`` where ``H_r = L D Lᵀ``, L unit block-lower-triangular with 16×16 blocks (fp64)."""
    n = h_rot.shape[0]
    if n % BLOCK:
        raise EncodeError(f"{name or 'hessian'}: size {n} is not a multiple of {BLOCK}")
    h = h_rot.to(torch.float64)
    bump = 2 * sigma_reg * float(torch.diagonal(h).mean())
    eye = torch.eye(n, dtype=h.dtype, device=h.device)
    for _attempt in range(11):
        chol, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            break
        h = h + bump * eye
    else:
        raise EncodeError(f"{name or 'hessian'}: not positive definite even after 10 damping retries")
    nb = n // BLOCK
    blocks = chol.reshape(nb, BLOCK, nb, BLOCK)
    diag = torch.stack([blocks[i, :, i, :] for i in range(nb)])  # [nb, 16, 16], lower-triangular
    inv = torch.linalg.inv(diag)
    unit = torch.einsum("aibj,bjk->aibk", blocks, inv).reshape(n, n)
    unit = torch.tril(unit)  # exact zeros above the block diagonal
    idx = torch.arange(n, device=h.device)
    same_block = (idx[:, None] // BLOCK) == (idx[None, :] // BLOCK)
    return torch.where(same_block, torch.zeros_like(unit), unit)
