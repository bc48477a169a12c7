"""The EXL3 quantizer: regularization, global scale search, LDLQ, tail-biting Viterbi backends.

Main entry point: :func:`quantize_weight` (weight ``[in, out]`` -> :class:`~exl3rt.format.EncodedLinear`).
"""

from .errors import EncodeError
from .hessian import HessianCollector
from .quantize import ENCODER_VERSION, proxy_error, quantize_weight

__all__ = ["ENCODER_VERSION", "EncodeError", "HessianCollector", "proxy_error", "quantize_weight"]
