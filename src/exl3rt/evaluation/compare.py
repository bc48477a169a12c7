"""A quantized model against its unquantized reference, token by token.

    tokens split into windows of ``ctx`` (as :func:`exl3rt.evaluation.perplexity` does); at each predicted position i
    the reference gives P_i = softmax(ref logits), the quantized model Q_i:
      KL    = mean_i  Σ_v P_i(v) · (log P_i(v) − log Q_i(v))        (nats per token, ≥ 0; 0 only for Q = P)
      top-1 = mean_i  [argmax Q_i = argmax P_i]
      PPL   = exp(mean_i −log Q_i(t_{i+1}))

KL-divergence from the reference is the measure of quantization damage that does not depend on how well the model
itself predicts the text: a 3 % perplexity change can hide a large KL (errors that happen to cancel in the likelihood
of the observed tokens), never the other way round. The reference's log-probabilities are kept in float32 on the CPU
(tokens × vocabulary × 4 bytes: 190 MB for 1000 tokens of a 49 k vocabulary), so each compared model costs one pass.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .perplexity import token_windows


@dataclasses.dataclass(frozen=True)
class Comparison:
    ppl: float
    kl: float          # mean KL(P_ref ‖ Q) in nats per predicted token
    top1: float        # fraction of positions where both pick the same most likely token
    tokens: int        # predicted tokens


def _logprobs(model: Any, window: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    x = torch.tensor([window], dtype=torch.long, device=device)
    return torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)


class Reference:
    """The unquantized model's next-token log-probabilities over ``windows`` (float32, CPU), and its perplexity."""

    @torch.no_grad()
    def __init__(self, model: Any, windows: list[list[int]]):
        self.windows = [list(w) for w in windows]
        self.logprobs = [_logprobs(model, w).cpu() for w in self.windows]
        self.result = self._score(self.logprobs)

    def _score(self, logprobs: list[torch.Tensor]) -> Comparison:
        nll = kl = 0.0
        agree = count = 0
        for w, ref, q in zip(self.windows, self.logprobs, logprobs):
            q = q.to(device="cpu", dtype=torch.float32)
            target = torch.tensor(w[1:], dtype=torch.long)
            nll -= float(q.gather(1, target[:, None]).sum())
            # Σ p·(log p − log q); float64 accumulation over the vocabulary keeps tiny KLs (high K) exact to ~1e-9
            kl += float((ref.exp().double() * (ref.double() - q.double())).sum())
            agree += int((ref.argmax(-1) == q.argmax(-1)).sum())
            count += len(w) - 1
        return Comparison(ppl=math.exp(nll / count), kl=kl / count, top1=agree / count, tokens=count)

    @torch.no_grad()
    def compare(self, model: Any) -> Comparison:
        """``model`` scored on the same windows against this reference."""
        return self._score([_logprobs(model, w) for w in self.windows])
