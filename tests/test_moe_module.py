"""Exl3MoE: per-expert bitrates (explicit map, TopRouted rule) and the planned MoE runtime in transformers models.

Truth is independent of the modules under test: logits of a fresh copy of the model whose expert weights
are their ``EncodedLinear.reconstruct`` (transformers' own router and expert loop), a direct dense
per-token sum over reconstructed experts, a brute-force softmax/top-k count of the router on the
hidden states it receives, and the cache's own key for each (weight, K).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("numba")

from exl3rt.cache.key import module_seed  # noqa: E402
from exl3rt.moe import MoELayerRuntime, prewarm  # noqa: E402
from exl3rt.runtime import Exl3Config, Exl3ConfigError, Exl3Experts, PolicyError, quantize_model  # noqa: E402
from exl3rt.runtime.moe_module import Exl3MoE, install_moe_runtimes, moe_paths  # noqa: E402
from exl3rt.runtime.policy import select_targets  # noqa: E402
from exl3rt.runtime.router_stats import RouterStatsError, TopRouted, calibration_ids, collect_router_stats  # noqa: E402

from test_runtime import dequantized_copy, load, logits, shared_path, token_ids  # noqa: E402
from tiny_models import save_tokenizer, tiny_qwen_moe  # noqa: E402

E, LAYERS = 4, 2
EXPERTS = "model.layers.*.mlp.experts"
ATTN = ["*.self_attn.*"]  # attention stays dense: fewer encodes, the experts are what is tested


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = shared_path(tmp_path_factory, "mm-qwen-moe")
    if not (path / "config.json").exists():
        tiny_qwen_moe(path, layers=LAYERS, experts=E)
        save_tokenizer(path)  # the bundled-text calibration finds it beside the model
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(shared_path(tmp_path_factory, "rt-cache"))


def config(cache_dir, **kwargs) -> Exl3Config:
    kwargs.setdefault("ignore", ATTN)
    return Exl3Config(bits=3, cache_dir=cache_dir, progress=False, **kwargs)


def experts_of(model, layer: int):
    return model.model.layers[layer].mlp.experts


def brute_force_counts(src, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Route ``ids`` through a fresh dense model; recount each router's top-k from the hidden states it sees."""
    model = load(src)
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def grab(_m, args, i=i):
            seen[f"model.layers.{i}.mlp.experts"] = args[0].detach().reshape(-1, args[0].shape[-1])

        hooks.append(gate.register_forward_pre_hook(grab))
    with torch.no_grad():
        model(input_ids=ids[None])
    out = {}
    for i, layer in enumerate(model.model.layers):
        name = f"model.layers.{i}.mlp.experts"
        probs = torch.softmax(F.linear(seen[name], layer.mlp.gate.weight), dim=-1, dtype=torch.float)
        top = torch.topk(probs, layer.mlp.gate.top_k, dim=-1).indices
        out[name] = torch.tensor([int((top == e).sum()) for e in range(E)])
    return out


def dense_moe(experts: Exl3Experts, x, ids, w) -> torch.Tensor:
    """Σ_k w·down(silu(x·gate)·(x·up)) per token, weights from ``reconstruct`` in float64."""
    weights = {(e, p): experts.projection(e, p).encoded().reconstruct(dtype=torch.float64)  # [in, out]
               for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}

    def W(e, p):
        return weights[e, p]

    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = F.silu(xd[t] @ W(e, "gate_proj")) * (xd[t] @ W(e, "up_proj"))
            out[t] += float(w[t, s]) * (h @ W(e, "down_proj"))
    return out


# ---- explicit map --------------------------------------------------------------------------------------

EXPLICIT = {EXPERTS: {"default": 3, "experts": {0: 4, 2: 4}}}


@pytest.fixture(scope="module")
def explicit_q(src, cache_dir):
    model = load(src)
    summary = quantize_model(model, config(cache_dir, expert_bits=EXPLICIT, moe_max_batched=64), progress=False)
    return model, summary


