"""Exl3Linear: a drop-in ``nn.Linear`` whose weight is held as EXL3 trellis codes.

    y = x · W[:in, :out] + bias,    W = diag(suh)·Hk·Q·Hn·diag(svh)  ([in_p, out_p], format.reconstruct)

Buffers (persistent, so they load and move like weights)::

    trellis  int16 [in_p/16, out_p/16, 16·K]   (K follows from the last dimension)
    suh      fp16  [in_p]
    svh      fp16  [out_p]
    bias     Parameter [out_features] in the model dtype, or None

Forward paths:

- **CPU (reference path)**: ``W = format.reconstruct(...)`` trimmed to ``[in, out]``, cast to the
  activation dtype, then ``x @ W``. Trimming W equals zero-padding x to ``in_p`` and trimming y.
- **CUDA**: :meth:`Exl3Linear._kernel_forward` receives ``x`` zero-padded to ``in_p`` (2-D
  ``[rows, in_p]``) and returns ``[rows, out_p]``; the caller trims to ``out_features``. It runs
  the Triton kernels (``exl3rt.kernels.exl3_linear``); without Triton it dequantizes and multiplies.

Dequantized-weight cache: decoding the trellis costs far more than the matmul, so re-decoding on
every call makes generation unusably slow on CPU. The module therefore keeps the decoded weight
(activation dtype, on the module's device) after the first forward when ``dequant_cache`` is True
— by default on CPU only (``None``), where it brings memory back to the dense size for the speed of
a dense layer. ``dequant_cache=False`` decodes every call (memory stays at the code size);
:meth:`clear_dequant_cache` drops it; moving the module (``.to``/``.cuda``) drops it too.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from ..format.bits import Bits, bits_from_trellis, normalize_bits, words16_per_tile
from ..format.codebooks import check_codebook
from ..format.encoded import EncodedLinear, padded_width
from ..format.reconstruct import reconstruct

log = logging.getLogger("exl3rt.runtime")


class Exl3Linear(nn.Module):
    """An EXL3-coded linear layer (HF orientation of the interface: ``[..., in] -> [..., out]``).

    Build with :meth:`from_encoded`, or with the constructor (empty codes of the right shapes, e.g. on
    the meta device, to be filled by a loader).
    """

    def __init__(self, in_features: int, out_features: int, bits: Bits, codebook: str = "mcg", *,
                 bias: bool = False, device: Optional[torch.device | str] = None,
                 dtype: Optional[torch.dtype] = None, dequant_cache: Optional[bool] = None, name: str = ""):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.codebook = check_codebook(codebook)
        self.name = name
        self.dequant_cache = dequant_cache
        bits = normalize_bits(bits)
        in_p, out_p = padded_width(in_features), padded_width(out_features)
        self.register_buffer("trellis", torch.empty((in_p // 16, out_p // 16, words16_per_tile(bits)),
                                                    dtype=torch.int16, device=device))
        self.register_buffer("suh", torch.empty(in_p, dtype=torch.float16, device=device))
        self.register_buffer("svh", torch.empty(out_p, dtype=torch.float16, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._w_cache: Optional[torch.Tensor] = None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_encoded(cls, enc: EncodedLinear, bias: Optional[torch.Tensor] = None, *,
                     dequant_cache: Optional[bool] = None, name: str = "") -> "Exl3Linear":
        """Wrap ``enc`` (its tensors are used as they are, no copy). ``bias`` ``[out_features]`` (any float
        dtype) overrides ``enc.bias`` (fp16 ``[out_p]``, trimmed) when given."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = int(enc.in_features), int(enc.out_features)
        m.codebook, m.name, m.dequant_cache = enc.codebook, name or enc.name, dequant_cache
        m.register_buffer("trellis", enc.trellis)
        m.register_buffer("suh", enc.suh)
        m.register_buffer("svh", enc.svh)
        if bias is None and enc.bias is not None:
            bias = enc.bias[: m.out_features]
        if bias is not None:
            if bias.shape != (m.out_features,):
                raise ValueError(f"{m.name or 'Exl3Linear'}: bias shape {tuple(bias.shape)} does not match "
                                 f"out_features={m.out_features}")
            m.bias = nn.Parameter(bias.detach().to(enc.trellis.device), requires_grad=False)
        else:
            m.register_parameter("bias", None)
        m._w_cache = None
        return m

    # ---- facts ---------------------------------------------------------------------------------
    @property
    def bits(self) -> Bits:
        return bits_from_trellis(self.trellis, name=f"{self.name or 'Exl3Linear'}.trellis")

    @property
    def in_padded(self) -> int:
        return int(self.trellis.shape[0]) * 16

    @property
    def out_padded(self) -> int:
        return int(self.trellis.shape[1]) * 16

    def encoded(self) -> EncodedLinear:
        """The codes as an :class:`EncodedLinear` (sharing this module's tensors; bias not included)."""
        return EncodedLinear(trellis=self.trellis, suh=self.suh, svh=self.svh, codebook=self.codebook,
                             in_features=self.in_features, out_features=self.out_features, name=self.name)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, K={self.bits}, "
                f"codebook={self.codebook}, padded=[{self.in_padded}, {self.out_padded}], "
                f"bias={self.bias is not None}")

    # ---- dequantized weight -----------------------------------------------------------------------
    def _cache_enabled(self, device: torch.device) -> bool:
        return device.type == "cpu" if self.dequant_cache is None else bool(self.dequant_cache)

    def clear_dequant_cache(self) -> None:
        """Drop the kept dequantized weight (the next forward decodes again)."""
        self._w_cache = None

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()`` …: drop the kept weight (it would be stale) and keep suh/svh fp16.

        ``model.to(torch.bfloat16)`` would otherwise round the fp16 scales to bf16 and change W; the
        scales follow the device change only. The bias follows the model's dtype like any parameter.
        """
        self._w_cache = None
        scales = {n: self._buffers[n] for n in ("suh", "svh") if self._buffers.get(n) is not None}
        out = super()._apply(fn, recurse)
        for n, original in scales.items():
            moved = self._buffers[n]
            if moved is not None and moved.dtype != torch.float16:
                self._buffers[n] = original.to(device=moved.device)
        return out

    def dequantized_weight(self, dtype: torch.dtype = torch.float32, *, trim: bool = True) -> torch.Tensor:
        """W ``[in, out]`` (``[in_p, out_p]`` if not ``trim``) in ``dtype`` on the codes' device.

        Uses and fills the dequantized-weight cache when it is enabled for this device; the cache holds
        the trimmed or untrimmed form the last caller asked for.
        """
        cached = self._w_cache
        want = (self.in_features, self.out_features) if trim else (self.in_padded, self.out_padded)
        if cached is not None and cached.dtype == dtype and cached.device == self.trellis.device \
                and tuple(cached.shape) == want:
            return cached
        w = reconstruct(self.trellis, self.suh, self.svh, self.codebook)
        if trim:
            w = w[: self.in_features, : self.out_features]
        w = w.to(dtype).contiguous()
        if self._cache_enabled(self.trellis.device):
            self._w_cache = w
        return w

    # ---- kernel prewarm -------------------------------------------------------------------------------
    def kernel_key(self, dtype: torch.dtype) -> tuple:
        """What the CUDA kernels specialize on for this layer and activation ``dtype`` (the row count aside):
        layers with equal keys share every compiled specialization."""
        return (self.in_padded, self.out_padded, self.bits, self.codebook, dtype, str(self.trellis.device))

    def _on_kernel_device(self) -> bool:
        """True where the forward runs exl3rt's Triton kernels (CUDA)."""
        return self.trellis.device.type == "cuda"

    def prewarm(self, dtype: torch.dtype, done: Optional[set] = None) -> int:
        """Compile every CUDA kernel specialization this layer can reach (every row bucket of
        :func:`exl3rt.kernels.specialization`) for activations of ``dtype``, before CUDA-graph capture or
        memory sizing; returns the launches made (0 off CUDA, or when :meth:`kernel_key` is already in
        ``done``, which is updated)."""
        if not self._on_kernel_device():
            return 0
        key = self.kernel_key(dtype)
        if done is not None:
            if key in done:
                return 0
            done.add(key)
        from ..kernels.linear import prewarm
        return prewarm([(self.in_padded, self.out_padded, self.bits, self.codebook)],
                       device=self.trellis.device, dtype=dtype)

    # ---- forward ------------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name or 'Exl3Linear'}: input has {x.shape[-1]} features in its last dimension, "
                             f"expected in_features={self.in_features} (input shape {tuple(x.shape)})")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{self.name or 'Exl3Linear'}: input dtype {x.dtype} is not floating point")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features] -> [..., out_features]`` in ``x.dtype``."""
        self._check_input(x)
        if x.device.type == "cuda":
            y = self._padded_forward(x)
        else:
            y = self._reference_forward(x)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """CPU / any-device reference: ``x @ W[:in, :out]`` with W decoded by :func:`format.reconstruct`."""
        w = self.dequantized_weight(x.dtype)
        return torch.matmul(x, w)

    def _padded_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Flatten to 2-D, zero-pad to ``in_p``, run :meth:`_kernel_forward`, trim to ``out_features``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.in_padded != self.in_features:
            x2 = torch.nn.functional.pad(x2, (0, self.in_padded - self.in_features))
        y = self._kernel_forward(x2.contiguous())
        return y[:, : self.out_features].reshape(*lead, self.out_features)

    def _kernel_forward(self, x_padded: torch.Tensor) -> torch.Tensor:
        """THE kernel hook: ``x_padded [rows, in_p]`` -> ``[rows, out_p]`` in ``x_padded.dtype``.

        On CUDA: :func:`exl3rt.kernels.exl3_linear` (Triton; decode-on-the-fly GEMV for few rows,
        Triton decode + matmul for more). Elsewhere (or without Triton): dequantize (untrimmed) and
        matmul.
        """
        if x_padded.device.type == "cuda":
            # imported here: importing triton (and defining the kernels) only when CUDA is used
            from ..kernels.gemv import HAVE_TRITON
            if HAVE_TRITON:
                from ..kernels.linear import exl3_linear
                return exl3_linear(x_padded, self.trellis, self.suh, self.svh, self.codebook)
        return x_padded @ self.dequantized_weight(x_padded.dtype, trim=False)


__all__ = ["Exl3Linear"]
