"""Calibration for offline conversion: run the model over a text once and collect each linear's H = XᵀX/n.

Needs transformers (``pip install 'exl3rt[hf]'``). Hooks every ``nn.Linear`` of the unquantized
model (so layer i's Hessian sees the inputs of the original model, not of the already-quantized
layers before it, as exllamav3 does: a simplification that costs a little quality). All
Hessians are held in memory at once (in²·4 bytes per linear): fine for models up to a few B
parameters; larger models should be converted uncalibrated or layer by layer (not yet supported).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Optional

import torch

from ..encode.errors import EncodeError
from ..encode.hessian import HessianCollector
from ..util.progress import Progress


def calibration_id(text: bytes, rows: int, tokens: int) -> str:
    """Identifies the calibration data (for resuming a conversion with the same Hessians)."""
    return hashlib.sha256(text + f"|{rows}|{tokens}".encode()).hexdigest()[:16]


def collect_hessians(src: str | Path, text_file: str | Path, *, rows: int = 32, tokens: int = 512,
                     device: str | torch.device = "cpu",
                     progress: bool = True) -> tuple[Callable[[str], Optional[torch.Tensor]], str]:
    """Return (``name -> H or None``, calibration id) for the model at ``src`` over ``text_file``."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise EncodeError("--calibrate needs transformers: pip install 'exl3rt[hf]'") from None
    raw = Path(text_file).read_bytes()
    tok = AutoTokenizer.from_pretrained(str(src))
    ids = tok(raw.decode("utf8", errors="replace"), return_tensors="pt").input_ids[0]
    tokens = min(tokens, int(ids.numel()))
    if tokens < 16:
        raise EncodeError(f"{text_file}: only {ids.numel()} tokens; calibration needs at least 16")
    n = max(1, min(rows, int(ids.numel()) // tokens))
    batches = ids[: n * tokens].reshape(n, tokens)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(device).eval()
    collectors: dict[str, HessianCollector] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            c = collectors[name] = HessianCollector(mod.in_features, name=name)
            hooks.append(mod.register_forward_pre_hook(lambda m, inp, c=c: c.update(inp[0])))
    try:
        with torch.no_grad(), Progress(n, "calibrating", unit=" seq", enabled=progress) as bar:
            for row in batches:
                model(row[None].to(device))
                bar.update(1)
    finally:
        for h in hooks:
            h.remove()
    hessians = {name: c.finalize() for name, c in collectors.items()}
    del model
    return (lambda name: None if hessians.get(name) is None else hessians[name].cpu()), calibration_id(raw, n, tokens)
