"""Perplexity of a causal LM on a text, in non-overlapping windows.

    tokens t_0 … t_{N-1} (BOS prepended when the tokenizer has one), split into windows of
    ``ctx`` tokens; in each window the model predicts tokens 1 … len−1 from their prefixes.
    NLL = −Σ log p(t_i | window prefix) over every predicted token;  PPL = exp(NLL / count).

Every window starts fresh (no state carried over), so the first token of each window is
context-only. The same text, tokenizer, ``ctx`` and device give the same token set for every
model, which is what makes BF16 and the EXL3 bitrates comparable in one table.

The bundled text (``exl3rt/data/eval_text.txt``, ~1500 words of plain English prose written for
this project) is short enough to score on a CPU in seconds; it is a sanity check of quantization
damage, not a benchmark score to compare with published numbers.
"""

from __future__ import annotations

import dataclasses
import math
from importlib import resources
from typing import Any, Optional

import torch


def bundled_text() -> str:
    """The evaluation text shipped with exl3rt."""
    return resources.files("exl3rt.data").joinpath("eval_text.txt").read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float        # total negative log-likelihood (nats)
    tokens: int       # predicted tokens
    windows: int


def token_ids(tokenizer: Any, text: str) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids = [int(bos)] + ids
    return [int(i) for i in ids]


def token_windows(tokenizer: Any, text: Optional[str] = None, *, ctx: int = 512,
                  max_tokens: Optional[int] = None) -> list[list[int]]:
    """The windows :func:`perplexity` scores: the text's tokens (BOS first where the tokenizer has one), cut into
    ``ctx``-token pieces; a last piece of one token predicts nothing and is dropped."""
    if ctx < 2:
        raise ValueError(f"ctx must be at least 2 tokens, got {ctx}")
    ids = token_ids(tokenizer, bundled_text() if text is None else text)
    if max_tokens is not None:
        ids = ids[: int(max_tokens)]
    windows = [ids[s:s + ctx] for s in range(0, len(ids), ctx)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise ValueError("the text has fewer than 2 tokens; nothing to predict")
    return windows


@torch.no_grad()
def perplexity(model: Any, tokenizer: Any, text: Optional[str] = None, *, ctx: int = 512,
               max_tokens: Optional[int] = None) -> PerplexityResult:
    """Perplexity of ``model`` on ``text`` (default: the bundled text); see the module docstring."""
    device = next(model.parameters()).device
    nll, count, windows = 0.0, 0, 0
    for chunk in token_windows(tokenizer, text, ctx=ctx, max_tokens=max_tokens):
        x = torch.tensor([chunk], dtype=torch.long, device=device)
        logits = model(input_ids=x).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = x[0, 1:]
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(chunk) - 1
        windows += 1
    return PerplexityResult(ppl=math.exp(nll / count), nll=nll, tokens=count, windows=windows)