def test_explicit_map_mixed_bitrates_end_to_end(src, explicit_q):
    model, summary = explicit_q
    for i in range(LAYERS):
        ex = experts_of(model, i)
        assert isinstance(ex, Exl3MoE) and isinstance(ex.moe, MoELayerRuntime)
        assert ex.tier_layout.signature == ((3, 2), (4, 2))
        assert [ex.tier_layout.bits_of(e) for e in range(E)] == [4, 3, 4, 3]
        assert all(ex.projection(e, p).bits == (4 if e in (0, 2) else 3)
                   for e in range(E) for p in ("gate_proj", "up_proj", "down_proj"))
    assert summary["moe"] == {f"model.layers.{i}.mlp.experts": "runtime ((3, 2), (4, 2))" for i in range(LAYERS)}
    assert moe_paths(model) == {f"model.layers.{i}.mlp.experts": "runtime" for i in range(LAYERS)}

    with pytest.raises(RuntimeError, match="has no planned runtime"):
        prewarm(model)  # nothing planned before the eager pass
    ids = token_ids()
    got = logits(model, ids)
    assert all(experts_of(model, i).moe.planned for i in range(LAYERS))
    assert len(model._exl3rt_moe_cache) == 1  # equal tier signatures: both layers share one runtime
    assert prewarm(model) > 0
    torch.testing.assert_close(got, logits(dequantized_copy(src, model), ids), rtol=1e-4, atol=1e-4)
    dense = logits(load(src), ids)
    assert float((got - dense).norm() / dense.norm()) < 0.15


