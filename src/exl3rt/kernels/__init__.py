"""Triton kernels for EXL3 linears (issue 5): see ``gemv.py`` (the decode) and ``linear.py`` (dispatch)."""

from .linear import (DecodeConfig, GemvConfig, GEMV_DISPATCH_ROWS, GEMV_MAX_ROWS, decode_fp16, exl3_linear, gemv_rotated,
                     interpreting, prewarm)

__all__ = ["exl3_linear", "gemv_rotated", "decode_fp16", "prewarm", "GemvConfig", "DecodeConfig",
           "GEMV_MAX_ROWS", "GEMV_DISPATCH_ROWS", "interpreting"]
