"""``exl3rt example OUT``: write a small random EXL3 checkpoint (a Llama-shaped model) to try the tools on."""

from __future__ import annotations

import argparse
import itertools
import json
import string
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ..format.bits import Bits
from ..format.checkpoint_write import CheckpointWriter
from ..format.random import random_linear
from ._args import check_output_dir, int_between

HELP = "write a small random EXL3 checkpoint (Llama-shaped, mixed bitrates) for trying the tools"

#: module suffix -> (bits, codebook); a mix of bitrates and all three codebooks
LAYER_PLAN: dict[str, tuple[Bits, str]] = {
    "self_attn.q_proj": (4, "mcg"), "self_attn.k_proj": (4, "mcg"), "self_attn.v_proj": (5, "mcg"),
    "self_attn.o_proj": (4, "mcg"), "mlp.gate_proj": (3, "mul1"), "mlp.up_proj": (3, "mul1"),
    "mlp.down_proj": (2.5, "mul1"),
}
HEAD: tuple[Bits, str] = (6, "3inst")


def example_config(hidden: int = 256, intermediate: int = 688, layers: int = 2, vocab: int = 1024) -> dict[str, Any]:
    heads = hidden // 64
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads, "head_dim": 64, "vocab_size": vocab, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float16",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    }


#: the example tokenizer's special tokens, at the ids the example config names (bos 1, eos 2)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json")


def _pieces() -> Iterator[str]:
    """Printable ASCII characters, then lowercase letter pairs, triples, ...: as many tokens as any vocab needs."""
    yield from (chr(c) for c in range(32, 127))
    for n in itertools.count(2):
        yield from ("".join(t) for t in itertools.product(string.ascii_lowercase, repeat=n))


def example_tokenizer(vocab_size: int) -> Optional[dict[str, str]]:
    """The files (name -> text) of a character-level tokenizer whose vocabulary is exactly ids ``0..vocab_size-1``
    (the special tokens first, so every id the random model emits decodes to text), or None without the
    ``tokenizers`` package (the base install)."""
    try:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return None
    vocab: dict[str, int] = {}
    for piece in itertools.chain(SPECIAL_TOKENS, _pieces()):
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(piece, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")    # one token per character
    tk.decoder = decoders.Fuse()                                                # and joined without spaces
    tk.add_special_tokens(list(SPECIAL_TOKENS[: vocab_size]))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": SPECIAL_TOKENS[0],
              "bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "model_max_length": 2048,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tk.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def write_example_checkpoint(out: str | Path, *, seed: int = 0, overwrite: bool = False, tokenizer: bool = True,
                             **sizes: int) -> Path:
    """Write the example model; the intermediate width (688) is padded to 768 to show padding. ``tokenizer``: with
    a character-level tokenizer of the config's vocabulary (:func:`example_tokenizer`) where the ``tokenizers``
    package is installed, so that ``exl3rt generate --model OUT`` runs it."""
    cfg = example_config(**sizes)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}
    g = torch.Generator().manual_seed(seed)
    side = (example_tokenizer(v) if tokenizer else None) or {}
    with CheckpointWriter(out, overwrite=overwrite, writes=tuple(side)) as w:
        w.add_tensor("model.embed_tokens.weight", (0.02 * torch.randn(v, h, generator=g)).half())
        n = 0
        for layer in range(cfg["num_hidden_layers"]):
            prefix = f"model.layers.{layer}"
            w.add_tensor(f"{prefix}.input_layernorm.weight", torch.ones(h, dtype=torch.float16))
            w.add_tensor(f"{prefix}.post_attention_layernorm.weight", torch.ones(h, dtype=torch.float16))
            for suffix, (bits, cb) in LAYER_PLAN.items():
                name = f"{prefix}.{suffix}"
                w.add_linear(name, random_linear(*shapes[suffix], bits, cb, seed=seed * 1000 + n, name=name))
                n += 1
        w.add_tensor("model.norm.weight", torch.ones(h, dtype=torch.float16))
        w.add_linear("lm_head", random_linear(h, v, HEAD[0], HEAD[1], seed=seed * 1000 + n, name="lm_head"))
        for name, text in side.items():
            w.add_text(name, text)
        return w.finish(cfg)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("example", help=HELP, description=HELP + ".\n\n"
                       "The codes are random (any bit pattern is a valid trellis), so the model talks nonsense,\n"
                       "but every tensor has the exact EXL3 layout: inspect it, load it, benchmark with it.\n"
                       "Where the tokenizers package is installed (exl3rt[hf]), a character-level tokenizer of\n"
                       "its vocabulary goes beside it, so `exl3rt generate --model OUT` runs it.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory (created; must be new or empty unless --overwrite)")
    p.add_argument("--seed", type=int_between(0, 2**32 - 1), default=0, help="random seed (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an EXL3 checkpoint in OUT (files exl3rt did not write are kept)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_output_dir(args.out)
    out = write_example_checkpoint(args.out, seed=args.seed, overwrite=args.overwrite)
    if (out / TOKENIZER_NAMES[0]).is_file():
        what = f"with a character-level tokenizer; next: exl3rt inspect {out}, exl3rt generate --model {out}"
    else:
        what = f"no tokenizer: the tokenizers package is not installed; next: exl3rt inspect {out}"
    print(f"wrote example EXL3 checkpoint to {out}  ({what})")
    return 0