def test_layer_forward_matches_dense_per_token_sum(explicit_q):
    """Decode, prefill and chunking above moe_max_batched=64, against reconstructed experts in float64."""
    model, _ = explicit_q
    ex = experts_of(model, 1)
    g = torch.Generator().manual_seed(3)
    for m in (5, 100):
        x = torch.randn(m, 128, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(m)])
        w = torch.rand(m, 2, generator=g)
        got = ex(x, ids, w)
        ref = dense_moe(ex, x, ids, w)
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_loop_fallback_is_explicit_and_equal(src, cache_dir, explicit_q):
    model, _ = explicit_q
    loop = load(src)
    summary = quantize_model(loop, config(cache_dir, expert_bits=EXPLICIT, moe_runtime=False), progress=False)
    assert summary["hits"] == summary["layers"] and summary["misses"] == 0  # same names, K, seeds -> same codes
    assert all(type(experts_of(loop, i)) is Exl3Experts for i in range(LAYERS))
    assert set(summary["moe"].values()) == {"loop: Exl3Config.moe_runtime=False"}
    assert not hasattr(experts_of(loop, 0), "exl3rt_moe") and prewarm(loop) == 0
    ids = token_ids()
    torch.testing.assert_close(logits(loop, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


def test_bf16_cast_replans(explicit_q):
    model, _ = explicit_q
    ids = token_ids()
    ref = logits(model, ids)
    bf = copy.deepcopy(model).to(torch.bfloat16)
    got = logits(bf, ids)
    assert experts_of(bf, 0).moe.x_dtype == torch.bfloat16
    assert float((got - ref).norm() / ref.norm()) < 3e-2


def test_from_pretrained_explicit_map_uses_the_runtime(src, cache_dir, explicit_q):
    model, _ = explicit_q
    hf = pytest.importorskip("exl3rt.integrations.transformers")
    loaded = load(src, quantization_config=hf.Exl3Config(bits=3, ignore=ATTN, expert_bits=EXPLICIT, cache_dir=cache_dir,
                                                         moe_max_batched=64, progress=False))
    s = loaded.hf_quantizer.summary()
    assert s["misses"] == 0 and s["moe"] == {f"model.layers.{i}.mlp.experts": "runtime ((3, 2), (4, 2))"
                                             for i in range(LAYERS)}
    assert isinstance(experts_of(loaded, 0), Exl3MoE)
    ids = token_ids()
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)


def test_cache_entries_differ_by_bits(src, cache_dir, explicit_q):
    """Expert 0 at K=4 (explicit map) and at K=3 (plain bits=3): two keys, two entries, two widths."""
    from exl3rt.cache import EncodingCache

    model, _ = explicit_q
    plain = load(src)
    quantize_model(plain, config(cache_dir), progress=False)
    assert experts_of(plain, 0).tier_layout.signature == ((3, 4),)
    cache = EncodingCache(root=cache_dir)
    w_gate = load(src).model.layers[0].mlp.experts.gate_up_proj.detach()[0, :128]  # expert 0 gate_proj [I, H]
    name = "model.layers.0.mlp.experts.0.gate_proj"
    keys = {k: cache.key_for_weight(w_gate, bits=k, codebook="mcg", seed=module_seed(name, 0), hessian=None,
                                    tp_size=1, tp_rank=0, tp_bounds=None, out_scales=True) for k in (3, 4)}
    paths = {k: cache.path_for(key) for k, key in keys.items()}
    assert keys[3].digest() != keys[4].digest() and paths[3] != paths[4]
    assert paths[3].is_file() and paths[4].is_file()
    k4 = experts_of(model, 0).projection(0, "gate_proj").trellis
    k3 = experts_of(plain, 0).projection(0, "gate_proj").trellis
    assert (k3.shape[-1], k4.shape[-1]) == (48, 64)


# ---- TopRouted rule --------------------------------------------------------------------------------------

def test_router_stats_equal_brute_force_count(src):
    ids = token_ids(48, seed=7).reshape(-1)  # 96 calibration tokens, one window
    stats = collect_router_stats(load(src), ids)
    truth = brute_force_counts(src, ids)
    assert stats.tokens == 96 and set(stats.counts) == set(truth)
    for name, counts in truth.items():
        assert torch.equal(stats.counts[name], counts), name
        assert int(counts.sum()) == 96 * 2  # top-2: every token routes twice


def test_top_routed_rule_end_to_end(src, cache_dir):
    ids = token_ids(48, seed=7).reshape(-1)
    truth = brute_force_counts(src, ids)
    model = load(src)
    rule = TopRouted(high=4, low=3, fraction=0.25, tokens=96)
    summary = quantize_model(model, config(cache_dir, expert_bits_rule=rule), calibration_ids=ids, progress=False)
    assert summary["router_stats"]["tokens"] == 96
    for i in range(LAYERS):
        name = f"model.layers.{i}.mlp.experts"
        counts = truth[name]
        assert summary["router_stats"]["counts"][name] == counts.tolist()
        top = max(range(E), key=lambda e: (int(counts[e]), -e))  # most routes, lower id on ties
        ex = experts_of(model, i)
        assert isinstance(ex, Exl3MoE) and ex.tier_layout.signature == ((3, 3), (4, 1))
        assert ex.tier_layout.tiers[1].expert_ids == (top,)
        assert all(ex.projection(e, p).bits == (4 if e == top else 3)
                   for e in range(E) for p in ("gate_proj", "up_proj", "down_proj"))
    ids2 = token_ids()
    torch.testing.assert_close(logits(model, ids2), logits(dequantized_copy(src, model), ids2), rtol=1e-4, atol=1e-4)


def test_rule_with_explicit_entries_and_bundled_text(src, cache_dir):
    """Explicit per-expert entries win over the rule; without ids the bundled text goes through the local tokenizer."""
    from transformers import AutoTokenizer

    model = load(src)
    rule = TopRouted(high=4, low=3, fraction=0.5, tokens=64)
    want = calibration_ids(model, 64, tokenizer=AutoTokenizer.from_pretrained(str(src)))
    assert want.numel() == 64
    cfg = config(cache_dir, expert_bits_rule=rule, expert_bits={"model.layers.0.mlp.experts": {3: 4}})
    summary = quantize_model(model, cfg, progress=False)  # tokenizer found beside the model
    assert summary["router_stats"]["tokens"] == 64
    stats = collect_router_stats(load(src), want)
    chosen = rule.bits(stats.counts["model.layers.0.mlp.experts"])
    chosen[3] = 4
    assert [experts_of(model, 0).tier_layout.bits_of(e) for e in range(E)] == chosen
    assert TopRouted(fraction=0.5).bits(torch.tensor([5, 9, 9, 1])) == [3, 4, 4, 3]
    assert TopRouted(fraction=0.25).bits(torch.tensor([7, 9, 9, 1])) == [3, 4, 3, 3]  # tie -> lower id


# ---- errors and the choice of path -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"expert_bits": {EXPERTS: {0: 9}}}, r"expert_bits\['model.layers.\*.mlp.experts'\]\[0\].*unsupported bitrate"),
    ({"expert_bits": {EXPERTS: {"default": 3.5}}}, r"expert_bits\[.*\]\['default'\].*half-integer K needs"),
    ({"expert_bits": {EXPERTS: {"x": 4}}}, r"expert_bits\[.*\]: expert id 'x' is not"),
    ({"expert_bits": {EXPERTS: {-1: 4}}}, r"expert id -1"),
    ({"expert_bits": {EXPERTS: {"experts": {0: 4}, 1: 4}}}, "not both"),
    ({"expert_bits": {EXPERTS: 4}}, r"expert_bits\['model.layers.\*.mlp.experts'\]=4: must be a dict"),
    ({"expert_bits": [EXPERTS]}, "Exl3Config.expert_bits=.*must be a dict"),
    ({"expert_bits_rule": TopRouted(high=9)}, r"expert_bits_rule.high.*unsupported bitrate"),
    ({"expert_bits_rule": TopRouted(fraction=0)}, r"expert_bits_rule.fraction=0"),
    ({"expert_bits_rule": TopRouted(tokens=0)}, r"expert_bits_rule.tokens=0"),
    ({"expert_bits_rule": {"rule": "bottom"}}, "unknown expert-bits rule 'bottom'"),
    ({"moe_runtime": "yes"}, "Exl3Config.moe_runtime"),
    ({"moe_max_batched": 0}, "Exl3Config.moe_max_batched"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(Exl3ConfigError, match=match):
        Exl3Config(**kwargs)


def test_config_roundtrip_through_json():
    cfg = Exl3Config(bits=3, expert_bits={EXPERTS: {"default": 3, "experts": {5: 4, 0: 4}},
                                          "model.layers.1.mlp.experts": {2: 5}},
                     expert_bits_rule=TopRouted(high=4, low=2, fraction=0.25, tokens=128), moe_runtime=True)
    assert cfg.expert_bits["model.layers.1.mlp.experts"] == {"default": None, "experts": {2: 5}}  # shorthand
    again = Exl3Config.from_dict(json.loads(json.dumps(cfg.to_dict(), sort_keys=True)))
    assert again == cfg and again.expert_bits[EXPERTS]["experts"] == {0: 4, 5: 4}
    hf = pytest.importorskip("exl3rt.integrations.transformers")
    h = hf.Exl3Config.from_runtime(cfg)
    assert hf.Exl3Config.from_dict(json.loads(h.to_json_string())).to_runtime() == cfg


def meta_model(src):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(src)))


