"""Torch modules for EXL3 weights and the policy that turns a model into them (docs/online.md).

- :class:`Exl3Config`: online quantization settings.
- :func:`quantize_model`: quantize a loaded model in place, through the encoding cache.
- :class:`Exl3Linear`, :class:`Exl3Experts`, :class:`Exl3MoE`: the modules it installs (Exl3MoE: experts
  at per-expert bitrates run through the planned ``exl3rt.moe`` runtime).
- :class:`TopRouted`: the "most-routed experts at the higher K" rule (router statistics).
- :func:`save_exl3`: write a quantized model as an EXL3 checkpoint (exllamav3's layout, the codes bit for bit).
"""

from .config import QUANT_METHOD, Exl3Config, Exl3ConfigError
from .experts import Exl3Experts
from .fusion import fuse_linears, unfuse_linears
from .export import save_exl3
from .linear import Exl3Linear
from .policy import PolicyError, select_targets
from .moe_module import Exl3MoE
from .quantize_model import quantize_model
from .router_stats import TopRouted

__all__ = ["QUANT_METHOD", "Exl3Config", "Exl3ConfigError", "Exl3Experts", "Exl3Linear", "PolicyError",
           "quantize_model", "select_targets", "Exl3MoE", "TopRouted", "save_exl3", "fuse_linears", "unfuse_linears"]
