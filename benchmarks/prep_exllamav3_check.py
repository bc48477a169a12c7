"""Prepare the exllamav3 load check: tiny Llamas converted by ``exl3rt quantize`` plus reference logits.

Writes ``OUT/<case>/exl3`` (the EXL3 checkpoint) and ``OUT/<case>/ref.pt`` for each case, where
``ref.pt`` holds the token ids and the float32 logits of

- ``deq``: the checkpoint itself, dequantized by ``exl3rt.format`` (trimmed to the logical widths,
  the quantized head included) and run by transformers -- what exllamav3 should compute;
- ``orig``: the unquantized source model -- the scale of the quantization error, for context.

Then ``benchmarks/check_exllamav3_load.sh`` (on a CUDA machine) loads each checkpoint with
exllamav3 and compares. Usage (CPU, about a minute)::

    PYTHONPATH=src:tests python benchmarks/prep_exllamav3_check.py .ex3check
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

# cases: name -> (model kwargs, quantize args). Widths: "a" all multiples of 128; "b" the default
# tiny_llama (hidden 128, intermediate 200, vocab 64, head_dim 32, tied); "c" SmolLM2-like unaligned
# hidden (192 = 3 heads of 64, 1 kv head), intermediate 320, vocab 100, tied, mul1 at K = 3.5;
# "d" = b's source with 3inst K = 2 and the head left unquantized (tied embedding as the head).
CASES = {
    "a_aligned_mcg4": (dict(hidden=256, intermediate=512, vocab=256, tie=False, heads=4, kv_heads=2),
                       ["--bits", "4"]),
    "b_tiny_mcg4": (dict(hidden=128, intermediate=200, vocab=64, tie=True, heads=4, kv_heads=2),
                    ["--bits", "4"]),
    "c_smol_mul1_3.5": (dict(hidden=192, intermediate=320, vocab=100, tie=True, heads=3, kv_heads=1),
                        ["--bits", "3.5", "--codebook", "mul1"]),
    "d_tiny_3inst2_fp16head": (dict(hidden=128, intermediate=200, vocab=64, tie=True, heads=4, kv_heads=2),
                               ["--bits", "2", "--codebook", "3inst", "--head-bits", "16"]),
}
# More than 32 tokens: exllamav3 1.6.5 runs forwards of <= 32 rows through a fused K/V mgemm that
# fails when num_kv_heads * head_dim is not a multiple of 128 (cases b, c, d); the check script
# probes those short forwards separately, on the first positions of the same sequence.
SEQ = 40


def make_llama(path: Path, *, hidden, intermediate, vocab, tie, heads, kv_heads, layers=2, seed=0) -> Path:
    """A random Llama like tests/tiny_models.tiny_llama, with head counts as parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=256, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(path), safe_serialization=True)
    return path


def dequantized_hf(exl3_dir: Path, out: Path) -> Path:
    """The EXL3 checkpoint as a plain HF checkpoint: every linear reconstructed (fp32, trimmed to
    the widths in config.json), the other tensors as stored, config.json without quantization_config."""
    from safetensors.torch import save_file

    from exl3rt.format import Exl3Checkpoint

    cfg = json.loads((exl3_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nq
    logical = {"q_proj": (h, nq * hd), "k_proj": (h, nkv * hd), "v_proj": (h, nkv * hd), "o_proj": (nq * hd, h),
               "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "lm_head": (h, v)}
    ckpt = Exl3Checkpoint(exl3_dir)
    tensors = {n: ckpt.tensor(n).to(torch.float32) for n in ckpt.other_tensor_names()}
    for info in ckpt.linears():
        in_f, out_f = logical[info.name.rsplit(".", 1)[-1]]
        w = ckpt.load_linear(info.name).reconstruct(trim=False)[:in_f, :out_f]
        tensors[f"{info.name}.weight"] = w.T.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits[0].float()


def main(root: str) -> None:
    from exl3rt.cli.main import main as cli

    root = Path(root)
    for name, (mk, qargs) in CASES.items():
        case = root / name
        if case.exists():
            shutil.rmtree(case)
        src = make_llama(case / "src", **mk)
        exl3 = case / "exl3"
        assert cli(["quantize", str(src), str(exl3), *qargs, "--quiet"]) == 0, name
        ids = torch.randint(3, mk["vocab"], (1, SEQ), generator=torch.Generator().manual_seed(0))
        deq = dequantized_hf(exl3, case / "deq")
        ref = {"ids": ids, "deq": logits(deq, ids), "orig": logits(src, ids), "args": qargs, "model": mk}
        torch.save(ref, case / "ref.pt")
        shutil.rmtree(deq)
        shutil.rmtree(src)
        rel = float((ref["deq"] - ref["orig"]).norm() / ref["orig"].norm())
        print(f"{name}: {exl3} ({sum(f.stat().st_size for f in exl3.iterdir()) / 1e6:.2f} MB), "
              f"deq vs orig logits rel {rel:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".ex3check")
