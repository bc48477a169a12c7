"""Model surgery shared by the in-place pass (quantize_model) and the loaders (integrations): put a module
in place of another by its dotted name, stop a quantized head from being re-tied to the embedding, and encode
one ``nn.Linear`` into its :class:`~exl3rt.runtime.linear.Exl3Linear`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .linear import Exl3Linear

if TYPE_CHECKING:
    from .config import Exl3Config
    from .online import OnlineEncoder
    from .policy import LinearTarget

__all__ = ["quantize_linear", "replace_module", "untie_head"]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Set ``new`` as the submodule of ``model`` at the dotted path ``name``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def untie_head(model: nn.Module, head: str) -> None:
    """Stop transformers from re-tying ``<head>.weight`` to the embedding (the head is now EXL3 codes)."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        tied.pop(f"{head}.weight", None)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        for c in {id(cfg): cfg, id(text): text}.values():
            if getattr(c, "tie_word_embeddings", False):
                c.tie_word_embeddings = False


def quantize_linear(module: nn.Linear, target: "LinearTarget", enc: "OnlineEncoder",
                    config: "Exl3Config") -> Exl3Linear:
    """``module``'s weight encoded at ``target.bits`` through ``enc`` (the cache), its bias kept."""
    codes = enc.encode(target.name, module.weight.detach(), target.bits)
    bias = None if module.bias is None else module.bias.detach()
    return Exl3Linear.from_encoded(codes, bias, dequant_cache=config.dequant_cache, name=target.name)
