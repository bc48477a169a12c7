"""OnlineEncoder: one weight in, its EXL3 codes out, through the persistent cache.

Shared by :func:`exl3rt.quantize_model` and the transformers integration, so both produce the same
codes for the same weight: key = (the weight's bytes as loaded, K, codebook, seed, encoder version, …),
seed = ``module_seed(name, config.seed)`` (depends on the module name only, not on processing order).

    weight_hf [out, in] ──key──► cache hit: read the entry
                                 miss: quantize_weight(weight_hfᵀ as fp32 on encode_device) ─► publish
                         ──► EncodedLinear on the weight's device (bias not included)

The encoder itself is looked up at call time (``exl3rt.encode.quantize.quantize_weight``), never on a hit.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..cache.key import module_seed
from ..format.bits import Bits
from ..format.encoded import EncodedLinear
from .config import Exl3Config

if TYPE_CHECKING:  # the cache module is imported on first use (it pulls in blake3 and filelock)
    from ..cache import EncodingCache

log = logging.getLogger("exl3rt.runtime")


@dataclasses.dataclass
class OnlineStats:
    """What one quantization pass did (``summary()`` of :func:`quantize_model` and of the HF quantizer)."""

    layers: int = 0              # 2-D matrices encoded or read
    modules: int = 0             # modules replaced (a fused experts module counts once)
    hits: int = 0
    misses: int = 0
    encode_seconds: float = 0.0  # wall time of misses (encode + publish)
    read_seconds: float = 0.0    # wall time of hits
    total_weights: int = 0       # logical weights (in·out) of the quantized matrices
    bit_weights: float = 0.0     # Σ K·weights
    code_bytes: int = 0          # bytes of trellis + suh + svh
    seconds: float = 0.0         # wall time of the whole pass

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["bit_weights"]
        out["avg_bits"] = self.bit_weights / self.total_weights if self.total_weights else 0.0
        out["bpw"] = 8 * self.code_bytes / self.total_weights if self.total_weights else 0.0
        return out


def progress_label(stats: Optional[OnlineStats]) -> str:
    """A quantization pass's progress-bar label, true to what it has done so far: a pass whose layers all came
    from the cache is loading, not quantizing (``None``: nothing done yet)."""
    if stats is None or stats.layers == 0 or stats.hits == 0:
        return "exl3rt: quantizing"
    if stats.misses == 0:
        return "exl3rt: loading from the encoding cache"
    return f"exl3rt: quantizing ({stats.hits} of {stats.layers} matrices from the cache)"


def make_cache(config: Exl3Config) -> "EncodingCache":
    """The :class:`~exl3rt.cache.EncodingCache` the config asks for (root/mode None: the environment)."""
    from ..cache import EncodingCache

    return EncodingCache(root=config.cache_dir, mode=config.cache_mode)


class OnlineEncoder:
    """Encodes (or reads from ``cache``) the matrices of one model under ``config``; keeps :class:`OnlineStats`."""

    def __init__(self, config: Exl3Config, cache: Optional["EncodingCache"] = None):
        self.config = config
        self.cache = cache if cache is not None else make_cache(config)
        self.stats = OnlineStats()

    def encode(self, name: str, weight_hf: torch.Tensor, bits: Bits,
               device: Optional[torch.device | str] = None, *,
               tp: Optional[tuple[int, int, tuple[int, int, int, int]]] = None) -> EncodedLinear:
        """Codes of ``weight_hf`` (HF ``[out, in]``, as loaded) for module ``name`` at K = ``bits``.

        The result lives on ``device`` (default: the weight's device). A miss encodes on
        ``config.encode_device`` (default: the weight's device) and publishes to the cache.

        ``tp = (tp_size, tp_rank, bounds)``: ``weight_hf`` is one tensor-parallel rank's slice of module
        ``name``'s weight, at ``bounds = (row0, row1, col0, col1)`` of the whole ``[out, in]`` weight
        (vLLM). The key is that of the slice's own bytes plus these three fields, so each rank's
        encoding is its own entry; ``None`` (the whole weight) gives the key every other path uses.
        """
        cfg = self.config
        if weight_hf.device.type == "meta":
            raise RuntimeError(f"{name}: the weight is on the meta device; load the model's weights before "
                               f"quantizing (e.g. from_pretrained without device_map='meta')")
        if weight_hf.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D [out, in] weight, got shape {tuple(weight_hf.shape)}")
        device = torch.device(device) if device is not None else weight_hf.device
        seed = module_seed(name, cfg.seed)
        key = self.cache.key_for_weight(weight_hf, bits=bits, codebook=cfg.codebook, seed=seed, hessian=None,
                                        tp_size=1, tp_rank=0, tp_bounds=None, out_scales=True)
        if tp is not None:
            tp_size, tp_rank, bounds = tp
            key = dataclasses.replace(key, tp_size=int(tp_size), tp_rank=int(tp_rank),
                                      tp_bounds=tuple(int(b) for b in bounds))

        def encode_fn() -> EncodedLinear:
            from ..encode import quantize as _quantize  # looked up per call (tests patch quantize_weight)

            where = torch.device(cfg.encode_device) if cfg.encode_device else weight_hf.device
            w = weight_hf.detach().to(where, torch.float32).t()
            return _quantize.quantize_weight(w, bits, cfg.codebook, None, seed, backend=cfg.backend, name=name)

        res = self.cache.load_or_encode(key, encode_fn, device=device, name=name)
        enc = res.encoded
        if enc.trellis.device != device:
            enc = enc.to(device)
        st = self.stats
        st.layers += 1
        if res.hit:
            st.hits += 1
            st.read_seconds += res.seconds
        else:
            st.misses += 1
            st.encode_seconds += res.seconds
        n = int(weight_hf.shape[0]) * int(weight_hf.shape[1])
        st.total_weights += n
        st.bit_weights += float(enc.bits) * n
        st.code_bytes += sum(t.numel() * t.element_size() for t in (enc.trellis, enc.suh, enc.svh))
        log.debug("%s: K=%s %s in %.2f s", name, enc.bits, "cache hit" if res.hit else "encoded", res.seconds)
        return enc

    def summary(self) -> dict[str, Any]:
        out = self.stats.as_dict()
        out["cache"] = self.cache.stats.as_dict()
        out["cache_root"] = str(self.cache.root)
        out["cache_mode"] = str(self.cache.mode)
        return out


__all__ = ["OnlineEncoder", "OnlineStats", "make_cache", "progress_label"]
