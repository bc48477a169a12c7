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