def test_policy_errors_name_the_entry(src):
    model = meta_model(src)
    with pytest.raises(Exl3ConfigError, match=r"expert_bits\['model.layers.\*.mlp.experts'\]\[7\]: expert 7 does "
                                              r"not exist in model.layers.0.mlp.experts \(4 experts, ids 0..3\)"):
        select_targets(model, Exl3Config(expert_bits={EXPERTS: {7: 4}}))
    with pytest.raises(Exl3ConfigError, match=r"expert_bits\['\*.moe.experts'\]: the pattern matches no fused experts"):
        select_targets(model, Exl3Config(expert_bits={"*.moe.experts": {0: 4}}))
    with pytest.raises(Exl3ConfigError, match="needs router statistics.*quantize_model.*expert_bits"):
        select_targets(model, Exl3Config(expert_bits_rule=TopRouted()))
    targets = {t.name: t for t in select_targets(model, Exl3Config(bits=3, bits_for={"*.down_proj": 5},
                                                                   expert_bits={EXPERTS: {1: 4}}))}
    t = targets["model.layers.0.mlp.experts"]
    assert t.bits[0] == {"gate_proj": 3, "up_proj": 3, "down_proj": 5} and set(t.bits[1].values()) == {4}


def test_from_pretrained_refuses_the_rule(src, cache_dir):
    hf = pytest.importorskip("exl3rt.integrations.transformers")
    with pytest.raises(Exl3ConfigError, match="needs router statistics.*quantize_model"):
        load(src, quantization_config=hf.Exl3Config(expert_bits_rule=TopRouted(), cache_dir=cache_dir))


