"""Make the EXL3 test checkpoints with exllamav3's own converter (run once, on a CUDA machine).

    PYTHONPATH=src:tests python tests/data/exllamav3/make_fixtures.py [--keep-work]

Needs ``exllamav3`` (1.6.5 was used) with its extension built. For each fixture it builds a tiny random
transformers model, converts it with ``python -m exllamav3.conversion.convert_model`` and a hand-written
per-tensor recipe (so the checkpoint mixes bitrates), then loads the result in exllamav3 and stores, next to
the checkpoint directory (not in it: vLLM would read any safetensors file there as weights),
``<name>.reference.safetensors``: a token row, exllamav3's logits for it, and a few
matrices as exllamav3's kernel decodes them from the trellis (``inner.<module>``, fp16 ``[in, out]``, before the
Hadamard rotations and scales: the bit-exact part). The tests hold our loader to those.

The fixtures cover the three codebooks, integer and half-integer rates, a quantized head from a tied
embedding, an unquantized head, MoE experts at mixed rates, and a sharded checkpoint with an index.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))          # tests/, for tiny_models

# name -> (source builder kwargs, converter arguments, recipe)
FIXTURES = {
    # tied embedding, quantized head (6 bits), mul1 with a half-integer rate and a low rate
    "llama_mul1": (
        {"kind": "llama", "tie": True},
        ["-cb", "mul1", "-hb", "6"],
        {"*": 4, "model.layers.0.mlp.*": 3.5, "model.layers.1.self_attn.*": 2},
    ),
    # untied, unquantized head, 3inst
    "llama_3inst": (
        {"kind": "llama", "tie": False},
        ["-cb", "3inst", "-hb", "16"],
        {"*": 3, "*.down_proj": 5},
    ),
    # MoE with experts at three rates (exllamav3 keeps one rate per projection across a layer's experts), mcg,
    # quantized head, two shards and an index
    "qwen3moe_mcg": (
        {"kind": "qwen3moe"},
        ["-cb", "mcg", "-hb", "4", "-ss", "1"],
        {"*": 3, "model.layers.1.mlp.experts.*": 4, "model.layers.0.mlp.experts.*.down_proj": 2,
         "*.self_attn.*": 4},
    ),
}
INIT_STD = 0.5       # peaked logits: greedy tokens agree across dtypes and engines
IDS = [1, 5, 9, 12, 7, 3, 20, 14, 8, 2, 11, 17, 6, 25, 4, 10]


def save_bpe_tokenizer(path: Path) -> None:
    """A byte-level BPE (the kind real models ship), trained on the tiny word list: exllamav3's tokenizer
    wrapper needs every string, a lone space included, to encode to something."""
    from tiny_models import calibration_text
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["[UNK]", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([calibration_text(3000, seed) for seed in range(4)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))


def build_source(path: Path, kind: str, tie: bool = True) -> None:
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=384, max_position_embeddings=512,
                          tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, initializer_range=INIT_STD)
        model = LlamaForCausalLM(cfg)
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=384,
                             max_position_embeddings=512,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=INIT_STD)
        model = Qwen3MoeForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    save_bpe_tokenizer(path)
    if kind != "llama":
        # published Qwen3-MoE configs name the expert count num_experts, which exllamav3 reads
        cfg_path = path / "config.json"
        data = json.loads(cfg_path.read_text())
        data.setdefault("num_experts", data.get("num_local_experts"))
        cfg_path.write_text(json.dumps(data, indent=2) + "\n")


def convert(src: Path, dst: Path, work: Path, args: list[str], recipe: dict) -> None:
    import yaml

    work.mkdir(parents=True, exist_ok=True)
    rpath = work.parent / f"{dst.name}_recipe.yaml"
    rpath.write_text(yaml.safe_dump({"target_bpw": 3.5, "tensors": recipe}, sort_keys=False))
    cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(src), "-o", str(dst),
           "-w", str(work), "--recipe", str(rpath), "-cr", "16", "-cc", "256", *args]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    if not (dst / "config.json").exists():
        raise SystemExit(f"the converter wrote no checkpoint to {dst}")


def _walk(module):
    yield module
    for sub in getattr(module, "modules", []) or []:
        yield from _walk(sub)


def reference(dst: Path) -> None:
    from exllamav3 import Config, Model
    from safetensors.torch import save_file

    model = Model.from_config(Config.from_directory(str(dst)))
    model.load("cuda:0")
    ids = torch.tensor([IDS])
    with torch.no_grad():
        logits = model.forward(ids, {}).float().cpu()
    out = {"ids": ids, "logits": logits.contiguous()}
    picked = 0
    for m in _walk(model):
        inner = getattr(m, "inner", None)
        if inner is None or not hasattr(inner, "get_weight_tensor") or type(inner).__name__ != "LinearEXL3":
            continue
        key = m.key
        if picked < 3 or key.endswith("lm_head") or ".experts.6." in key:
            out["inner." + key] = inner.get_inner_weight_tensor().cpu().contiguous()
            picked += 1
    model.unload()
    save_file(out, str(dst.parent / f"{dst.name}.reference.safetensors"))
    print(f"{dst.name}: logits {tuple(logits.shape)}, weights "
          f"{[k for k in out if k.startswith('inner.')]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--work", type=Path, default=Path("/tmp/exl3_fixture_work"))
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--reference-only", action="store_true",
                    help="keep the checkpoints under --out, only remake their <name>.reference.safetensors")
    args = ap.parse_args()
    import exllamav3

    print("exllamav3", exllamav3.__version__ if hasattr(exllamav3, "__version__") else "?", flush=True)
    for name, (src_kw, conv_args, recipe) in FIXTURES.items():
        if args.only and name not in args.only:
            continue
        src, dst = args.work / f"{name}_src", args.out / name
        if args.reference_only:
            reference(dst)
            continue
        for p in (src, dst, args.work / name):
            shutil.rmtree(p, ignore_errors=True)
        build_source(src, **src_kw)
        convert(src, dst, args.work / name, conv_args, recipe)
        reference(dst)
        meta = {"made_by": "exllamav3 convert_model", "converter_args": conv_args, "recipe": recipe,
                "source": {"kind": src_kw["kind"], "seed": 0, "init_std": INIT_STD, "dtype": "bfloat16"}}
        (dst / "fixture.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(sorted(p.name for p in dst.iterdir()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
