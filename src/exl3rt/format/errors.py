"""Errors raised by the format layer."""


class FormatError(ValueError):
    """Malformed or inconsistent EXL3 data. The message names the tensor, the problem and the fix."""