def test_rule_without_tokens_or_tokenizer(src, cache_dir):
    model = load(src)
    model.name_or_path = model.config._name_or_path = ""
    with pytest.raises(RouterStatsError, match="pass tokenizer=.*calibration_ids="):
        quantize_model(model, config(cache_dir, expert_bits_rule=TopRouted()), progress=False)


def test_untierable_experts_fall_back_or_fail(src, cache_dir, caplog):
    """moe_runtime=None: a layer that cannot be tiered keeps the per-expert loop (logged); True: an error."""
    model = load(src)
    cfg = config(cache_dir, bits_for={"*.experts.1.down_proj": 4})  # expert 1 mixes K3 and K4
    with caplog.at_level("INFO", logger="exl3rt.runtime"):
        summary = quantize_model(model, cfg, progress=False)
    assert all(type(experts_of(model, i)) is Exl3Experts for i in range(LAYERS))
    assert "expert 1 mixes bitrates" in summary["moe"]["model.layers.0.mlp.experts"]
    assert "per-expert loop instead of the MoE runtime" in caplog.text
    ids = token_ids()
    torch.testing.assert_close(logits(model, ids), logits(dequantized_copy(src, model), ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(PolicyError, match=r"model.layers.0.mlp.experts: cannot run through the EXL3 MoE runtime: "
                                          r"expert 1 mixes bitrates.*moe_runtime=None"):
        install_moe_runtimes(model, Exl3Config(moe_runtime=True))
    dense_kept = load(src)
    summary = quantize_model(dense_kept, config(cache_dir, ignore=ATTN + ["*.experts.2.up_proj"]), progress=False)
    assert summary["moe"]["model.layers.0.mlp.experts"].startswith("loop: expert 2 up_proj is kept dense")
    with pytest.raises(PolicyError, match="expert 2 up_proj is kept dense"):
        quantize_model(load(src), config(cache_dir, ignore=ATTN + ["*.experts.2.up_proj"], moe_runtime=True),
                       progress=False)


def test_fused_triton_launch_in_the_model(src, cache_dir, explicit_q):
    """The same quantized model with the tiered Triton MoE launch forced (Triton's interpreter on CPU):
    every layer binds it, and the logits equal the reference launch's up to x' and h' in fp16."""
    import functools
    pytest.importorskip("triton")
    from exl3rt.kernels.linear import interpreting
    from exl3rt.moe import auto_launch_factory
    if not interpreting():   # the model runs on the CPU: compiled Triton (a GPU machine) cannot take its tensors
        pytest.skip("the CPU model's Triton launch needs Triton's interpreter (TRITON_INTERPRET=1 at import)")
    model, _ = explicit_q
    fused = load(src)
    quantize_model(fused, config(cache_dir, expert_bits=EXPLICIT, moe_runtime=False), progress=False)
    install_moe_runtimes(fused, config(cache_dir, expert_bits=EXPLICIT),
                         launch_factory=functools.partial(auto_launch_factory, prefer_triton=True))
    ids = token_ids(n=4)[:1]
    got, ref = logits(fused, ids), logits(model, ids)
    kinds = {}
    for rt in fused._exl3rt_moe_cache.runtimes():
        for launch in rt.launches.values():
            kinds.update(launch.kinds)
    assert kinds == {f"model.layers.{i}.mlp.experts": "triton" for i in range(LAYERS)}
    assert float((got - ref).norm() / ref.norm()) < 1e-2
