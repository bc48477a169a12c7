"""exl3rt as a vLLM plugin: ``quantization="exl3"`` for EXL3 checkpoints and online EXL3 (docs/vllm.md).

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point and calls it in every
process. Importing this package does not import vLLM; :func:`register` does.

Files: ``config.py`` (the QuantizationConfig), ``online_method.py`` / ``checkpoint_method.py`` (the
linear methods), ``moe_method.py`` (the fused-MoE methods: online and pre-quantized), ``layout.py``
(a vLLM layer -> its EXL3 matrices), and the vLLM-free parts ``shards.py`` (names, TP bounds),
``slicing.py`` (rank pieces of stored codes), ``forward.py``, ``experts.py`` (MoE experts: rank
slices, stored codes per expert, per-expert K, the layer runtime), ``settings.py`` (mode and config
dict); ``_compat.py`` holds every vLLM import.
"""

from __future__ import annotations


def register() -> None:
    """Register quantization method ``"exl3"`` with vLLM. Re-entrant (a second call changes nothing)."""
    from ._compat import register_quantization_config
    from .quant_config import NAME, Exl3VllmConfig
    from vllm.model_executor.layers.quantization import get_quantization_config, QUANTIZATION_METHODS

    if NAME in QUANTIZATION_METHODS:
        try:
            if get_quantization_config(NAME) is Exl3VllmConfig:
                return
        except ValueError:
            pass
    register_quantization_config(NAME)(Exl3VllmConfig)


__all__ = ["register"]
