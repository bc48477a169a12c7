"""Triton kernels for EXL3 linears (issue 5): ``gemv.py`` (the decode, FFMA GEMV, decode to fp16),
``mma.py`` (warp-level tensor-core GEMV), ``hadamard.py`` (rotations) and ``linear.py`` (dispatch)."""

from .linear import (DecodeConfig, GemvConfig, GEMV_DISPATCH_ROWS, GEMV_MAX_ROWS, MMA_MAX_ROWS, MmaConfig, choose_path,
                     decode_fp16, exl3_linear, gemv_rotated, interpreting, mma_rotated, prewarm, specialization)

__all__ = ["exl3_linear", "gemv_rotated", "mma_rotated", "decode_fp16", "prewarm", "specialization", "choose_path",
           "GemvConfig", "MmaConfig", "DecodeConfig", "GEMV_MAX_ROWS", "GEMV_DISPATCH_ROWS", "MMA_MAX_ROWS",
           "interpreting"]
