"""One validation of model checkpoints, shared by every loader of an EXL3 checkpoint and by ``exl3rt inspect``.

Every loader runs :func:`validate_checkpoint` before a weight is read into a model: ``from_pretrained``
(:class:`exl3rt.integrations.transformers.Exl3CheckpointQuantizer`, before the model is even built when the
checkpoint is a local directory), ``exl3rt generate`` / ``eval`` (before ``from_pretrained``), the vLLM plugin's
checkpoint mode (``maybe_update_config``) and ``exl3rt inspect`` (``--validate``: with the data check). What it checks:

- headers (:class:`~exl3rt.format.checkpoint.Exl3Checkpoint`, :class:`~exl3rt.util.tensorfiles.TensorFiles`): the
  exact dtype of each EXL3 tensor, suh/svh/bias/marker shapes against the trellis, every tensor in exactly one file,
  one set of weight files (``model.safetensors`` beside an index, ``transformers_weights``);
- config.json against the tensors (:func:`check_config`): the values a model is built from are positive integers
  (``num_hidden_layers``, ``hidden_size``, ``vocab_size``, the head counts, ``head_dim``; from ``text_config`` where
  the top level lacks them), ``quantization_config`` an object, no more layers than stored, and the token embedding
  ``[vocab_size, hidden_size]``. This runs on the config dict before any model exists: a config that would build a
  model far larger than its checkpoint is refused in milliseconds instead of filling memory;
- with ``data=True``, the values (:func:`check_values`): no NaN or inf in any stored floating tensor (scales,
  biases, embeddings, norms, an unquantized head), read in bounded slices, and every codebook marker's value.

The shapes of the other tensors against the model transformers builds (and the EXL3 widths against it) are checked
where that model exists, on the meta device (the quantizer's ``_process_model_before_weight_loading``, which
``inspect`` runs through ``plan_checkpoint_load``). Every refusal is a :class:`FormatError` naming the tensor or the
file and the fix.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional, Union

import torch

from ..util.tensorfiles import CONFIG_NAME, FLOAT_DTYPES, TensorFileError, TensorFiles
from .checkpoint import QUANT_METHOD, Exl3Checkpoint
from .errors import FormatError

#: config.json fields a model is built from that must be positive integers where present (None: the default)
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
               "head_dim")
#: config fields that give the token embedding a width other than hidden_size (then only its rows are compared)
_EMBED_WIDTH_FIELDS = ("embedding_size", "word_embed_proj_dim", "embed_dim")
#: where a causal LM's decoder stores its layers and token embedding (text models, multimodal wrappers, GPT-2 style)
_TEXT_PREFIX = (r"(?:model\.(?:language_model\.|text_model\.|decoder\.)?|language_model\.(?:model\.)?|transformer\."
                r"|gpt_neox\.|backbone\.)")
_LAYER = re.compile(rf"^(?P<prefix>{_TEXT_PREFIX}(?:layers|h|blocks)\.)(?P<i>\d+)\.")
_TOKEN_EMBED = re.compile(rf"^{_TEXT_PREFIX}?(?:embed_tokens|wte|embed_in|word_embeddings|embeddings)\.weight$")
#: bytes of one slice in the value scan
SCAN_BYTES = 64 << 20


def incomplete(path: Union[str, os.PathLike[str]]) -> FormatError:
    """The error for a directory of weights without config.json (what an interrupted writer leaves)."""
    return FormatError(f"{path}: no {CONFIG_NAME}, so not a complete checkpoint (exl3rt writes {CONFIG_NAME} last: an "
                       f"interrupted save or quantize leaves none); rerun the save or quantize, or copy the checkpoint "
                       f"again")


def config_value(config: Mapping[str, Any], field: str) -> tuple[Any, str]:
    """``(value, label)`` of ``field``: the top level's, else ``text_config``'s (multimodal configs nest the text
    model's sizes there); ``(None, field)`` when neither has it."""
    value = config.get(field)
    if value is not None:
        return value, field
    text = config.get("text_config")
    if isinstance(text, Mapping) and text.get(field) is not None:
        return text[field], f"text_config.{field}"
    return None, field


def check_config_values(config: Mapping[str, Any], where: Union[str, os.PathLike[str]]) -> None:
    """The config values themselves (no tensors needed): the size fields positive integers, ``quantization_config``
    and ``text_config`` objects. ``where`` names the config file in the errors."""
    for key in ("quantization_config", "text_config"):
        value = config.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise FormatError(f"{where}: {key} is a JSON {_json_type(value)}, not an object; config.json is damaged "
                              f"(use the checkpoint's own config.json)")
    for field in SIZE_FIELDS:
        value, label = config_value(config, field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise FormatError(f"{where}: {label}={value!r} is not a positive integer; config.json is damaged (use the "
                              f"checkpoint's own config.json)")


def stored_layers(names: list[str]) -> dict[str, int]:
    """Decoder layer prefix (``model.layers.``) -> layers stored under it (1 + the highest index)."""
    out: dict[str, int] = {}
    for n in names:
        m = _LAYER.match(n)
        if m:
            out[m["prefix"]] = max(out.get(m["prefix"], 0), int(m["i"]) + 1)
    return out


def check_config(config: Mapping[str, Any], files: TensorFiles, *, embedding: bool = True) -> None:
    """config.json against the stored tensors (headers only), before any model is built from it; ``embedding``: the
    token embedding's shape too."""
    where = files.root / CONFIG_NAME
    check_config_values(config, where)
    names = files.names()
    layers, label = config_value(config, "num_hidden_layers")
    if layers is not None:
        stored = stored_layers(names)
        if stored:
            prefix, have = max(stored.items(), key=lambda kv: kv[1])
            if layers > have:
                raise FormatError(f"{where}: {label}={layers}, but {files.path} stores {have} layer(s) "
                                  f"({prefix}0 to {prefix}{have - 1}); config.json and the weights disagree (use the "
                                  f"checkpoint's own config.json)")
        elif layers > len(names):
            raise FormatError(f"{where}: {label}={layers}, but {files.path} stores only {len(names)} tensor(s) (a "
                              f"layer has at least one); config.json and the weights disagree (use the checkpoint's "
                              f"own config.json)")
    embed = next((n for n in names if _TOKEN_EMBED.match(n)), None) if embedding else None
    if embed is None:
        return
    info = files.info(embed)
    vocab, vocab_label = config_value(config, "vocab_size")
    hidden, hidden_label = config_value(config, "hidden_size")
    if any(config_value(config, f)[0] is not None for f in _EMBED_WIDTH_FIELDS):
        hidden = None
    if len(info.shape) != 2:
        raise FormatError(f"{embed}: shape {list(info.shape)} in {files.root / info.file}, but a token embedding is "
                          f"[vocab_size, hidden_size]; the tensor is corrupt")
    for got, want, lab in ((info.shape[0], vocab, vocab_label), (info.shape[1], hidden, hidden_label)):
        if want is not None and got != want:
            raise FormatError(f"{embed}: shape {list(info.shape)} in {files.root / info.file}, but config.json's "
                              f"{lab} is {want} (a token embedding is [vocab_size, hidden_size]); config.json and the "
                              f"weights disagree (use the checkpoint's own config.json)")


def check_values(files: TensorFiles, names: Optional[list[str]] = None, *, max_bytes: int = SCAN_BYTES) -> None:
    """No NaN or inf in any floating tensor of ``files`` (or of ``names``), each read in slices of ``max_bytes``."""
    for name in names if names is not None else files.names():
        info = files.info(name)
        if info.dtype not in FLOAT_DTYPES:
            continue
        row = 0
        for part in files.chunks(name, max_bytes):
            if part.element_size() == 1:    # fp8: torch's isfinite wants a wider type
                part = part.to(torch.float16)
            finite = torch.isfinite(part)
            if not bool(finite.all()):
                at = torch.nonzero(~finite)[0].tolist()
                if at:
                    at[0] += row
                raise FormatError(f"{name}: non-finite values (NaN/inf) in {files.root / info.file}, the first at "
                                  f"index {at}; the tensor is corrupt (download or convert the checkpoint again)")
            row += part.shape[0] if part.dim() else 1


def validate_model(path: Union[str, os.PathLike[str], TensorFiles], *, data: bool = False,
                   embedding: bool = True) -> TensorFiles:
    """The checks that do not depend on EXL3 (any model directory: an unquantized model to encode on load, a
    rank-sliced MoE checkpoint): headers, config.json against the tensors (``embedding``: the token embedding's
    shape too), and with ``data`` the values."""
    try:
        files = path if isinstance(path, TensorFiles) else TensorFiles(path)
    except TensorFileError as exc:
        raise FormatError(str(exc)) from None
    if files.config is not None:
        check_config(files.config, files, embedding=embedding)
    if data:
        check_values(files)
    return files


def validate_checkpoint(path: Union[str, os.PathLike[str], Exl3Checkpoint], *, data: bool,
                        require_config: bool = True) -> Exl3Checkpoint:
    """Every check an EXL3 checkpoint gets before a loader reads a weight (module docstring); returns the checkpoint.

    ``data``: also read the values (NaN/inf, codebook markers). ``require_config``: a directory without config.json
    is an error (plain ``inspect`` lists one anyway)."""
    ckpt = path if isinstance(path, Exl3Checkpoint) else Exl3Checkpoint(path)
    if ckpt.config is None:
        if ckpt.path.is_dir() and require_config:
            raise incomplete(ckpt.path)
    else:
        check_config(ckpt.config, ckpt.files)
        qc = ckpt.config.get("quantization_config")
        if ckpt.linears() and not isinstance(qc, Mapping):
            first = ckpt.linears()[0].name
            raise FormatError(f"{ckpt.root / CONFIG_NAME}: no quantization_config, but {first}.trellis and others are "
                              f"EXL3 codes; loaders would take the checkpoint for an unquantized model: add "
                              f"quantization_config {{\"quant_method\": \"{QUANT_METHOD}\"}} (or use the checkpoint's "
                              f"own config.json)")
    if data:
        ckpt.check_markers()
        check_values(ckpt.files)
    return ckpt


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "value")


__all__ = ["SIZE_FIELDS", "check_config", "check_config_values", "check_values", "config_value", "incomplete",
           "stored_layers", "validate_checkpoint", "validate_model"]
