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

try:  # grid dependency control (programmatic dependent launch, sm_90+): Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False

__all__ = ["triton", "tl", "HAVE_TRITON", "HAVE_GDC", "gdc_wait", "gdc_launch_dependents"]
