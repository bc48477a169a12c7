"""Errors raised by the encoder."""


class EncodeError(ValueError):
    """Input the encoder cannot use (non-finite weights, wrong shapes, bad Hessian). Names the tensor and the fix."""
