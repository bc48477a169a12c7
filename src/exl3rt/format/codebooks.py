"""EXL3 codebooks: the map from a 16-bit trellis state to an fp16 weight value.

Three codebooks exist (exllamav3 ``codebook.cuh``). All integer arithmetic is uint32,
wrapping modulo 2**32; ``x`` starts as the state zero-extended.

``3inst`` (no marker tensor)::

    x = x * 89226354 + 64248484
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    value = fp16(bits x[15:0]) + fp16(bits x[31:16])       # one fp16 rounding

``mcg`` (``<key>.mcg`` marker, value 0xCBAC1FED)::

    as 3inst, with the first step replaced by x = x * 0xCBAC1FED

``mul1`` (``<key>.mul1`` marker, value 0x83DCD12D)::

    x = x * 0x83DCD12D
    h = 1024 + byte0(x) + byte1(x) + byte2(x) + byte3(x)   # fp16 bits 0x6400 + bytesum
    value = fma(h, fp16(0x1EEE), fp16(0xC931))              # ONE rounding to fp16

Exactness: for 3inst/mcg both fp16 halves lie in [0.125, 2) in magnitude, so their sum is
exact in fp32 and a single fp32 -> fp16 rounding reproduces the fp16 add. For mul1,
``h * k`` has at most 22 significant bits and the sum with the bias keeps its lsb at 2^-18
below 16 in magnitude, so the fp32 result is exact and one rounding reproduces the FMA.
Rounding after the multiply *and* after the add is wrong for 60,326 of the 65,536 states.
"""

from __future__ import annotations

import functools

import torch

from .errors import FormatError

CODEBOOKS: tuple[str, ...] = ("3inst", "mcg", "mul1")

MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
INST3_MULTIPLIER = 89226354
INST3_ADDEND = 64248484

#: Marker tensors stored beside a trellis: name -> required int32 value (the locked multiplier).
MARKERS: dict[str, int] = {
    "mcg": MCG_MULTIPLIER - (1 << 32),    # -877912083 as int32
    "mul1": MUL1_MULTIPLIER - (1 << 32),  # -2082680531 as int32
}

_MASK32 = 0xFFFFFFFF
_MUL1_SCALE_BITS = 0x1EEE  # fp16 0.0067672729...
_MUL1_BIAS_BITS = 0xC931   # fp16 -10.3828125

#: RMS of each codebook's 65536 values (the quantizer regularizes toward ``CODEBOOK_SCALE``).
CODEBOOK_SCALE = 1.24371088


def check_codebook(codebook: str) -> str:
    """Return ``codebook`` if it is a known codebook name, else raise a FormatError naming the choices."""
    if codebook not in CODEBOOKS:
        raise FormatError(
            f"unknown codebook {codebook!r}: expected one of {', '.join(CODEBOOKS)}"
        )
    return codebook


def _fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integer tensor values 0..65535 as fp16 bit patterns (returned as fp32)."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return signed.view(torch.float16).to(torch.float32)


def _scalar_fp16(bits: int) -> float:
    return float(_fp16_from_bits(torch.tensor([bits], dtype=torch.int64))[0])


def decode_states(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """Decode 16-bit states (any integer dtype; int16 is read as uint16) to fp16 values.

    Arithmetic follows the module docstring and is bit-exact with the reference decoder.
    Works on any device; the result has the shape of ``states``.
    """
    check_codebook(codebook)
    x = states.to(torch.int64) & 0xFFFF
    if codebook == "mul1":
        x = (x * MUL1_MULTIPLIER) & _MASK32
        bytesum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        h = (1024 + bytesum).to(torch.float32)  # exact: 0x6400 + bytesum as fp16 is 1024 + bytesum
        value = h * _scalar_fp16(_MUL1_SCALE_BITS) + _scalar_fp16(_MUL1_BIAS_BITS)  # exact in fp32
        return value.to(torch.float16)
    if codebook == "mcg":
        x = (x * MCG_MULTIPLIER) & _MASK32
    else:
        x = (x * INST3_MULTIPLIER + INST3_ADDEND) & _MASK32
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _fp16_from_bits(x & 0xFFFF)
    hi = _fp16_from_bits(x >> 16)
    return (lo + hi).to(torch.float16)  # exact fp32 sum, one rounding


@functools.lru_cache(maxsize=None)
def _codebook_table(codebook: str) -> torch.Tensor:
    table = decode_states(torch.arange(65536, dtype=torch.int64), codebook)
    table = table.to(torch.float32)
    table.requires_grad_(False)
    return table


def codebook_values(codebook: str) -> torch.Tensor:
    """The value of every 16-bit state (index = state as uint16): fp32 ``[65536]`` holding fp16 values.

    The table is computed once per process and shared; callers get a read-only view
    (clone it before writing).
    """
    return _codebook_table(check_codebook(codebook))


def codebook_values_fp16(codebook: str) -> torch.Tensor:
    """As :func:`codebook_values`, as an fp16 tensor."""
    return codebook_values(codebook).to(torch.float16)
