"""Triton kernels for EXL3 linears: ``decode.py`` (the trellis decode, decode to fp16), ``mma.py`` (warp-level
tensor-core GEMV), ``wgmma.py`` (Hopper GEMM), ``hadamard.py`` (rotations), ``linear.py`` (dispatch) and
``ops.py`` (the ``torch.ops.exl3rt.*`` custom ops the modules call), ``launch.py`` (launches recorded once and
replayed without the JIT's per-call work: :func:`planned_linear`), ``moe.py`` / ``moe_glue.py`` /
``moe_wgmma.py`` (the MoE layer's launches) and ``routing.py`` (route packing in torch, which ``exl3rt.moe``
builds on).

The names below load ``linear.py`` (and Triton) on first use, so that registering the custom ops stays light.
"""

_LINEAR = ("DecodeConfig", "MMA_MAX_ROWS", "MmaConfig",
           "choose_path", "decode_fp16", "exl3_linear", "interpreting", "mma_rotated", "prewarm",
           "specialization", "planned_linear", "reset_plans")


def __getattr__(name: str):
    if name in _LINEAR:
        from . import linear
        return getattr(linear, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["exl3_linear", "mma_rotated", "decode_fp16", "prewarm", "specialization", "choose_path",
           "MmaConfig", "DecodeConfig", "MMA_MAX_ROWS",
           "interpreting", "planned_linear", "reset_plans"]
