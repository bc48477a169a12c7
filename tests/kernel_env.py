"""Where the Triton kernel tests run: the compiled kernels on a GPU, else Triton's CPU interpreter.

Import this before anything imports ``exl3rt.kernels`` (Triton reads TRITON_INTERPRET when a kernel is
decorated); conftest sets the variable too, but the GPU runs use ``--noconftest``.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEV = "cuda" if ON_GPU else "cpu"


def require_kernels() -> None:
    """Skip the calling test module when Triton is missing, or when the kernels were defined compiled on a
    machine without a GPU (imported before TRITON_INTERPRET=1 could be set)."""
    pytest.importorskip("triton")
    from exl3rt.kernels.linear import interpreting
    if not ON_GPU and not interpreting():
        pytest.skip("no GPU, and exl3rt.kernels was imported before TRITON_INTERPRET=1 could be set",
                    allow_module_level=True)


def random_codes(in_p: int, out_p: int, bits, seed: int):
    """A random EXL3 layer on DEV: trellis ``[in_p/16, out_p/16, 16K]`` int16 and fp16 scales of random sign and
    magnitude 0.5-1.5 (``suh``, ``svh``)."""
    from exl3rt.format.bits import words16_per_tile
    g = torch.Generator().manual_seed(seed)
    tr = torch.randint(-32768, 32768, (in_p // 16, out_p // 16, words16_per_tile(bits)), dtype=torch.int16,
                       generator=g)
    suh = (torch.rand(in_p, generator=g) + 0.5) * torch.where(torch.rand(in_p, generator=g) < 0.5, -1.0, 1.0)
    svh = (torch.rand(out_p, generator=g) + 0.5) * torch.where(torch.rand(out_p, generator=g) < 0.5, -1.0, 1.0)
    return tr.to(DEV), suh.half().to(DEV), svh.half().to(DEV)


def garbage_empty(monkeypatch) -> None:
    """``torch.empty`` returns NaN (floats) / a large int (ints): a kernel path must never read an element that
    no kernel wrote (partials of unused slots, stale indices, an accumulation buffer left unzeroed)."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(1 << 20)
        return t
    monkeypatch.setattr(torch, "empty", empty)
