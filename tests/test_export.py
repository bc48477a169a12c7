"""save_exl3: a model quantized online, written as an EXL3 checkpoint, read back by the format layer.

Truth: the module's own tensors (bit for bit) and a dense model rebuilt from the checkpoint by
`format.reconstruct` (float64), whose logits must equal the quantized model's."""

from __future__ import annotations

import json

import pytest
import torch

import exl3rt
from exl3rt.format import Exl3Checkpoint
from exl3rt.format.errors import FormatError
from exl3rt.runtime.export import save_exl3
from exl3rt.runtime.linear import Exl3Linear
from float64_reference import rel_logits_error


def _quantized(src, cache, bits=3, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    exl3rt.quantize_model(model, exl3rt.Exl3Config(bits=bits, cache_dir=str(cache), progress=False, **kw),
                          progress=False)
    return model


def _assert_logits_match_the_float64_checkpoint(model, path):
    assert rel_logits_error(model, path, torch.tensor([[1, 5, 9, 12, 3, 7, 30, 41]])) < 1e-5


def test_a_dense_model_round_trips_bit_for_bit_and_computes_the_same_logits(tmp_path):
    from tiny_models import tiny_llama

    src = tiny_llama(tmp_path / "src", layers=2, init_std=0.5)     # tied embedding and head
    model = _quantized(src, tmp_path / "c")
    out = save_exl3(model, tmp_path / "exl3", progress=False)

    ckpt = Exl3Checkpoint(out)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, Exl3Linear)}
    assert sorted(i.name for i in ckpt.linears()) == sorted(mods) and len(mods) == 14
    for name, m in mods.items():
        enc = ckpt.load_linear(name)
        assert torch.equal(enc.trellis, m.trellis) and torch.equal(enc.suh, m.suh) and torch.equal(enc.svh, m.svh)
        assert enc.codebook == m.codebook == "mcg"
    # the tied head is the embedding, stored once
    others = ckpt.other_tensor_names()
    assert "model.embed_tokens.weight" in others and "lm_head.weight" not in others
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "exl3" and cfg["quantization_config"]["bits"] == 3
    assert cfg["quantization_config"]["head_bits"] == 16 and cfg["tie_word_embeddings"] is True

    _assert_logits_match_the_float64_checkpoint(model, out)


def test_moe_experts_are_written_per_expert_as_exllamav3_lays_them_out(tmp_path):
    from tiny_models import tiny_qwen_moe

    src = tiny_qwen_moe(tmp_path / "src", layers=1, experts=4, init_std=0.5)
    model = _quantized(src, tmp_path / "c", bits=4, moe_runtime=False)
    out = save_exl3(model, tmp_path / "exl3", progress=False)
    ckpt = Exl3Checkpoint(out)
    names = {i.name for i in ckpt.linears()}
    assert {f"model.layers.0.mlp.experts.{e}.{p}" for e in range(4)
            for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert "model.layers.0.mlp.gate.weight" in ckpt.other_tensor_names()
    # every expert's codes are the module's, bit for bit
    experts = model.get_submodule("model.layers.0.mlp.experts")
    for e in range(4):
        m = experts.projection(e, "down_proj")
        enc = ckpt.load_linear(f"model.layers.0.mlp.experts.{e}.down_proj")
        assert torch.equal(enc.trellis, m.trellis) and torch.equal(enc.svh, m.svh)


def test_a_model_with_nothing_quantized_is_refused_and_nothing_is_written(tmp_path):
    from transformers import AutoModelForCausalLM

    from tiny_models import tiny_llama

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama(tmp_path / "src", layers=1)))
    with pytest.raises(FormatError, match="no EXL3 linear"):
        save_exl3(model, tmp_path / "exl3", progress=False)
    assert not (tmp_path / "exl3").exists() or not any((tmp_path / "exl3").iterdir())


def test_a_tensor_left_on_meta_is_named_and_no_checkpoint_is_left(tmp_path):
    from tiny_models import tiny_llama

    model = _quantized(tiny_llama(tmp_path / "src", layers=1), tmp_path / "c")
    model.model.norm.weight = torch.nn.Parameter(torch.empty(model.model.norm.weight.shape, device="meta"))
    with pytest.raises(FormatError, match=r"model\.norm\.weight: on the meta device"):
        save_exl3(model, tmp_path / "exl3", progress=False)
    assert not (tmp_path / "exl3").exists() or not any((tmp_path / "exl3").iterdir())


def test_save_pretrained_of_a_model_loaded_by_from_pretrained_writes_the_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from exl3rt.integrations.transformers import Exl3Config
    from tiny_models import tiny_llama

    src = tiny_llama(tmp_path / "src", layers=1, init_std=0.5)
    model = AutoModelForCausalLM.from_pretrained(
        str(src), dtype=torch.float32, quantization_config=Exl3Config(bits=2, cache_dir=str(tmp_path / "c")))
    model.save_pretrained(str(tmp_path / "out"), max_shard_size="10KB")
    out = tmp_path / "out"
    ckpt = Exl3Checkpoint(out)
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "generation_config.json").is_file()
    for name, m in model.named_modules():
        if isinstance(m, Exl3Linear):
            enc = ckpt.load_linear(name)
            assert torch.equal(enc.trellis, m.trellis) and torch.equal(enc.suh, m.suh), name
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 2
    with pytest.raises(ValueError, match="push_to_hub"):
        model.save_pretrained(str(tmp_path / "hub"), push_to_hub=True)


# ---- loading EXL3 checkpoints with from_pretrained (quant_method "exl3") -------------------------------------
def _load_exl3(path, **kw):
    import exl3rt.integrations.transformers  # noqa: F401  (registers quant_method "exl3")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()


