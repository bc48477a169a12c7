"""The plugin's settings from vLLM's ``quantization_config`` dict (pure: no vLLM import).

Two modes, one method name (``quantization="exl3"``):

- ``"checkpoint"``: the model directory holds EXL3 codes (``*.trellis`` tensors, written by
  ``exl3rt quantize`` or exllamav3). Detected from the files; the dict is the checkpoint's own
  ``quantization_config`` and only informs.
- ``"online"``: a BF16/FP16 checkpoint, encoded at load through exl3rt's cache. The dict comes from
  ``hf_overrides={"quantization_config": {"quant_method": "exl3", "bits": 4, ...}}``; its other keys
  are :class:`exl3rt.Exl3Config` fields (``bits``, ``codebook``, ``seed``, ``bits_for``, ``ignore``,
  ``cache_dir``, ``cache_mode``, ``encode_device``, ``backend``, ``dequant_cache``). ``bits`` and
  ``codebook`` fall back to ``EXL3RT_VLLM_BITS`` / ``EXL3RT_VLLM_CODEBOOK``, then to 4 / mcg.

``"mode"`` in the dict forces one of them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from ... import env
from ...runtime.config import Exl3Config, Exl3ConfigError

MODES = ("online", "checkpoint")
#: keys of the dict that are not Exl3Config fields
_META = ("quant_method", "mode")
#: keys only a checkpoint's own quantization_config has (exl3rt and exllamav3 writers)
_CHECKPOINT_KEYS = ("version", "quantizer", "head_bits", "calibration", "tensor_storage")


def requested_mode(raw: Mapping[str, Any]) -> Optional[str]:
    """``raw["mode"]`` checked, or None."""
    mode = raw.get("mode")
    if mode is None:
        return None
    if mode not in MODES:
        raise Exl3ConfigError(f"quantization_config.mode={mode!r}: use 'online' (encode a BF16 checkpoint at load) "
                              f"or 'checkpoint' (serve stored EXL3 codes), or leave it out")
    return str(mode)


def guess_mode(raw: Mapping[str, Any]) -> str:
    """The mode from the dict alone (used until the checkpoint's files are looked at)."""
    forced = requested_mode(raw)
    if forced:
        return forced
    return "checkpoint" if any(k in raw for k in _CHECKPOINT_KEYS) else "online"


def online_config(raw: Mapping[str, Any]) -> Exl3Config:
    """The :class:`Exl3Config` of online mode (dict fields, then ``EXL3RT_VLLM_*``, then defaults).

    ``progress`` is off (vLLM logs its own load progress). Unknown keys raise Exl3ConfigError naming them.
    """
    fields = {k: v for k, v in raw.items() if k not in _META}
    if "bits" not in fields and env.VLLM_BITS.get() is not None:
        fields["bits"] = env.VLLM_BITS.get()
    if "codebook" not in fields and env.VLLM_CODEBOOK.get() is not None:
        fields["codebook"] = env.VLLM_CODEBOOK.get()
    fields.setdefault("progress", False)
    try:
        return Exl3Config.from_dict(fields)
    except Exl3ConfigError as exc:
        raise Exl3ConfigError(f"vLLM quantization_config for 'exl3': {exc}") from None


def stored_linears(model_dir: str | os.PathLike[str]) -> Optional[set[str]]:
    """Names of the EXL3 linears stored in ``model_dir`` (``<name>.trellis``), or None if it is not a local dir."""
    path = Path(model_dir)
    if not path.is_dir():
        return None
    from ...util.tensorfiles import TensorFiles, TensorFileError

    try:
        names = TensorFiles(path).names()
    except TensorFileError:
        return None
    return {n[: -len(".trellis")] for n in names if n.endswith(".trellis")}


def validate_stored(model_dir: str | os.PathLike[str]) -> None:
    """Checkpoint mode, before vLLM builds the model: the checks every EXL3 loader shares
    (:func:`exl3rt.format.validate.validate_checkpoint`: headers, config.json against the tensors, the values), a
    :class:`~exl3rt.format.errors.FormatError` naming the tensor or file otherwise. A rank-sliced MoE checkpoint gets
    the checks that do not depend on its per-rank expert layout (``load_rank_sliced`` checks those). Nothing for a
    model that is not a local directory (vLLM reads it from the Hub)."""
    path = Path(model_dir)
    if not path.is_dir():
        return
    from ...format.errors import FormatError
    from ...format.validate import validate_checkpoint, validate_model
    from ...moe.rank_checkpoint import METADATA_KEY
    from ...util.tensorfiles import TensorFileError, TensorFiles

    try:
        files = TensorFiles(path)
    except TensorFileError as exc:
        raise FormatError(str(exc)) from None
    qc = (files.config or {}).get("quantization_config")
    if isinstance(qc, Mapping) and METADATA_KEY in qc:
        validate_model(files, data=True)
    else:
        validate_checkpoint(path, data=True)


def head_is_exl3(prefix: str, stored: Optional[set[str]], raw: Mapping[str, Any]) -> bool:
    """Whether the checkpoint stores head ``prefix`` (vLLM's ``ParallelLMHead``) as EXL3 codes.

    From the files when they were looked at (``<prefix>.trellis`` stored; the loader then checks suh/svh and the
    codebook marker); otherwise (not a local directory) from the checkpoint's ``quantization_config``:
    ``head_bits`` present and not 16 (exl3rt and exllamav3 write it; 16 means a BF16 head).
    """
    if stored is not None:
        return prefix in stored
    hb = raw.get("head_bits")
    return hb is not None and float(hb) != 16


def hf_config_dict(model_dir: str | os.PathLike[str]) -> Optional[dict[str, Any]]:
    """``config.json`` of a local model directory as a dict (None: not a local directory, or no config)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    import json

    with open(path) as f:
        out = json.load(f)
    return out if isinstance(out, dict) else None


__all__ = ["MODES", "requested_mode", "guess_mode", "head_is_exl3", "hf_config_dict", "online_config",
           "stored_linears", "validate_stored"]
