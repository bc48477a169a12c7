"""Exl3Linear: a drop-in ``nn.Linear`` whose weight is held as EXL3 trellis codes.

    y = x · W[:in, :out] + bias,    W = diag(suh)·Hk·Q·Hn·diag(svh)  ([in_p, out_p], format.reconstruct)

Buffers (persistent, so they load and move like weights)::

    trellis  int16 [in_p/16, out_p/16, 16·K]   (K follows from the last dimension)
    suh      fp16  [in_p]
    svh      fp16  [out_p]
    bias     Parameter [out_features] in the model dtype, or None

Forward: one custom op, ``torch.ops.exl3rt.linear`` (:mod:`exl3rt.kernels.ops`), so torch.compile, CUDA
graphs and vLLM see one opaque node per layer; then the bias. In plain eager mode the op's implementation is
called directly (:func:`exl3rt.kernels.ops.call_linear`): the same computation without the dispatch's host time;
where the decoded weight is kept for the input's dtype and device (CPU), forward multiplies by it at once, as
``nn.Linear`` would, without the op's layers of calls.

- **CPU (reference path)**: ``W = format.reconstruct(...)`` trimmed to ``[in, out]``, cast to the
  activation dtype, then ``x @ W``. Trimming W equals zero-padding x to ``in_p`` and trimming y.
- **CUDA**: ``x`` flattened and zero-padded to ``in_p``, the Triton kernels (``exl3rt.kernels.exl3_linear``,
  ``[rows, in_p] -> [rows, out_p]``), trimmed to ``out_features``.

Dequantized-weight cache: decoding the trellis costs far more than the matmul, so re-decoding on
every call makes generation unusably slow on CPU. The module therefore keeps the decoded weight
(activation dtype, on the module's device) after the first forward, or from :meth:`Exl3Linear.prepare`,
when ``dequant_cache`` is True — by default on CPU only (``None``), where it brings memory back to the dense
size for the speed of a dense layer. A compiled forward only reads it (decoding there would be traced):
``prepare`` before compiling. ``dequant_cache=False`` decodes every call (memory stays at the code size);
:meth:`clear_dequant_cache` drops it; moving the module (``.to``/``.cuda``) drops it too.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..format.bits import Bits, bits_from_trellis, normalize_bits, words16_per_tile
from ..format.codebooks import check_codebook
from ..format.encoded import EncodedLinear, padded_width
from ..format.reconstruct import reconstruct
from ..kernels.ops import call_linear, linear_weight  # (importing registers torch.ops.exl3rt.*)

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
        self._fused = None       # the FusedLinears this layer is a member of (exl3rt.runtime.fusion)
        self._fused_index = 0

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
        m._fused, m._fused_index = None, 0
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
        return EncodedLinear(trellis=self.trellis.contiguous(), suh=self.suh, svh=self.svh, codebook=self.codebook,
                             in_features=self.in_features, out_features=self.out_features, name=self.name)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, K={self.bits}, "
                f"codebook={self.codebook}, padded=[{self.in_padded}, {self.out_padded}], "
                f"bias={self.bias is not None}")

    # ---- dequantized weight -----------------------------------------------------------------------
    def _cache_enabled(self, device: torch.device) -> bool:
        return device.type == "cpu" if self.dequant_cache is None else bool(self.dequant_cache)

    def multiplies_kept_weight(self) -> bool:
        """True where the forward multiplies by the kept decoded weight: off CUDA with the dequantized-weight cache
        on (the CPU's default); CUDA runs the kernels."""
        dev = self.trellis.device
        return dev.type != "cuda" and self._cache_enabled(dev)

    def clear_dequant_cache(self) -> None:
        """Drop the kept dequantized weight (the next forward decodes again)."""
        self._w_cache = None

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()`` …: drop the kept weight (it would be stale) and keep suh/svh fp16.

        ``model.to(torch.bfloat16)`` would otherwise round the fp16 scales to bf16 and change W; the
        scales follow the device change only. The bias follows the model's dtype like any parameter.
        """
        self._w_cache = None
        if self._fused is not None:         # the group's fused tensors would not follow
            self._fused.dissolve()
        scales = {n: self._buffers[n] for n in ("suh", "svh") if self._buffers.get(n) is not None}
        out = super()._apply(fn, recurse)
        for n, original in scales.items():
            moved = self._buffers[n]
            if moved is not None and moved.dtype != torch.float16:
                self._buffers[n] = original.to(device=moved.device)
        return out

    def dequantized_weight(self, dtype: torch.dtype = torch.float32, *, trim: bool = True) -> torch.Tensor:
        """W ``[in, out]`` (``[in_p, out_p]`` if not ``trim``) in ``dtype`` on the codes' device, stored as
        ``nn.Linear`` stores its weight (``[out, in]`` contiguous; this is its transposed view), so that a product
        with it runs the GEMM an unquantized linear runs.

        Uses and fills the dequantized-weight cache when it is enabled for this device; the cache holds
        the trimmed or untrimmed form the last caller asked for.
        """
        cached = self._w_cache
        want = (self.in_features, self.out_features) if trim else (self.in_padded, self.out_padded)
        if cached is not None and cached.dtype == dtype and cached.device == self.trellis.device \
                and tuple(cached.shape) == want:
            return cached
        w = reconstruct(self.trellis.contiguous(), self.suh, self.svh, self.codebook)
        if trim:
            w = w[: self.in_features, : self.out_features]
        w = linear_weight(w, dtype)
        if self._cache_enabled(self.trellis.device):
            self._w_cache = w
        return w

    # ---- kernel prewarm -------------------------------------------------------------------------------
    def kernel_key(self, dtype: torch.dtype) -> tuple:
        """What the CUDA kernels specialize on for this layer (for a member of a fused group: the group's fused
        layer) and activation ``dtype`` (the row count aside): layers with equal keys share every compiled
        specialization."""
        return (*self._kernel_shape(), dtype, str(self.trellis.device))

    def _kernel_shape(self) -> tuple:
        if self._fused is not None:
            return self._fused.shape()
        return (self.in_padded, self.out_padded, self.bits, self.codebook)

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
        return prewarm([self._kernel_shape()], device=self.trellis.device, dtype=dtype)

    # ---- forward ------------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name or 'Exl3Linear'}: input has {x.shape[-1]} features in its last dimension, "
                             f"expected in_features={self.in_features} (input shape {tuple(x.shape)})")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{self.name or 'Exl3Linear'}: input dtype {x.dtype} is not floating point")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features] -> [..., out_features]`` in ``x.dtype``: one ``torch.ops.exl3rt.linear`` call
        (:mod:`exl3rt.kernels.ops`; in plain eager mode its implementation directly), then the bias."""
        w = self._w_cache
        if w is not None and self._fused is None and type(x) is torch.Tensor and x.dtype is w.dtype \
                and x.device == w.device and x.shape[-1] == self.in_features \
                and w.shape == (self.in_features, self.out_features) and not torch.compiler.is_compiling():
            # the kept dense weight (CPU): what the op would multiply by, without its layers of calls; as nn.Linear
            # calls it (w is the [in, out] view of an [out, in] buffer)
            return F.linear(x, w.t(), None if self.bias is None else self.bias.to(x.dtype))
        self._check_input(x)
        if self._fused is not None:         # a member of a fused group (exl3rt.runtime.fusion)
            y = self._fused.output(self._fused_index, x)
        else:
            y = self.product(x)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x · W`` of this layer alone (no bias, no fused group)."""
        return call_linear(x, self.trellis, self.suh, self.svh, self._dense_for(x), self.codebook, self.out_features)

    def prepare_decodes(self, dtype: torch.dtype) -> bool:
        """True where :meth:`prepare` for ``dtype`` would decode the kept dense weight (off CUDA, the
        dequantized-weight cache on, and no weight of that dtype kept yet): the slow part of getting ready on a CPU."""
        if self._on_kernel_device() or not self._cache_enabled(self.trellis.device):
            return False
        w = self._w_cache
        return w is None or w.dtype != dtype or tuple(w.shape) != (self.in_features, self.out_features)

    def prepare(self, dtype: torch.dtype, done: Optional[set] = None) -> int:
        """Get ready for activations of ``dtype`` outside any traced code: on CUDA compile the kernels
        (:meth:`prewarm`; returns its launches), elsewhere decode the kept dense weight where the
        dequantized-weight cache is on (a compiled forward then finds it instead of decoding per call)."""
        if self._on_kernel_device():
            return self.prewarm(dtype, done)
        if self._cache_enabled(self.trellis.device):
            self.dequantized_weight(dtype)
        return 0

    def _dense_for(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The decoded ``W[:in, :out]`` the op multiplies by off CUDA (None: the op runs the kernels, or
        decodes for the call). Filled lazily in eager mode; a traced forward only reads it (:meth:`prepare`)."""
        if x.is_cuda or not self._cache_enabled(self.trellis.device):
            return None
        if torch.compiler.is_compiling():
            w = self._w_cache
            if w is None or w.dtype != x.dtype or tuple(w.shape) != (self.in_features, self.out_features):
                _warn_unprepared(self.name)
                return None
            return w
        return self.dequantized_weight(x.dtype)


_WARNED_UNPREPARED: set[str] = set()


def _warn_unprepared(name: str) -> None:
    if not _WARNED_UNPREPARED:
        log.warning("%s: compiled before its dense weight was decoded (call Exl3Linear.prepare(dtype), or run one "
                    "eager forward, before compiling); the compiled model decodes it on every call", name or "Exl3Linear")
    _WARNED_UNPREPARED.add(name)


__all__ = ["Exl3Linear"]
