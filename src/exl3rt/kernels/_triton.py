"""Triton, if installed (``HAVE_TRITON``); the kernel modules define their kernels only when it is."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["triton", "tl", "HAVE_TRITON"]