@pytest.mark.parametrize("bits,codebook,layers", [("3", "mcg", 2), ("3.5", "mul1", 1), ("2", "3inst", 1)])
def test_a_checkpoint_from_exl3rt_quantize_loads_and_matches_the_float64_reference(tmp_path, bits, codebook, layers,
                                                                                   caplog):
    from exl3rt.cli.main import main
    from tiny_models import tiny_llama

    src = tiny_llama(tmp_path / "src", layers=layers, init_std=0.5, tie=False)
    out = tmp_path / "exl3"
    assert main(["quantize", str(src), str(out), "--bits", bits, "--codebook", codebook, "--head-bits", "6",
                 "--quiet"]) == 0
    model = _load_exl3(out)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, Exl3Linear)}
    assert len(mods) == 7 * layers + 1 and "lm_head" in mods       # the quantized head too
    assert {m.codebook for m in mods.values()} == {codebook}
    assert "UNEXPECTED" not in caplog.text and "MISSING" not in caplog.text
    ckpt = Exl3Checkpoint(out)
    for name, m in mods.items():
        assert torch.equal(m.trellis, ckpt.load_linear(name).trellis), name
    _assert_logits_match_the_float64_checkpoint(model, out)


def test_a_checkpoint_with_biases_loads_them_trimmed_in_the_model_dtype(tmp_path):
    """Qwen2's q/k/v carry biases: stored fp16 at the padded width, they come back [out_features] in the
    model's dtype, and the logits match the float64 reference (which adds the stored biases)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from exl3rt.cli.main import main

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, intermediate_size=200, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, initializer_range=0.5,
                      tie_word_embeddings=True)
    src = tmp_path / "src"
    Qwen2ForCausalLM(cfg).eval().save_pretrained(str(src))
    out = tmp_path / "exl3"
    assert main(["quantize", str(src), str(out), "--bits", "4", "--head-bits", "16", "--quiet"]) == 0
    model = _load_exl3(out)
    k = model.get_submodule("model.layers.0.self_attn.k_proj")
    assert isinstance(k, Exl3Linear) and k.bias.shape == (64,) and k.bias.dtype == torch.float32
    q = model.get_submodule("model.layers.0.self_attn.q_proj")     # out 128: padded width = logical width
    assert q.bias.shape == (128,) and q.bias.dtype == torch.float32
    _assert_logits_match_the_float64_checkpoint(model, out)


def test_online_then_save_pretrained_then_from_pretrained_gives_identical_logits(tmp_path):
    from tiny_models import tiny_llama

    src = tiny_llama(tmp_path / "src", layers=2, init_std=0.5)
    model = _quantized(src, tmp_path / "c", bits=4)
    save_exl3(model, tmp_path / "exl3", progress=False)
    again = _load_exl3(tmp_path / "exl3")
    ids = torch.tensor([[1, 5, 9, 12, 3, 7, 30, 41]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_a_moe_checkpoint_loads_per_expert_into_the_experts_module(tmp_path):
    from exl3rt.runtime.experts import Exl3Experts
    from tiny_models import tiny_qwen_moe

    src = tiny_qwen_moe(tmp_path / "src", layers=1, experts=4, init_std=0.5)
    model = _quantized(src, tmp_path / "c", bits=4, expert_bits={"model.layers.0.mlp.experts": {0: 3}})
    save_exl3(model, tmp_path / "exl3", progress=False)
    again = _load_exl3(tmp_path / "exl3")
    ex = again.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(ex, Exl3Experts) and ex.projection(0, "up_proj").bits == 3
    assert ex.projection(1, "up_proj").bits == 4
    ids = torch.tensor([[1, 5, 9, 12, 3, 7, 30, 41]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_whose_trellis_disagrees_with_the_config_names_the_tensor(tmp_path):
    from tiny_models import tiny_llama

    model = _quantized(tiny_llama(tmp_path / "src", layers=1), tmp_path / "c")
    out = save_exl3(model, tmp_path / "exl3", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    cfg["intermediate_size"] = 400       # the MLP's codes are for 200 (padded 256)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"mlp\.(gate|up|down)_proj\.trellis: codes for a"):
        _load_exl3(out)


def test_a_moe_checkpoint_with_a_shared_expert_loads_it_as_plain_linears(tmp_path):
    """Qwen2-MoE: routed experts per expert into Exl3Experts, the shared expert's gate/up/down as Exl3Linear (they
    are ordinary linears of the model), the shared-expert gate (one output) as stored; the logits match the
    float64 model rebuilt from the checkpoint."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from exl3rt.cli.main import main
    from exl3rt.runtime.experts import Exl3Experts

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                         shared_expert_intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=64,
                         max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.5)
    src = tmp_path / "src"
    Qwen2MoeForCausalLM(cfg).eval().save_pretrained(str(src), safe_serialization=True)
    out = tmp_path / "exl3"
    assert main(["quantize", str(src), str(out), "--bits", "3", "--head-bits", "16", "--quiet"]) == 0
    model = _load_exl3(out)
    mlp = model.get_submodule("model.layers.0.mlp")
    assert isinstance(mlp.experts, Exl3Experts)
    assert all(isinstance(getattr(mlp.shared_expert, p), Exl3Linear) for p in ("gate_proj", "up_proj", "down_proj"))
    stored = {info.name for info in Exl3Checkpoint(out).linears()}
    assert isinstance(mlp.shared_expert_gate, Exl3Linear) == ("model.layers.0.mlp.shared_expert_gate" in stored)
    assert rel_logits_error(model, out, torch.tensor([[1, 5, 9, 12, 3, 7, 30, 41]])) < 1e-5
