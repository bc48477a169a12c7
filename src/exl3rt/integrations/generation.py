"""Greedy generation with transformers, timed, in the fast mode on a GPU.

``generate_timed`` runs ``model.generate`` and reports the prompt's prefill and the decode rate apart. The fast
mode is what makes a decode step cheap on a GPU: a static KV cache, so that every step has the same shapes and
transformers compiles the step (``torch.compile`` with CUDA graphs; the EXL3 layers are opaque custom ops in it).
It is compiled once per process by a short warm-up generation of the same lengths, timed on its own, so the
reported rates are those of the model and not of the compiler. The eager mode is ``generate`` as it is.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch

from ..util.progress import Progress

#: new tokens of the warm-up generation: compile (1), cudagraph trees' warm-up run (2), recording (3), a replay
WARMUP_TOKENS = 4


@dataclasses.dataclass
class GenerationTiming:
    """What one timed generation did: ``mode`` ("fast" or "eager"), token counts, seconds of preparing the
    EXL3 layers (:func:`prepare_model`), of the warm-up (compiling the decode step; 0 in eager mode), of the
    prefill (the prompt's forward and the first new token) and of the decode (the other new tokens)."""

    mode: str
    prompt_tokens: int
    new_tokens: int
    prepare_s: float
    warmup_s: float
    prefill_s: float
    decode_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = self.new_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class _Clock:
    """A ``generate`` streamer that notes when each step's tokens reach the host (``generate`` puts the prompt
    first, then each new token, copied to the host: the copy waited for the GPU)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _stop_after(prompt: int, n: int) -> Any:
    """A stopping criterion: stop once ``n`` new tokens follow a prompt of ``prompt`` tokens."""
    from transformers import StoppingCriteria

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            done = input_ids.shape[-1] >= prompt + n
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return StopAfter()


#: weights to decode on the CPU from which :func:`prepare_model` shows a progress bar (a 135 M model's ~100 M take
#: from seconds to minutes on a small CPU; a few tiny layers take no noticeable time)
PREPARE_PROGRESS_WEIGHTS = 16 * 2**20


def prepare_model(model: torch.nn.Module, dtype: torch.dtype, *, fuse: bool = True, progress: bool = True,
                  progress_min_weights: int = PREPARE_PROGRESS_WEIGHTS) -> int:
    """Every EXL3 linear made ready for ``dtype`` before the first forward, outside any traced code: on CUDA
    q/k/v and gate/up fused, and gated MLPs run as one call (``fuse``; :func:`exl3rt.runtime.fusion.fuse_linears`),
    and the kernels compiled,
    elsewhere the kept dense weight decoded (what a first forward would do); returns the kernel launches this
    took. ``progress``: a progress bar on stderr while the CPU decodes, when at least ``progress_min_weights``
    weights are to be decoded."""
    from ..runtime.fusion import fuse_linears, gated_shapes
    from ..runtime.linear import Exl3Linear

    if fuse:
        fuse_linears(model)
    done: set = set()
    linears = [m for m in model.modules() if isinstance(m, Exl3Linear)]
    decoding = {id(m): m.in_features * m.out_features for m in linears if m.prepare_decodes(dtype)}
    total = sum(decoding.values())
    n = 0
    with Progress(total, "exl3rt: preparing layers (decoding weights)", unit="w",
                  enabled=progress and total >= max(progress_min_weights, 1)) as bar:
        for m in linears:
            n += m.prepare(dtype, done)
            if id(m) in decoding:
                bar.update(decoding[id(m)], note=m.name)
    for shape, device in gated_shapes(model):       # the fused MLPs' middle pass
        if device.type == "cuda":
            from ..kernels.linear import prewarm_gated
            n += prewarm_gated([shape], device=device, dtype=dtype)
    return n


def generate_timed(model: Any, ids: torch.Tensor, max_new_tokens: int, *, fast: bool, pad_token_id: Optional[int],
                   on_warmup: Optional[Callable[[], None]] = None,
                   progress: bool = True) -> tuple[torch.Tensor, GenerationTiming]:
    """Greedy ``model.generate(ids)`` of ``max_new_tokens`` (batch of one); returns the output ids and the
    timing. The EXL3 layers are prepared first (:func:`prepare_model`, with its progress bar if ``progress``), so
    that the prefill's time is the model's. ``fast``: a static KV cache, the decode step compiled by transformers
    where it compiles (a CUDA device), after a warm-up generation of the same lengths (``on_warmup`` is called
    before it, e.g. to say so); the tokens are those of the eager mode up to the kernels' rounding."""
    from transformers import StoppingCriteriaList

    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"generate_timed: one sequence of token ids [1, n] expected, got shape {tuple(ids.shape)}")
    n_prompt = int(ids.shape[1])
    kwargs: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=pad_token_id)
    warmup = 0.0
    t0 = time.perf_counter()
    prepare_model(model, next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32),
                  progress=progress)
    _sync(ids.device)
    prepare = time.perf_counter() - t0
    with torch.no_grad():
        if fast:
            kwargs["cache_implementation"] = "static"
            if on_warmup is not None:
                on_warmup()
            t0 = time.perf_counter()
            # the same lengths as the real run: transformers keeps the static cache and the compiled step
            stop = StoppingCriteriaList([_stop_after(n_prompt, min(WARMUP_TOKENS, max_new_tokens))])
            model.generate(ids, stopping_criteria=stop, **kwargs)
            _sync(ids.device)
            warmup = time.perf_counter() - t0
        clock = _Clock()
        t0 = time.perf_counter()        # the GPU is idle: prepare and the warm-up ended with a sync
        out = model.generate(ids, streamer=clock, **kwargs)
        _sync(ids.device)
        end = time.perf_counter()
    new = int(out.shape[1]) - n_prompt
    # clock.times: [prompt put, first new token, ..., last new token]
    first = clock.times[1] if len(clock.times) > 1 else end
    last = clock.times[-1] if len(clock.times) > 1 else end
    timing = GenerationTiming("fast" if fast else "eager", n_prompt, new, prepare, warmup, first - t0, last - first)
    return out, timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["GenerationTiming", "PREPARE_PROGRESS_WEIGHTS", "WARMUP_TOKENS", "generate_timed", "prepare_model"]
