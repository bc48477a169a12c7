"""save_exl3: write a model whose linears are EXL3 modules as an EXL3 checkpoint (exllamav3's layout).

What a model quantized online holds is exactly what a checkpoint stores: every :class:`Exl3Linear`
(experts included: :class:`Exl3Experts` names its children ``<experts>.{e}.gate_proj`` and so on, the
per-expert layout of exllamav3) goes in as its codes, bit for bit; every other tensor of the state dict
(embeddings, norms, routers, an unquantized head) as it is. The checkpoint is written through
:class:`~exl3rt.format.checkpoint_write.CheckpointWriter`: shards under partial names, then the index and
the configs, so a crash or a refused model leaves no checkpoint behind. The tokenizer files of the local directory
the model was loaded from go beside it, so that the checkpoint runs on its own (``exl3rt generate --model``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..format.checkpoint_write import DEFAULT_SHARD_BYTES, CheckpointWriter, card_source
from ..format.errors import FormatError
from ..format.output import manifest, tokenizer_files
from ..util.progress import Progress
from .experts import Exl3Experts
from .linear import Exl3Linear

# Exl3Linear's own tensors: written by add_linear, never as plain tensors
_LINEAR_TENSORS = ("trellis", "suh", "svh", "bias")


def _check_model(model: nn.Module, linears: dict[str, Exl3Linear]) -> None:
    if not linears:
        raise FormatError("save_exl3: the model has no EXL3 linear; quantize it first "
                          "(exl3rt.quantize_model or from_pretrained with an Exl3Config)")
    for name, m in model.named_modules():
        if isinstance(m, Exl3Experts):
            fused = [p for p in ("gate_up_proj_bias", "down_proj_bias") if getattr(m, p, None) is not None]
            if fused:
                raise FormatError(f"{name}.{fused[0]}: fused expert biases have no place in the per-expert "
                                  f"EXL3 layout; this model cannot be saved as an EXL3 checkpoint")


def _config_dict(model: nn.Module) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise FormatError("save_exl3: the model has no Hugging Face config (model.config); "
                          "exllamav3 and from_pretrained need one")
    out = cfg.to_dict()
    out.pop("quantization_config", None)
    if not out.get("architectures"):    # a model built from a config has none; loaders pick the class by it
        out["architectures"] = [type(model).__name__]
    return out


def _source_dirs(model: nn.Module) -> list[str]:
    """The local directories the model was loaded from (``name_or_path``, ``config._name_or_path``); a Hub ID or a
    model built from a config has none."""
    out = []
    config = getattr(model, "config", None)
    for source in (getattr(model, "name_or_path", None), getattr(config, "_name_or_path", None)):
        if source and os.path.isdir(str(source)) and str(source) not in out:
            out.append(str(source))
    return out


def source_tokenizer(model: nn.Module, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """The tokenizer files (:func:`exl3rt.format.output.tokenizer_files`) of the local directory ``model`` was loaded
    from, by name, that a save into ``out_dir`` copies: a file of that name already in ``out_dir`` that an earlier
    exl3rt write did not list (e.g. from ``tokenizer.save_pretrained(out_dir)``) is kept as it is instead."""
    out = Path(out_dir)
    mine = manifest(out) if out.is_dir() else frozenset()
    files: dict[str, Path] = {}
    for source in _source_dirs(model):
        for path in tokenizer_files(source):
            if path.name not in files and (path.name in mine or not os.path.lexists(out / path.name)):
                files[path.name] = path
    return files


def _protected(model: nn.Module) -> dict[str, Any]:
    """What the output directory may not overlap: the local directory the model was loaded from (its weights may
    be the very files a save would replace) and the encoding cache root."""
    from ..cache.modes import default_cache_root

    out: dict[str, Any] = {"the encoding cache": default_cache_root()}
    for i, source in enumerate(_source_dirs(model)):    # name_or_path and config._name_or_path may differ
        out["the directory the model was loaded from" + (f" ({i + 1})" if i else "")] = source
    quantizer = getattr(model, "hf_quantizer", None)
    root = getattr(getattr(quantizer, "config", None), "cache_dir", None)
    if root:
        out["the model's encoding cache"] = root
    return out


def save_exl3(model: nn.Module, out_dir: str | os.PathLike[str], *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              overwrite: bool = False, progress: bool = True, config: Optional[dict[str, Any]] = None,
              side_texts: Optional[dict[str, str]] = None, tokenizer: bool = True) -> Path:
    """Write ``model`` (its linears :class:`Exl3Linear`) as an EXL3 checkpoint in ``out_dir``; return it.

    ``config`` replaces ``model.config.to_dict()`` (the config.json body; its ``quantization_config`` is
    always the checkpoint's own). ``side_texts``: files written beside it (name -> text, e.g. the generation
    config). ``tokenizer``: copy the tokenizer files of the local directory the model was loaded from
    (:func:`source_tokenizer`; a Hub ID gives none: save the tokenizer with its own ``save_pretrained``). Tensors
    tied to one another (a tied embedding and head) are stored once, under the first name.
    Nothing is left in ``out_dir`` if anything fails before the end. ``out_dir`` may not be or overlap the
    directory the model was loaded from or the encoding cache; it must be new or empty unless ``overwrite``, and
    with ``overwrite`` only checkpoint files (and those of an earlier exl3rt write) are replaced or removed
    (:mod:`exl3rt.format.output`).
    """
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Exl3Linear)}
    _check_model(model, linears)
    body = dict(config) if config is not None else _config_dict(model)
    state = model.state_dict()
    owned = {f"{name}.{t}" for name in linears for t in _LINEAR_TENSORS}
    plain: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    for key, t in state.items():
        if key in owned:
            continue
        if t.device.type == "meta":
            raise FormatError(f"{key}: on the meta device (never loaded or offloaded); load the whole model "
                              f"before saving it")
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and ident in seen:     # tied to a tensor already written
            continue
        seen[ident] = key
        plain[key] = t
    head = next((n for n in linears if n.rsplit(".", 1)[-1] == "lm_head"), "lm_head")
    texts = dict(side_texts or {})
    files = {n: p for n, p in (source_tokenizer(model, out_dir) if tokenizer else {}).items() if n not in texts}
    with Progress(len(linears) + len(plain), "writing EXL3 checkpoint", enabled=progress) as bar, \
            CheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite, protect=_protected(model),
                             writes=(*texts, *files)) as w:
        for name, m in linears.items():
            enc = m.encoded()
            if getattr(m, "bias", None) is not None:    # stored fp16 at the padded width, as the format says
                bias = torch.zeros(enc.out_padded, dtype=torch.float16, device=m.bias.device)
                bias[: m.out_features] = m.bias.detach()
                enc = dataclasses.replace(enc, bias=bias)
            w.add_linear(name, enc)
            bar.update()
        for key, t in plain.items():
            w.add_tensor(key, t)
            bar.update()
        for name, text in texts.items():
            w.add_text(name, text)
        for name, path in files.items():
            w.add_file(name, path)
        source = card_source(getattr(getattr(model, "config", None), "_name_or_path", None))
        return w.finish(body, head_name=head, source=source)
