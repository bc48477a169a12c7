"""EncodedLinear: one EXL3-quantized linear layer, validated on construction.

Stored tensors of a linear with key ``<key>`` (exllamav3 layout)::

    <key>.trellis   int16 [in_p/16, out_p/16, 16·K]   packed tiles (K from this shape)
    <key>.suh       fp16  [in_p]                      input-side scales (sign × scale)
    <key>.svh       fp16  [out_p]                     output-side scales (sign × scale)
    <key>.mcg       int32 []   = 0xCBAC1FED           presence selects the mcg codebook
    <key>.mul1      int32 []   = 0x83DCD12D           presence selects the mul1 codebook
                                                      (neither marker: 3inst)
    <key>.bias      fp16  [out_p]                     optional
    legacy <key>.su / <key>.sv  int16 [n/16]          packed sign bits instead of suh / svh

``in_p``/``out_p`` are the padded widths (multiples of 128); ``in_features``/``out_features`` are
the logical widths (``in_p = ceil128(in_features)``), which the format itself does not store.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch

from .bits import Bits, bits_from_trellis, is_half, normalize_bits
from .codebooks import MARKERS, check_codebook
from .errors import FormatError
from .hadamard import HAD_BLOCK
from .reconstruct import decode, reconstruct

PAD = HAD_BLOCK  # widths are padded to multiples of 128

#: The safetensors dtype of each tensor an EXL3 linear stores (the table above); checkpoint readers compare the
#: header's label with it before reading (a relabelled tensor is never cast). The reference loader asserts the same,
#: except that it takes an F32 bias and rounds it to F16, as :meth:`EncodedLinear.from_state_dict` does.
STORED_DTYPES: dict[str, tuple[str, ...]] = {
    "trellis": ("I16",), "suh": ("F16",), "svh": ("F16",), "su": ("I16",), "sv": ("I16",), "bias": ("F16", "F32"),
    **{marker: ("I32",) for marker in MARKERS},
}


def padded_width(n: int) -> int:
    """``n`` rounded up to a multiple of 128."""
    return -(-int(n) // PAD) * PAD


def unpack_signs(packed: torch.Tensor, *, name: str = "su") -> torch.Tensor:
    """Legacy packed sign vector int16 ``[n/16]`` -> fp16 ``[n]`` of ±1.

    Bit i of word j is the sign of element 16·j + i; value = 1 − 2·bit.
    """
    if packed.dtype != torch.int16 or packed.dim() != 1:
        raise FormatError(f"{name}: legacy packed signs must be int16 [n/16], got {packed.dtype} {tuple(packed.shape)}")
    words = packed.to(torch.int64) & 0xFFFF
    bit = (words[:, None] >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bit).reshape(-1).to(torch.float16)


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    """fp ``[n]`` (n % 16 == 0) -> legacy packed int16 ``[n/16]``; negative values give bit 1."""
    if signs.dim() != 1 or signs.shape[0] % 16:
        raise FormatError(f"signs: expected [n] with n a multiple of 16, got {tuple(signs.shape)}")
    bit = (signs < 0).to(torch.int64).reshape(-1, 16)
    words = (bit << torch.arange(16, device=signs.device)).sum(-1)
    return torch.where(words >= 0x8000, words - 0x10000, words).to(torch.int16)


@dataclasses.dataclass
class EncodedLinear:
    """One quantized linear: ``y = x · W + bias`` with ``W = diag(suh)·Hk·Q·Hn·diag(svh)`` (``[in, out]``).

    Construction validates every tensor and raises :class:`FormatError` naming the tensor (with
    ``name`` as prefix), the problem and the expected form.
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    codebook: str = "mcg"
    bias: Optional[torch.Tensor] = None
    in_features: Optional[int] = None
    out_features: Optional[int] = None
    name: str = ""
    #: free-form facts about how this encoding was made (proxy_err, g_scale, seed, …); not stored in checkpoints
    info: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    bits: Bits = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- shape facts -------------------------------------------------------------------
    @property
    def in_padded(self) -> int:
        return int(self.trellis.shape[0]) * 16

    @property
    def out_padded(self) -> int:
        return int(self.trellis.shape[1]) * 16

    @property
    def num_weights(self) -> int:
        """Weights coded by the trellis (padded widths)."""
        return self.in_padded * self.out_padded

    @property
    def nbytes(self) -> int:
        """Bytes of all stored tensors (trellis, scales, bias, marker)."""
        total = sum(t.numel() * t.element_size() for t in (self.trellis, self.suh, self.svh))
        if self.bias is not None:
            total += self.bias.numel() * self.bias.element_size()
        return total + (4 if self.codebook in MARKERS else 0)

    def _t(self, tensor: str) -> str:
        return f"{self.name}.{tensor}" if self.name else tensor

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Check dtypes, shapes, codebook/bitrate consistency and finiteness; raise FormatError."""
        check_codebook(self.codebook)
        tr = self.trellis
        if not isinstance(tr, torch.Tensor) or tr.dtype != torch.int16:
            raise FormatError(f"{self._t('trellis')}: dtype must be torch.int16, got {getattr(tr, 'dtype', type(tr))}")
        self.bits = bits_from_trellis(tr, name=self._t("trellis"))
        if is_half(self.bits) and self.codebook != "mul1":
            raise FormatError(
                f"{self._t('trellis')}: half-integer K = {self.bits} requires the mul1 codebook, "
                f"but the codebook is {self.codebook!r}"
            )
        in_p, out_p = self.in_padded, self.out_padded
        for side, n in (("input", in_p), ("output", out_p)):
            if n == 0 or n % PAD:
                raise FormatError(
                    f"{self._t('trellis')}: padded {side} width {n} is not a positive multiple of {PAD} "
                    f"(EXL3 rotates in 128-blocks; zero-pad the weight to a multiple of 128 before encoding)"
                )
        for tname, vec, n in (("suh", self.suh, in_p), ("svh", self.svh, out_p)):
            self._check_vector(tname, vec, n)
        if self.bias is not None:
            self._check_vector("bias", self.bias, out_p)
        for attr, padded in (("in_features", in_p), ("out_features", out_p)):
            logical = getattr(self, attr)
            if logical is None:
                setattr(self, attr, padded)
                continue
            logical = int(logical)
            if padded_width(logical) != padded:
                raise FormatError(
                    f"{self._t('trellis')}: {attr}={logical} pads to {padded_width(logical)}, "
                    f"but the trellis holds {padded} (widths are padded to the next multiple of {PAD})"
                )
            setattr(self, attr, logical)

    def _check_vector(self, tname: str, vec: torch.Tensor, n: int) -> None:
        if not isinstance(vec, torch.Tensor) or vec.dtype != torch.float16:
            raise FormatError(f"{self._t(tname)}: dtype must be torch.float16, got {getattr(vec, 'dtype', type(vec))}")
        if vec.dim() != 1 or vec.shape[0] != n:
            raise FormatError(f"{self._t(tname)}: shape must be [{n}] to match the trellis, got {tuple(vec.shape)}")
        if vec.device != self.trellis.device:
            raise FormatError(f"{self._t(tname)}: on {vec.device}, but the trellis is on {self.trellis.device}")
        if not bool(torch.isfinite(vec).all()):
            bad = int((~torch.isfinite(vec)).sum())
            raise FormatError(f"{self._t(tname)}: {bad} non-finite value(s) (NaN/inf); the tensor is corrupt")

    # ---- math ------------------------------------------------------------------------------
    def decode(self) -> torch.Tensor:
        """Q in the rotated basis, fp16 ``[in_p, out_p]`` (bit-exact)."""
        return decode(self.trellis, self.bits, self.codebook)

    def reconstruct(self, *, trim: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W ``[in, out]`` in ``dtype``; trimmed to the logical widths unless ``trim=False``."""
        w = reconstruct(self.trellis, self.suh, self.svh, self.codebook, dtype=dtype)
        return w[: self.in_features, : self.out_features] if trim else w

    def to(self, device: torch.device | str) -> "EncodedLinear":
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(
            self, trellis=self.trellis.to(device), suh=self.suh.to(device), svh=self.svh.to(device),
            bias=None if self.bias is None else self.bias.to(device),
        )

    # ---- storage -----------------------------------------------------------------------------
    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Tensors as stored in an EXL3 checkpoint, keyed ``<prefix>.trellis`` etc. (bare names if no prefix)."""
        key = (lambda t: f"{prefix}.{t}") if prefix else (lambda t: t)
        out = {key("trellis"): self.trellis, key("suh"): self.suh, key("svh"): self.svh}
        if self.codebook in MARKERS:
            out[key(self.codebook)] = torch.tensor(MARKERS[self.codebook], dtype=torch.int32)
        if self.bias is not None:
            out[key("bias")] = self.bias
        return out

    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, torch.Tensor], name: str = "", *,
                        in_features: Optional[int] = None, out_features: Optional[int] = None) -> "EncodedLinear":
        """Build from stored tensors keyed by bare names (``trellis``, ``suh``, ``mcg``, …).

        Handles the codebook markers (presence selects, value is checked) and the legacy packed
        ``su``/``sv`` sign vectors; an fp32 bias is cast to fp16 as the reference loader does.
        """
        t = (lambda s: f"{name}.{s}") if name else (lambda s: s)
        if "trellis" not in tensors:
            raise FormatError(f"{t('trellis')}: missing; an EXL3 linear needs trellis, suh (or su) and svh (or sv)")
        codebook = codebook_from_markers(tensors, name)
        scales = {}
        for new, legacy in (("suh", "su"), ("svh", "sv")):
            if new in tensors:
                scales[new] = tensors[new]
            elif legacy in tensors:
                scales[new] = unpack_signs(tensors[legacy], name=t(legacy))
            else:
                raise FormatError(f"{t(new)}: missing (nor legacy {t(legacy)}); the linear cannot be decoded")
        bias = tensors.get("bias")
        if bias is not None and bias.dtype == torch.float32:
            bias = bias.to(torch.float16)
        return cls(trellis=tensors["trellis"], suh=scales["suh"], svh=scales["svh"], codebook=codebook,
                   bias=bias, in_features=in_features, out_features=out_features, name=name)


def codebook_from_markers(tensors: Mapping[str, torch.Tensor], name: str = "") -> str:
    """The codebook selected by marker presence; each marker must be an int32 scalar with the locked value."""
    present = [m for m in MARKERS if m in tensors]
    if len(present) > 1:
        raise FormatError(f"{name}: both .mcg and .mul1 markers are present; a linear has exactly one codebook")
    if not present:
        return "3inst"
    m = present[0]
    v = tensors[m]
    label = f"{name}.{m}" if name else m
    if v.dtype != torch.int32 or v.numel() != 1:
        raise FormatError(f"{label}: codebook marker must be an int32 scalar, got {v.dtype} {tuple(v.shape)}")
    if int(v.reshape(())) != MARKERS[m]:
        raise FormatError(
            f"{label}: marker value {int(v.reshape(())) & 0xFFFFFFFF:#010x} is not the locked multiplier "
            f"{MARKERS[m] & 0xFFFFFFFF:#010x}; this checkpoint uses an experimental pre-0.0.9 codebook that "
            f"current EXL3 readers reject"
        )
    return m


def check_bits(linear: EncodedLinear, bits: Bits) -> None:
    """Raise FormatError if ``bits`` (e.g. from a config) disagrees with the trellis shape."""
    if normalize_bits(bits) != linear.bits:
        raise FormatError(
            f"{linear._t('trellis')}: bits={bits} does not follow from the trellis shape "
            f"{tuple(linear.trellis.shape)}, which encodes K = {linear.bits}"
        )
