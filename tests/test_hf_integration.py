"""transformers integration: from_pretrained(path, quantization_config=Exl3Config(...)) encodes while loading.

Checked against quantize_model on the same weights (same names and seeds -> bit-identical codes, even
when both encode independently), against reconstructed-weight references, with a warm cache that must
never call the encoder, and for streaming (no two dense quantized weights materialized at once).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("numba")

import exl3rt  # noqa: E402
from exl3rt.runtime import Exl3Experts, Exl3Linear, quantize_model  # noqa: E402

from test_runtime import (  # noqa: E402
    MOE_CONFIG, dequantized_copy, exl3_buffers, forbid_encoding, llama_src, load, logits, moe_src, shared_path,
    token_ids,
)

hf = pytest.importorskip("exl3rt.integrations.transformers")

MLP_ONLY = ["*.self_attn.*"]  # fewer encodes: attention stays dense in the from-scratch comparisons


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(shared_path(tmp_path_factory, "rt-cache"))


def test_from_pretrained_equals_quantize_model_independent_encodes(tmp_path_factory, tmp_path):
    """Both paths encode from scratch (separate caches): same seeds -> bit-identical trellis and scales."""
    src = llama_src(tmp_path_factory)
    a = load(src)
    quantize_model(a, exl3rt.Exl3Config(bits=4, ignore=MLP_ONLY, cache_dir=str(tmp_path / "c1")), progress=False)
    cfg = hf.Exl3Config(bits=4, ignore=MLP_ONLY, cache_dir=str(tmp_path / "c2"))
    b = load(src, quantization_config=cfg)
    s = b.hf_quantizer.summary()
    assert s["misses"] == 3 and s["hits"] == 0 and s["layers"] == 3
    ba, bb = exl3_buffers(a), exl3_buffers(b)
    assert set(ba) == set(bb) and len(ba) == 9
    for k in ba:
        assert torch.equal(ba[k], bb[k]), k
    assert isinstance(b.model.layers[0].mlp.down_proj, Exl3Linear)
    assert isinstance(b.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert not hasattr(b.model.layers[0].mlp.down_proj, "weight")  # the dense placeholder is gone
    ids = token_ids()
    torch.testing.assert_close(logits(b, ids), logits(a, ids), rtol=0, atol=0)


def test_from_pretrained_warm_cache_never_encodes(tmp_path_factory, cache_dir, monkeypatch):
    src = llama_src(tmp_path_factory)
    ref = load(src)
    quantize_model(ref, exl3rt.Exl3Config(bits=4, cache_dir=cache_dir), progress=False)  # hits or fills the cache
    forbid_encoding(monkeypatch)
    # the plain runtime config works too (this module's import of the integration registered the quantizer)
    model = load(src, quantization_config=exl3rt.Exl3Config(bits=4, cache_dir=cache_dir))
    s = model.hf_quantizer.summary()
    assert s["hits"] == 7 and s["misses"] == 0 and s["cache"]["encodes"] == 0
    assert isinstance(model.config.quantization_config, hf.Exl3Config)
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    ids = token_ids()
    got = logits(model, ids)
    torch.testing.assert_close(got, logits(ref, ids), rtol=0, atol=0)
    torch.testing.assert_close(got, logits(dequantized_copy(src, model), ids), rtol=1e-4, atol=1e-4)


def test_from_pretrained_streams_one_weight_at_a_time(tmp_path_factory, cache_dir, monkeypatch):
    """When a weight is converted, no other selected dense weight is materialized in the model."""
    src = llama_src(tmp_path_factory)
    seen = []
    original = hf.Exl3Quantize.convert

    def spy(self, input_dict, *args, model=None, **kwargs):
        dense = [k for k in self.hf_quantizer._pending
                 if model.get_parameter(k).device.type != "meta" and model.get_parameter(k).numel() > 0]
        seen.append((sorted(input_dict), dense))
        return original(self, input_dict, *args, model=model, **kwargs)

    monkeypatch.setattr(hf.Exl3Quantize, "convert", spy)
    load(src, quantization_config=hf.Exl3Config(bits=4, cache_dir=cache_dir))
    assert len(seen) == 7
    assert all(dense == [] for _, dense in seen)


def test_from_pretrained_tied_head(tmp_path_factory, cache_dir):
    src = llama_src(tmp_path_factory)
    model = load(src, quantization_config=hf.Exl3Config(bits=4, quantize_lm_head=True, ignore=["model.layers.*"],
                                                         cache_dir=cache_dir))
    assert isinstance(model.lm_head, Exl3Linear) and model.lm_head.bits == 6
    assert model.config.tie_word_embeddings is False and "lm_head.weight" not in model.all_tied_weights_keys
    ids = token_ids()
    torch.testing.assert_close(logits(model, ids), logits(dequantized_copy(src, model), ids), rtol=1e-4, atol=1e-4)


def test_from_pretrained_qwen_moe(tmp_path_factory, cache_dir):
    src = moe_src(tmp_path_factory)
    ref = load(src)
    quantize_model(ref, exl3rt.Exl3Config(**MOE_CONFIG, cache_dir=cache_dir), progress=False)
    model = load(src, quantization_config=hf.Exl3Config(**MOE_CONFIG, cache_dir=cache_dir))
    s = model.hf_quantizer.summary()
    assert s["hits"] == 5 and s["misses"] == 0
    ex = model.model.layers[0].mlp.experts
    assert isinstance(ex, Exl3Experts) and not hasattr(ex, "gate_up_proj") and not hasattr(ex, "down_proj")
    assert isinstance(ex.projection(0, "up_proj"), torch.nn.Linear)
    dense_kept = ref.model.layers[0].mlp.experts.projection(0, "up_proj").weight
    torch.testing.assert_close(ex.projection(0, "up_proj").weight, dense_kept, rtol=0, atol=0)
    assert type(model.model.layers[0].mlp.gate).__name__ == "Qwen3MoeTopKRouter"
    ba, bb = exl3_buffers(ref), exl3_buffers(model)
    assert set(ba) == set(bb) and all(torch.equal(ba[k], bb[k]) for k in ba)
    ids = token_ids()
    got = logits(model, ids)
    torch.testing.assert_close(got, logits(ref, ids), rtol=0, atol=0)
    torch.testing.assert_close(got, logits(dequantized_copy(src, model), ids), rtol=1e-4, atol=1e-4)


def test_transformers_generic_save_is_refused_and_points_at_ours(tmp_path_factory, cache_dir, tmp_path, caplog):
    """The model's own save_pretrained writes EXL3 (tests/test_export.py); transformers' generic one, called on
    the class, would write the online config with our buffers, so it stays refused, naming the way out."""
    from transformers import PreTrainedModel

    src = llama_src(tmp_path_factory)
    model = load(src, quantization_config=hf.Exl3Config(bits=4, cache_dir=cache_dir))
    with pytest.raises(ValueError, match="not serializable"):
        PreTrainedModel.save_pretrained(model, str(tmp_path / "out"))
    assert "save_exl3" in caplog.text
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_config_errors_and_registration():
    with pytest.raises(ValueError, match="Exl3Config.bits"):
        hf.Exl3Config(bits=9)
    with pytest.raises(ValueError, match="unknown argument"):
        hf.Exl3Config(bitz=4)
    cfg = hf.Exl3Config(bits=3, bits_for={"*.down_proj": 4})
    again = hf.Exl3Config.from_dict(cfg.to_dict())
    assert again.to_runtime() == cfg.to_runtime() == exl3rt.Exl3Config(bits=3, bits_for={"*.down_proj": 4})
    hf.register()  # idempotent
    hf.register()
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZER_MAPPING["exl3rt"] is hf.Exl3HfQuantizer
    with pytest.raises(ValueError, match="disk"):
        hf.Exl3HfQuantizer(cfg, pre_quantized=False).validate_environment(device_map={"": "disk"})


def test_refused_weight_fails_the_load_fast_and_names_it(tmp_path_factory, tmp_path, monkeypatch, caplog):
    """A NaN in the checkpoint: the encoder's refusal (naming the tensor) fails ``from_pretrained`` — logged as it
    happens, and inside ``refusals_raised`` raised itself instead of transformers' generic ``RuntimeError`` — and
    after it no other weight is encoded (transformers loads on to write its report; the quantizer passes the rest
    over): with NaN in every selected weight, exactly one encode is attempted."""
    import logging

    from exl3rt.encode.errors import EncodeError
    from tiny_models import nonfinite_copy

    src = tmp_path / "nan"
    assert len(nonfinite_copy(llama_src(tmp_path_factory), src,
                              lambda names: [n for n in names if n.endswith("_proj.weight")])) == 7
    calls = []
    original = hf.Exl3HfQuantizer._quantize_target

    def spy(self, key, value, target):
        calls.append(key)
        return original(self, key, value, target)

    monkeypatch.setattr(hf.Exl3HfQuantizer, "_quantize_target", spy)
    cfg = hf.Exl3Config(bits=4, cache_dir=str(tmp_path / "c"), progress=False)
    with caplog.at_level(logging.ERROR, logger="exl3rt"):
        with pytest.raises(RuntimeError) as plain:
            load(src, quantization_config=cfg)
    assert not isinstance(plain.value, EncodeError) and len(calls) == 1
    layer = calls[0].rsplit(".", 1)[0]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("exl3rt")] == [
        f"exl3rt: {layer}: 1 non-finite value(s) (NaN/inf) in the weight; the source checkpoint is corrupt or was "
        f"saved after a diverged update (the load fails; the remaining weights are passed over)"]
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="exl3rt"):
        with pytest.raises(EncodeError, match=f"^{layer}: 1 non-finite"):
            with hf.refusals_raised():
                load(src, quantization_config=cfg)
    assert not [r for r in caplog.records if r.name.startswith("exl3rt")]   # said by the exception, not logged
    assert len(calls) == 2                                                    # again one encode only
    with pytest.raises(OSError):                                              # other errors pass unchanged
        with hf.refusals_raised():
            load(tmp_path / "missing", quantization_config=cfg)
