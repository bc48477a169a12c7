"""Streaming Hessian collection for calibrated encoding: H = XᵀX / n over a linear's inputs.

Rows holding NaN or inf are dropped and counted (as exllamav3's capture does); accumulation is
fp32 ``XᵀX`` on the device of the activations. :meth:`HessianCollector.finalize` returns ``H / n``
or ``None`` when no usable row was seen (the encoder then falls back to uncalibrated mode).
"""

from __future__ import annotations

from typing import Optional

import torch

from .errors import EncodeError


class HessianCollector:
    """Accumulate ``XᵀX`` for one linear with ``in_features`` inputs.

    >>> hc = HessianCollector(4096)          # doctest: +SKIP
    >>> hc.update(x)                         # x: [..., 4096], any float dtype   # doctest: +SKIP
    >>> H = hc.finalize()                    # fp32 [4096, 4096] = XᵀX / rows    # doctest: +SKIP
    """

    def __init__(self, in_features: int, *, device: torch.device | str | None = None, name: str = ""):
        self.in_features = int(in_features)
        self.name = name
        self.device = device
        self.xtx: Optional[torch.Tensor] = None
        self.rows = 0
        self.dropped = 0

    def update(self, x: torch.Tensor) -> None:
        """Add the rows of ``x`` (shape ``[..., in_features]``)."""
        if x.shape[-1] != self.in_features:
            raise EncodeError(
                f"{self.name or 'hessian'}: activations have {x.shape[-1]} features, expected {self.in_features}"
            )
        rows = x.detach().reshape(-1, self.in_features)
        if self.device is not None:
            rows = rows.to(self.device)
        rows = rows.to(torch.float32)
        finite = torch.isfinite(rows).all(dim=1)
        n_bad = int((~finite).sum())
        if n_bad:
            rows = rows[finite]
            self.dropped += n_bad
        if rows.shape[0] == 0:
            return
        if self.xtx is None:
            self.xtx = torch.zeros((self.in_features, self.in_features), dtype=torch.float32, device=rows.device)
        self.xtx.addmm_(rows.T, rows)
        self.rows += rows.shape[0]

    def finalize(self) -> Optional[torch.Tensor]:
        """``XᵀX / rows`` (fp32), or ``None`` if no finite row was collected."""
        if self.xtx is None or self.rows == 0:
            return None
        return self.xtx / self.rows
