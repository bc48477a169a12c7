"""Tiny random Hugging Face models written to disk for tests (no hub access needed)."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about rivers "
         "mountains and the old city near the sea").split()


def calibration_text(n_words: int = 1200, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(WORDS), (n_words,), generator=g)
    return " ".join(WORDS[int(i)] for i in idx)


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))


def tiny_llama(path: Path, *, hidden: int = 128, intermediate: int = 200, layers: int = 2, vocab: int = 64,
               tie: bool = True, seed: int = 0, init_std: float | None = None,
               dtype: torch.dtype | None = None) -> Path:
    """A random Llama (widths not all multiples of 128) saved as safetensors with a tokenizer.

    ``init_std`` (default: transformers' 0.02) larger gives peaked logits, so greedy decoding is not
    one repeated token; ``dtype`` saves the weights in that dtype (e.g. a BF16 checkpoint).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      max_position_embeddings=256, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                      **({} if init_std is None else {"initializer_range": init_std}))
    model = LlamaForCausalLM(cfg).eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    save_tokenizer(path)
    return path


def tiny_qwen_moe(path: Path, *, layers: int = 2, experts: int = 4, seed: int = 0, init_std: float | None = None,
                  dtype: torch.dtype | None = None, tokenizer: bool = False) -> Path:
    """A random Qwen3-MoE (4 experts, top-2) saved as safetensors (per-expert linears on disk).

    ``init_std``/``dtype`` as in :func:`tiny_llama`; ``tokenizer`` also saves the word-level tokenizer
    (vLLM needs one).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=experts, num_experts_per_tok=2, vocab_size=64, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         **({} if init_std is None else {"initializer_range": init_std}))
    model = Qwen3MoeForCausalLM(cfg).eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer:
        save_tokenizer(path)
    return path


def nonfinite_copy(src: Path, dst: Path, names, value: float = float("nan"), at: tuple[int, int] = (0, 0)) -> list[str]:
    """Copy the one-shard model directory ``src`` to ``dst`` with ``value`` (NaN, inf) at ``at`` in the weights that
    ``names(all weight names, sorted)`` picks; returns the picked names."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (st,) = Path(dst).glob("*.safetensors")
    tensors = load_file(str(st))
    picked = list(names(sorted(tensors)))
    for n in picked:
        tensors[n][at] = value
    save_file(tensors, str(st), metadata={"format": "pt"})
    return picked
