"""Host-side helpers every kernel file shares: kernel K arguments, codebook constants, and whether a device runs
inline PTX and programmatic dependent launch."""

from __future__ import annotations

import functools

import torch

from .. import env
from ..format.bits import Bits, is_half
from ..format.codebooks import check_codebook
from ._triton import HAVE_GDC, HAVE_TRITON
from .decode import CB_AFFINE, CODEBOOK_IDS
from .decode import interpreted as interpreting   # the kernels were defined for Triton's CPU interpreter


def kernel_bits(bits: Bits) -> tuple[int, int]:
    """(KA, HALF) of a bitrate: K = KA + HALF/2."""
    return (int(bits), 1) if is_half(bits) else (int(bits), 0)


def cb_args(codebook: str) -> tuple[int, int, int]:
    """(CB, MULT, ADD): the kernels' codebook id and its affine constants."""
    cb = CODEBOOK_IDS[check_codebook(codebook)]
    mult, add = CB_AFFINE[cb]
    return cb, mult, add


def use_asm(device: torch.device) -> bool:
    """The kernels' inline PTX runs here (CUDA, compiled, ``EXL3RT_KERNEL_NO_ASM`` unset)."""
    return device.type == "cuda" and not interpreting() and not env.KERNEL_NO_ASM.get()


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for the launches of a call (sm_90+, Triton with grid dependency control and
    the ``launch_pdl`` option): each kernel lets the next one launch at its start and waits for the previous one's
    writes only where it reads them (the mma kernel issues its first weight loads before waiting for x')."""
    if device.type != "cuda" or interpreting() or env.KERNEL_NO_PDL.get() or not HAVE_GDC:
        return False
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _pdl_supported(index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and \
        torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """The launch options of a programmatic dependent launch where :func:`use_pdl` holds, else none."""
    return {"PDL": True, "launch_pdl": True} if use_pdl(device) else {}


def tier_spec(tier_bits) -> str:
    """The ``TIERS`` compile-time argument of the MoE tiered launches: per tier ``KA.HALF.NWL`` (K's whole bits,
    its half bit, the lane decode's words per lane), comma-separated; :func:`tier_count` and :func:`tier_field`
    read it inside a kernel, which holds one decode loop per tier."""
    from .lane_decode import lane_span_words
    return ",".join("{}.{}.{}".format(*kernel_bits(b), lane_span_words(*kernel_bits(b))) for b in tier_bits)


if HAVE_TRITON:
    from triton.runtime.jit import constexpr_function

    @constexpr_function
    def tier_count(tiers):
        """The number of tiers in a :func:`tier_spec` string."""
        return len(str(tiers).split(","))

    @constexpr_function
    def tier_field(tiers, t, i):
        """Field ``i`` (0: KA, 1: HALF, 2: NWL) of tier ``t`` in a :func:`tier_spec` string."""
        return int(str(tiers).split(",")[t].split(".")[i])


__all__ = ["interpreting", "kernel_bits", "cb_args", "use_asm", "use_pdl", "pdl_args", "tier_spec", "tier_count",
           "tier_field"]
