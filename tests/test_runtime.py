"""Online quantization of live models: Exl3Config, the module policy, Exl3Linear/Exl3Experts, quantize_model.

Truth is independent of the modules under test: Exl3Linear against ``EncodedLinear.reconstruct`` in
float64; quantized models against a fresh copy of the same model whose weights are replaced by the
reconstructions (transformers' own forward, fused MoE parameters written by hand). Tiny models share
one cache root per test session, so each weight is encoded at most once.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("numba")

import exl3rt  # noqa: E402
from exl3rt.format.random import random_linear  # noqa: E402
from exl3rt.runtime import Exl3Config, Exl3ConfigError, Exl3Experts, Exl3Linear, quantize_model  # noqa: E402
from exl3rt.runtime.policy import LinearTarget, select_targets  # noqa: E402

from tiny_models import tiny_llama, tiny_qwen_moe  # noqa: E402


# ---- shared helpers (also used by test_hf_integration.py) -------------------------------------------

def shared_path(tmp_path_factory, name: str):
    """A path under the session's base temp dir, shared by every test module of the session."""
    return tmp_path_factory.getbasetemp() / name


def llama_src(tmp_path_factory):
    path = shared_path(tmp_path_factory, "rt-llama")
    if not (path / "config.json").exists():
        tiny_llama(path, layers=1)  # hidden 128, intermediate 200 (padded to 256), tied head
    return path


def moe_src(tmp_path_factory):
    path = shared_path(tmp_path_factory, "rt-qwen-moe")
    if not (path / "config.json").exists():
        tiny_qwen_moe(path, layers=1, experts=2)
    return path


def load(path, dtype=torch.float32, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs).eval()


def token_ids(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 64, (2, n), generator=torch.Generator().manual_seed(seed))


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def dequantized_copy(src, quantized):
    """A fresh copy of the model at ``src`` whose quantized matrices are replaced by their reconstructions
    (``EncodedLinear.reconstruct`` in float64, written in HF layout; fused expert slices written by hand)."""
    fresh = load(src)
    with torch.no_grad():
        for name, mod in quantized.named_modules():
            if not isinstance(mod, Exl3Linear):
                continue
            w_hf = mod.encoded().reconstruct(dtype=torch.float64).T.float()  # [out, in]
            parts = name.split(".")
            if len(parts) >= 3 and parts[-3] == "experts" and parts[-2].isdigit():
                experts = fresh.get_submodule(".".join(parts[:-2]))
                e, proj = int(parts[-2]), parts[-1]
                inter = experts.down_proj.shape[-1]
                if proj == "down_proj":
                    experts.down_proj[e].copy_(w_hf)
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    experts.gate_up_proj[e, rows].copy_(w_hf)
            else:  # a new Parameter: writing into a tied head would change the embedding too
                fresh.get_submodule(name).weight = torch.nn.Parameter(w_hf, requires_grad=False)
    return fresh


def exl3_buffers(model) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in ("trellis", "suh", "svh")}


def forbid_encoding(monkeypatch):
    """Make any encode fail loudly (a warm cache must never call the encoder)."""
    import exl3rt.encode.quantize as q

    def boom(*args, **kwargs):
        raise AssertionError("quantize_weight was called although every layer should be a cache hit")

    monkeypatch.setattr(q, "quantize_weight", boom)


# ---- Exl3Linear ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(200, 72), (128, 256)])
def test_exl3linear_matches_reconstruct(shape):
    in_f, out_f = shape
    enc = random_linear(in_f, out_f, 4, seed=3)
    bias = torch.randn(out_f)
    m = Exl3Linear.from_encoded(enc, bias, name="t")
    w = enc.reconstruct(dtype=torch.float64)  # [in, out], trimmed
    assert w.shape == (in_f, out_f)
    x = torch.randn(2, 5, in_f, dtype=torch.float64)  # batched 3-D input
    ref = x @ w + bias.double()
    y32 = m(x.float())
    assert y32.dtype == torch.float32 and y32.shape == (2, 5, out_f)
    torch.testing.assert_close(y32.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    ybf = m(x.to(torch.bfloat16))
    assert ybf.dtype == torch.bfloat16
    err = float((ybf.double() - ref).norm() / ref.norm())
    assert err < 2e-2
    # the kernel hook's padding contract (CUDA path), exercised on CPU: pad x to in_p, trim y to out
    from exl3rt.kernels.ops import padded_linear
    y_pad = padded_linear(x.float(), m.trellis, m.suh, m.svh, m.codebook, out_f)
    torch.testing.assert_close(y_pad.double() + bias.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    assert "K=4" in repr(m) and "codebook=mcg" in repr(m) and f"in_features={in_f}" in repr(m)


def test_exl3linear_dequant_cache_and_dtype_moves():
    enc = random_linear(136, 130, 3, seed=5)
    x = torch.randn(4, 136)
    ref = x.double() @ enc.reconstruct(dtype=torch.float64)
    m = Exl3Linear.from_encoded(enc)
    y = m(x)
    assert m._w_cache is not None and m._w_cache.dtype == torch.float32  # CPU default: kept
    torch.testing.assert_close(m(x), y, rtol=0, atol=0)
    m.clear_dequant_cache()
    assert m._w_cache is None
    off = Exl3Linear.from_encoded(enc, dequant_cache=False)
    torch.testing.assert_close(off(x), y, rtol=0, atol=0)
    assert off._w_cache is None
    m(x)
    m.to(torch.bfloat16)  # a whole-model dtype cast must not round the fp16 scales
    assert m._w_cache is None and m.suh.dtype == torch.float16 and m.svh.dtype == torch.float16
    assert m.trellis.dtype == torch.int16
    ybf = m(x.to(torch.bfloat16))
    assert float((ybf.double() - ref).norm() / ref.norm()) < 2e-2
    with pytest.raises(ValueError, match="in_features=136"):
        m(torch.randn(2, 100))


def test_exl3linear_kept_weight_forward_with_bias_leading_dims_and_any_cache_form():
    enc = random_linear(136, 130, 3, seed=6)
    bias = torch.randn(130)
    m = Exl3Linear.from_encoded(enc, bias)
    x = torch.randn(2, 3, 136)
    ref = x.double() @ enc.reconstruct(dtype=torch.float64) + bias.double()
    tol = dict(rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    for _ in range(2):      # the first call decodes and keeps W, the next multiplies by the kept W
        y = m(x)
        assert y.shape == (2, 3, 130)
        torch.testing.assert_close(y.double(), ref, **tol)
    m.dequantized_weight(torch.float32, trim=False)     # the cache now holds the padded [in_p, out_p] form
    assert m._w_cache.shape == (m.in_padded, m.out_padded)
    torch.testing.assert_close(m(x).double(), ref, **tol)
    ybf = m(x.to(torch.bfloat16))                       # another dtype: not multiplied by the fp32 weight
    assert ybf.dtype == torch.bfloat16 and m._w_cache.dtype == torch.bfloat16
    assert float((ybf.double() - ref).norm() / ref.norm()) < 2e-2
    with pytest.raises(ValueError, match="in_features=136"):
        m(torch.randn(2, 135, dtype=torch.bfloat16))


def test_exl3linear_placeholder_shapes():
    m = Exl3Linear(200, 72, 3.5, "mul1", bias=True, device="meta")
    assert m.trellis.shape == (16, 8, 56) and m.suh.shape == (256,) and m.svh.shape == (128,)
    assert m.bias.shape == (72,) and m.bits == 3.5


# ---- config -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"bits": 9}, "Exl3Config.bits.*unsupported bitrate"),
    ({"bits": 3.5}, "half-integer K needs codebook='mul1'"),
    ({"bits_for": {"*.down_proj": 2.5}}, r"bits_for\['\*.down_proj'\].*mul1"),
    ({"codebook": "nf4"}, "unknown codebook"),
    ({"ignore": "*.q_proj"}, "must be a list"),
    ({"bits_for": ["*.q_proj=5"]}, "must be a dict"),
    ({"cache_mode": "fast"}, "Exl3Config.cache_mode='fast'"),
    ({"encode_device": "gpu7"}, "not a torch device"),
    ({"backend": "cuda"}, "Exl3Config.backend"),
    ({"seed": 1.5}, "Exl3Config.seed"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(Exl3ConfigError, match=match):
        Exl3Config(**kwargs)


def test_config_roundtrip_and_policy_helpers():
    cfg = Exl3Config(bits=3.5, codebook="mul1", bits_for={"*.mlp.*": 4, "*.down_proj": 5}, ignore=["*.q_proj"],
                     cache_mode="rw")
    assert cfg.cache_mode == "readwrite"
    assert Exl3Config.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["quant_method"] == "exl3rt"
    assert cfg.bits_for_module("model.layers.0.mlp.down_proj") == 5  # last match wins
    assert cfg.bits_for_module("model.layers.0.mlp.up_proj") == 4
    assert cfg.bits_for_module("model.layers.0.self_attn.o_proj") == 3.5
    assert cfg.bits_for_module("lm_head", head=True) == 6
    assert cfg.is_ignored("model.layers.3.self_attn.q_proj")
    with pytest.raises(Exl3ConfigError, match="unknown field"):
        Exl3Config.from_dict({"bitz": 4})


def test_import_is_light():
    code = ("import sys, exl3rt; c = exl3rt.Exl3Config(bits=3); exl3rt.quantize_model; exl3rt.Exl3Linear; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- policy --------------------------------------------------------------------------------------------

def test_policy_llama(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    src = llama_src(tmp_path_factory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(src)))
    names = {t.name: t.bits for t in select_targets(model, Exl3Config(bits=4))}
    assert len(names) == 7 and all(k == 4 for k in names.values())
    assert "lm_head" not in names and not any("embed" in n or "norm" in n for n in names)
    cfg = Exl3Config(bits=4, quantize_lm_head=True, ignore=["*.k_proj"], bits_for={"*.v_proj": 5})
    names = {t.name: t.bits for t in select_targets(model, cfg)}
    assert names["lm_head"] == 6 and names["model.layers.0.self_attn.v_proj"] == 5
    assert "model.layers.0.self_attn.k_proj" not in names


# ---- quantize_model: dense -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_q(tmp_path_factory):
    src = llama_src(tmp_path_factory)
    model = load(src)
    cfg = Exl3Config(bits=4, cache_dir=str(shared_path(tmp_path_factory, "rt-cache")))
    summary = quantize_model(model, cfg, progress=False)
    return src, model, cfg, summary


def test_quantize_model_llama(llama_q):
    src, model, cfg, summary = llama_q
    replaced = {n for n, m in model.named_modules() if isinstance(m, Exl3Linear)}
    assert replaced == {f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                      "mlp.down_proj")}
    assert isinstance(model.lm_head, torch.nn.Linear) and isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert type(model.model.norm).__name__.endswith("RMSNorm")
    assert summary["layers"] == 7 and summary["hits"] + summary["misses"] == 7
    assert summary["total_weights"] == sum(m.in_features * m.out_features for m in
                                           (model.get_submodule(n) for n in replaced))
    assert summary["avg_bits"] == 4.0 and 4.0 < summary["bpw"] < 6.0
    up = model.model.layers[0].mlp.up_proj
    assert (up.in_features, up.out_features, up.out_padded) == (128, 200, 256)
    assert not hasattr(up, "weight")

    ids = token_ids()
    got = logits(model, ids)
    ref = logits(dequantized_copy(src, model), ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

    # perplexity-ish sanity against the unquantized model at K=4
    dense = logits(load(src), ids)
    rel = float((got - dense).norm() / dense.norm())
    assert rel < 0.1
    def nll(lg):
        return float(torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1)))

    assert abs(nll(got) - nll(dense)) < 5e-3 * nll(dense)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), dense.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) / ids.shape[1] < 2e-3  # mean KL per token (nats)

    # bf16 activations through the same codes (a copy: casting back would leave bf16-rounded dense weights)
    got_bf = logits(copy.deepcopy(model).to(torch.bfloat16), ids)
    assert float((got_bf - ref).norm() / ref.norm()) < 3e-2


def test_quantize_model_second_run_all_hits(llama_q, monkeypatch):
    src, model, cfg, _ = llama_q
    forbid_encoding(monkeypatch)
    again = load(src)
    summary = quantize_model(again, cfg, progress=False)
    assert summary["hits"] == 7 and summary["misses"] == 0
    assert summary["cache"]["encodes"] == 0
    a, b = exl3_buffers(model), exl3_buffers(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = token_ids()
    torch.testing.assert_close(logits(again, ids), logits(model, ids), rtol=0, atol=0)


def test_quantize_model_overrides_and_ignore(llama_q):
    src, model, cfg, _ = llama_q
    m2 = load(src)
    cfg2 = Exl3Config(bits=4, cache_dir=cfg.cache_dir, ignore=["*.self_attn.*"],
                      bits_for={"*.mlp.*": 3, "*.up_proj": 4})
    summary = quantize_model(m2, cfg2, progress=False)
    mlp = m2.model.layers[0].mlp
    assert (mlp.gate_proj.bits, mlp.up_proj.bits, mlp.down_proj.bits) == (3, 4, 3)
    assert isinstance(m2.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert summary["layers"] == 3 and summary["hits"] >= 1  # up_proj at K=4 is shared with the first run
    # same name, K and seed -> the same codes as the K=4 run
    assert torch.equal(mlp.up_proj.trellis, model.model.layers[0].mlp.up_proj.trellis)
    ids = token_ids()
    torch.testing.assert_close(logits(m2, ids), logits(dequantized_copy(src, m2), ids), rtol=1e-4, atol=1e-4)


def test_quantize_model_tied_head(tmp_path_factory):
    src = llama_src(tmp_path_factory)
    model = load(src)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cfg = Exl3Config(bits=4, quantize_lm_head=True, ignore=["model.layers.*"],
                     cache_dir=str(shared_path(tmp_path_factory, "rt-cache")))
    summary = quantize_model(model, cfg, progress=False, layers=True)
    assert summary["names"] == ["lm_head"] and model.lm_head.bits == 6
    assert isinstance(model.model.embed_tokens.weight, torch.nn.Parameter)  # the embedding stays dense
    assert model.config.tie_word_embeddings is False
    ids = token_ids()
    torch.testing.assert_close(logits(model, ids), logits(dequantized_copy(src, model), ids), rtol=1e-4, atol=1e-4)


# ---- quantize_model: MoE (fused transformers 5.x experts) ---------------------------------------------------

MOE_CONFIG = dict(bits=4, ignore=["*.self_attn.*", "*.experts.0.up_proj"], bits_for={"*.experts.1.down_proj": 3})


def test_quantize_model_qwen_moe(tmp_path_factory):
    src = moe_src(tmp_path_factory)
    model = load(src)
    cfg = Exl3Config(**MOE_CONFIG, cache_dir=str(shared_path(tmp_path_factory, "rt-cache")))
    summary = quantize_model(model, cfg, progress=False)
    block = model.model.layers[0].mlp
    assert isinstance(block.experts, Exl3Experts)
    assert type(block.gate).__name__ == "Qwen3MoeTopKRouter"  # the router stays
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)  # ignored
    ex = block.experts
    assert isinstance(ex.projection(0, "up_proj"), torch.nn.Linear)  # one expert matrix kept dense
    assert ex.projection(0, "gate_proj").bits == 4 and ex.projection(1, "down_proj").bits == 3
    assert summary["layers"] == 5 and summary["modules"] == 1
    quantized = {n for n, m in model.named_modules() if isinstance(m, Exl3Linear)}
    assert "model.layers.0.mlp.experts.1.down_proj" in quantized and len(quantized) == 5
    ids = token_ids()
    got = logits(model, ids)
    torch.testing.assert_close(got, logits(dequantized_copy(src, model), ids), rtol=1e-4, atol=1e-4)
    dense = logits(load(src), ids)
    assert float((got - dense).norm() / dense.norm()) < 0.1


def test_quant_method_registers_nothing_and_names_the_import_before_registration(tmp_path):
    """Registration with transformers is the integration's import (or register()), never a side effect of reading
    Exl3Config.quant_method; read too early it names that import. A fresh interpreter: other tests register."""
    code = """
import sys, exl3rt
cfg = exl3rt.Exl3Config(bits=4)
assert cfg.quant_method == "exl3rt"                        # transformers not loaded: just the name
assert "transformers" not in sys.modules
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
try:
    cfg.quant_method
except exl3rt.Exl3ConfigError as e:
    assert "import exl3rt.integrations.transformers" in str(e), e
else:
    raise AssertionError("quant_method read before registration did not fail")
assert "exl3rt" not in AUTO_QUANTIZER_MAPPING and "exl3rt.integrations.transformers" not in sys.modules
src = sys.argv[1]                                         # what a user who forgot the import sees
AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=2, vocab_size=64)).save_pretrained(src)
try:
    AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg)
except exl3rt.Exl3ConfigError as e:
    assert "import exl3rt.integrations.transformers" in str(e), e
else:
    raise AssertionError("from_pretrained before registration did not fail")
import exl3rt.integrations.transformers as hf
assert AUTO_QUANTIZER_MAPPING["exl3rt"] is hf.Exl3HfQuantizer and cfg.quant_method == "exl3rt"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tiny")], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_linear_target_weights():
    t = LinearTarget("x", 4, 200, 72, False)
    assert t.num_weights == 14400
