"""End to end in real vLLM (the vLLM venv: .ci/vllm_e2e.sh); skipped where vLLM is not installed.

Truth: exl3rt's own transformers path (``from_pretrained(..., quantization_config=Exl3Config)``) with the
same bits/seed/cache, greedy, on the same tiny random Llama (BF16 checkpoint, peaked logits so the
continuation is not one repeated token). Each vLLM start is its own process (tests/vllm/serve_once.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from tiny_models import tiny_llama, tiny_qwen_moe  # noqa: E402
from serve_once import PROMPTS  # noqa: E402  (no vLLM import at module level)

BITS = 4
MAX_TOKENS = 16


def _serve(model: Path, cache: Path, out: Path, *extra: str) -> dict:
    env = dict(os.environ, EXL3RT_CACHE_DIR=str(cache), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [sys.executable, str(HERE / "serve_once.py"), str(model), str(out), "--max-tokens", str(MAX_TOKENS), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"vLLM run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


def _served_as_expected(got: dict, layers: list[str]) -> None:
    """How ``layers`` run: on the CPU each through vLLM's own GEMM over its decoded product; on CUDA through exl3rt's
    kernels, every layer of several shards (qkv_proj, gate_up_proj) as one fused call."""
    if got["device"] == "cpu":
        assert got["dense"] == sorted(layers)
    else:
        assert got["dense"] == []
        assert got["fused"] == sorted(n for n in layers if n.endswith(("qkv_proj", "gate_up_proj"))), got["fused"]
        # every kernel specialization was compiled before serving
        assert got["exl3rt_compiles_while_generating"] == 0, got["compiled"]


def _hf_tokens(model: Path, config, dtype=None) -> tuple[list[list[int]], dict]:
    """Greedy tokens of exl3rt's transformers path (``from_pretrained(..., quantization_config=config)``)."""
    from transformers import AutoModelForCausalLM

    import exl3rt.integrations.transformers  # noqa: F401  (registers quant_method "exl3rt")

    # on the GPU vLLM serves from: the same device, the same kernels
    where = {"device_map": "cuda"} if torch.cuda.is_available() else {}
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype or torch.bfloat16, quantization_config=config,
                                             **where)
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p], device=m.device)
        with torch.no_grad():
            g = m.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
        out.append(g[0, len(p):].tolist())
    return out, m.hf_quantizer.summary()


def _greedy(model) -> list[list[int]]:
    """``model``'s greedy continuation of every prompt (MAX_TOKENS each), checked not to be degenerate."""
    want = []
    for p in PROMPTS:
        with torch.no_grad():
            g = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                               min_new_tokens=MAX_TOKENS)
        want.append(g[0, len(p):].tolist())
    assert len({t for seq in want for t in seq}) >= 4, f"degenerate continuation {want}"
    return want


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("m") / "llama", init_std=0.5, dtype=torch.bfloat16)


def test_online_exl3_matches_transformers_and_hits_cache(bf16_llama, tmp_path):
    """BF16 serving encodes once and hits the cache after; the token-for-token check against the transformers
    path is in float32: in bf16 vLLM's CPU kernels and transformers' matmuls round differently, and on this tiny
    random model the greedy tokens part after ~10 steps on some CPUs (AVX2 without AVX512-BF16), whatever the codes."""
    import exl3rt

    cache = tmp_path / "cache"
    first = _serve(bf16_llama, cache, tmp_path / "r1.json", "--bits", str(BITS))
    # every linear of the model went through the plugin, one EXL3 matrix per checkpoint linear
    assert first["linears"] and all(v.startswith("Exl3OnlineLinearMethod:") for v in first["linears"].values()), first["linears"]
    names = [n.split("@")[0] for v in first["linears"].values() for n in v.split(":", 1)[1].split(",")]
    assert len(names) == 7 * 2 and "model.layers.0.self_attn.k_proj" in names
    online = first["summary"]["online"]
    assert (online["misses"], online["hits"]) == (14, 0)
    assert first["decodes_while_generating"] == 0     # decoded once, at load
    assert len(list((cache / "v1").rglob("*.safetensors"))) == 14

    second = _serve(bf16_llama, cache, tmp_path / "r2.json", "--bits", str(BITS))
    assert (second["summary"]["online"]["misses"], second["summary"]["online"]["hits"]) == (0, 14)
    assert second["tokens"] == first["tokens"]

    # exl3rt's transformers path on the same cache: the keys are the same, so it encodes nothing
    cfg = exl3rt.Exl3Config(bits=BITS, cache_dir=str(cache), progress=False)
    _, summary = _hf_tokens(bf16_llama, cfg)
    assert summary["misses"] == 0 and summary["hits"] == 14

    f32 = _serve(bf16_llama, cache, tmp_path / "r3.json", "--bits", str(BITS), "--dtype", "float32")
    # the BF16 weights loaded in float32 hold the same values (the encoder reads float32 either way): same entries
    assert (f32["summary"]["online"]["misses"], f32["summary"]["online"]["hits"]) == (0, 14)
    hf_tokens, summary = _hf_tokens(bf16_llama, cfg, dtype=torch.float32)
    assert summary["misses"] == 0 and summary["hits"] == 14
    assert len({t for seq in hf_tokens for t in seq}) >= 4, f"degenerate continuation {hf_tokens}: not a useful check"
    assert f32["tokens"] == hf_tokens


def test_online_exl3_under_vllm_torch_compile(bf16_llama, tmp_path):
    """Without enforce_eager vLLM compiles the model (torch.compile) around our method: in float32 the
    tokens equal exl3rt's transformers path. (In bf16 compiled and eager vLLM differ from each other after a
    few tokens on this tiny random model — fused bf16 ops round differently — so the check is in float32,
    where eager and compiled vLLM also agree.)"""
    import exl3rt

    cache = tmp_path / "cache"
    got = _serve(bf16_llama, cache, tmp_path / "c.json", "--bits", str(BITS), "--dtype", "float32", "--compile")
    assert got["linears"] and all(v.startswith("Exl3OnlineLinearMethod:") for v in got["linears"].values())
    # the weights were decoded at load (process_weights_after_loading), none in the compiled graph, and every
    # layer runs vLLM's own CPU GEMM over its decoded product (on CUDA: exl3rt's kernels, shards fused)
    assert got["decodes_while_generating"] == 0
    _served_as_expected(got, list(got["linears"]))
    cfg = exl3rt.Exl3Config(bits=BITS, cache_dir=str(cache), progress=False)
    hf_tokens, summary = _hf_tokens(bf16_llama, cfg, dtype=torch.float32)
    assert summary["misses"] == 0 and summary["hits"] == 14
    assert got["tokens"] == hf_tokens


def _swap_in_checkpoint(model, ckpt_dir: Path) -> int:
    """Replace every nn.Linear stored in the EXL3 checkpoint by exl3rt's Exl3Linear of the stored codes."""
    from exl3rt.format.checkpoint import Exl3Checkpoint
    from exl3rt.runtime.linear import Exl3Linear

    ckpt = Exl3Checkpoint(ckpt_dir)
    n = 0
    for name, enc in ckpt.iter_linears():
        parent, _, child = name.rpartition(".")
        old = model.get_submodule(name)
        enc.in_features, enc.out_features = old.in_features, old.out_features
        setattr(model.get_submodule(parent), child, Exl3Linear.from_encoded(enc, name=name))
        n += 1
    return n


def test_prequantized_checkpoint_matches_transformers(bf16_llama, tmp_path):
    from exl3rt.convert.run import convert_checkpoint
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "exl3"
    convert_checkpoint(bf16_llama, ckpt, bits=BITS, head_bits=16, progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bf16_llama / f, ckpt / f)
    # float32: token for token with transformers on any CPU (bf16 kernels differ, see the online test)
    got = _serve(ckpt, tmp_path / "unused-cache", tmp_path / "r.json", "--dtype", "float32")
    assert got["summary"]["mode"] == "checkpoint"
    assert len(got["linears"]) == 8
    assert all(v.startswith("Exl3CheckpointLinearMethod:") for v in got["linears"].values()), got["linears"]
    assert not (tmp_path / "unused-cache").exists()  # nothing encoded, no cache touched

    # truth: transformers with exl3rt's Exl3Linear built from the stored codes
    model = AutoModelForCausalLM.from_pretrained(str(bf16_llama), dtype=torch.float32)
    assert _swap_in_checkpoint(model, ckpt) == 14
    want = _greedy(model)
    assert got["tokens"] == want


# ---- a quantized lm_head (exl3rt quantize's default --head-bits 6) ------------------------------------------------
HEAD_BITS = 6


@pytest.mark.parametrize("vocab", [64, 100])
def test_prequantized_checkpoint_with_quantized_head(vocab, tmp_path, monkeypatch):
    """The tiny Llama (tied embeddings) converted at the default head bits: the converter stores a separate EXL3
    ``lm_head`` at K 6 and unties. vLLM serves it through the plugin's head method (vocab 100: EXL3 pads the head
    to 128 rows, vLLM's partition to 128 rows of which 28 are padding) and the greedy tokens equal exl3rt's
    transformers path on the same stored codes (head included), token for token. Both run in float32: in BF16 the
    two forwards round differently and the vocab-100 model's greedy paths part at step 11 (10 tokens equal)."""
    import exl3rt
    from exl3rt.convert.run import convert_checkpoint
    from exl3rt.integrations.vllm.settings import stored_linears

    bf16 = tiny_llama(tmp_path / "llama", vocab=vocab, init_std=0.5, dtype=torch.bfloat16)
    ckpt = tmp_path / "exl3"
    convert_checkpoint(bf16, ckpt, bits=BITS, progress=False)  # head_bits: the default (6)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bf16 / f, ckpt / f)
    assert "lm_head" in stored_linears(ckpt)
    assert json.loads((ckpt / "config.json").read_text()).get("tie_word_embeddings") is False

    got = _serve(ckpt, tmp_path / "unused-cache", tmp_path / "r.json", "--dtype", "float32")
    assert not (tmp_path / "unused-cache").exists()  # nothing encoded, no cache touched
    assert got["heads"] == {"lm_head": f"Exl3CheckpointHeadMethod:lm_head@K{HEAD_BITS}"}, got["heads"]
    assert len(got["linears"]) == 8
    assert all(v.startswith("Exl3CheckpointLinearMethod:") for v in got["linears"].values()), got["linears"]
    assert got["summary"]["layers"]["lm_head"] == "checkpoint" and len(got["summary"]["layers"]) == 9
    _served_as_expected(got, [*got["linears"], "lm_head"])       # vLLM's CPU GEMM over the decoded products

    # truth: exl3rt's transformers path (head quantized, tied head untied) with every matrix's codes from the checkpoint
    _use_stored_codes(ckpt, monkeypatch)
    cfg = exl3rt.Exl3Config(bits=BITS, quantize_lm_head=True, head_bits=HEAD_BITS, cache_mode="off", progress=False)
    want, summary = _hf_tokens(bf16, cfg, dtype=torch.float32)
    assert summary["layers"] == 15, summary
    assert len({t for seq in want for t in seq}) >= 4, f"degenerate continuation {want}"
    assert got["tokens"] == want


# ---- MoE: online EXL3 through vLLM's fused-MoE method API -------------------------------------------------
MOE_LAYERS, MOE_EXPERTS = 2, 4


@pytest.fixture(scope="module")
def bf16_qwen_moe(tmp_path_factory) -> Path:
    return tiny_qwen_moe(tmp_path_factory.mktemp("m") / "qwen_moe", layers=MOE_LAYERS, experts=MOE_EXPERTS,
                         init_std=0.5, dtype=torch.bfloat16, tokenizer=True)


def test_online_moe_matches_transformers_and_hits_cache(bf16_qwen_moe, tmp_path):
    """Tiny Qwen3-MoE, BF16: every expert matrix is encoded by the plugin's fused-MoE method (one EXL3 matrix
    per expert projection) and run through an exl3rt.moe layer runtime; the cache entries are those of the
    transformers path (equal keys at TP=1), a second start encodes nothing, and the greedy tokens are equal."""
    import exl3rt

    cache = tmp_path / "cache"
    n_experts = MOE_LAYERS * MOE_EXPERTS * 3
    n_total = n_experts + MOE_LAYERS * 4  # + q, k, v, o
    first = _serve(bf16_qwen_moe, cache, tmp_path / "r1.json", "--bits", str(BITS))
    experts = first["experts"]
    assert len(experts) == MOE_LAYERS and all(v.startswith("Exl3OnlineMoEMethod:") for v in experts.values()), experts
    names = [n.split("@")[0] for v in experts.values() for n in v.split(":", 1)[1].split("|")[0].split(",")]
    assert len(names) == n_experts == len(set(names)) and "model.layers.1.mlp.experts.3.down_proj" in names
    assert all(v.split("|")[1] == f"runtime (({BITS}, {MOE_EXPERTS}),)" for v in experts.values()), experts
    assert set(first["summary"]["moe"]) == {f"model.layers.{i}.mlp.experts" for i in range(MOE_LAYERS)}
    routers = {n for n in first["linears"] if n.endswith(".mlp.gate")}
    assert len(routers) == MOE_LAYERS and all(first["linears"][n] == "UnquantizedLinearMethod" for n in routers)
    assert all(v.startswith("Exl3OnlineLinearMethod:") for n, v in first["linears"].items() if n not in routers)
    online = first["summary"]["online"]
    assert (online["misses"], online["hits"]) == (n_total, 0)

    # exl3rt's transformers path on the same cache: equal keys, so nothing is encoded; equal tokens
    cfg = exl3rt.Exl3Config(bits=BITS, cache_dir=str(cache), progress=False)
    hf_tokens, summary = _hf_tokens(bf16_qwen_moe, cfg)
    assert (summary["misses"], summary["hits"]) == (0, n_total)
    assert all(v.startswith("runtime") for v in summary["moe"].values()), summary["moe"]
    assert len({t for seq in hf_tokens for t in seq}) >= 4, f"degenerate continuation {hf_tokens}: not a useful check"
    assert first["tokens"] == hf_tokens

    second = _serve(bf16_qwen_moe, cache, tmp_path / "r2.json", "--bits", str(BITS))
    assert (second["summary"]["online"]["misses"], second["summary"]["online"]["hits"]) == (0, n_total)
    assert second["tokens"] == first["tokens"]


def test_online_moe_under_vllm_torch_compile(bf16_qwen_moe, tmp_path):
    """Without enforce_eager vLLM compiles the MoE model around the plugin's fused-MoE method: the layer runtime is
    planned at load (planned on its first call, the plan was traced into the graph and the compile failed), nothing
    is decoded while generating, and in float32 the greedy tokens equal exl3rt's transformers path."""
    import exl3rt

    cache = tmp_path / "cache"
    got = _serve(bf16_qwen_moe, cache, tmp_path / "c.json", "--bits", str(BITS), "--dtype", "float32", "--compile")
    assert len(got["experts"]) == MOE_LAYERS
    assert all(v.startswith("Exl3OnlineMoEMethod:") for v in got["experts"].values()), got["experts"]
    assert got["decodes_while_generating"] == 0
    cfg = exl3rt.Exl3Config(bits=BITS, cache_dir=str(cache), progress=False)
    hf_tokens, summary = _hf_tokens(bf16_qwen_moe, cfg, dtype=torch.float32)
    assert summary["misses"] == 0
    assert len({t for seq in hf_tokens for t in seq}) >= 4, f"degenerate continuation {hf_tokens}: not a useful check"
    assert got["tokens"] == hf_tokens


# ---- MoE: a pre-quantized EXL3 checkpoint (exl3rt's converter, per-expert bitrates) ------------------------------
#: converter overrides: experts differ in K (4 by default), every projection of an expert at one K
EXPERT_OVERRIDES = (("*.experts.1.*", 3), ("*.experts.3.*", 5))
EXPERT_K = {0: 4, 1: 3, 2: 4, 3: 5}


@pytest.fixture(scope="module")
def exl3_qwen_moe(bf16_qwen_moe, tmp_path_factory) -> Path:
    from exl3rt.convert.run import convert_checkpoint

    ckpt = tmp_path_factory.mktemp("m") / "qwen_moe_exl3"
    convert_checkpoint(bf16_qwen_moe, ckpt, bits=BITS, head_bits=16, overrides=EXPERT_OVERRIDES, progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bf16_qwen_moe / f, ckpt / f)
    return ckpt


def _use_stored_codes(ckpt: Path, monkeypatch) -> None:
    """Make exl3rt's encoder return each matrix's codes from the stored checkpoint instead of encoding."""
    import exl3rt.encode.quantize as quantize
    from exl3rt.format.checkpoint import Exl3Checkpoint

    stored = Exl3Checkpoint(ckpt)

    def from_checkpoint(weight, bits, codebook="mcg", hessian=None, seed=0, *, name="", **kw):
        enc = stored.load_linear(name)
        assert enc.bits == bits, (name, enc.bits, bits)
        enc.in_features, enc.out_features = int(weight.shape[0]), int(weight.shape[1])
        return enc

    monkeypatch.setattr(quantize, "quantize_weight", from_checkpoint)


def _hf_tokens_from_stored_codes(bf16: Path, ckpt: Path, monkeypatch) -> tuple[list[list[int]], dict]:
    """exl3rt's transformers path (``from_pretrained`` + ``Exl3Config``: Exl3Linear per matrix, the experts as
    an ``Exl3MoE`` layer runtime) with every matrix's codes taken from the stored checkpoint instead of encoded."""
    import exl3rt

    _use_stored_codes(ckpt, monkeypatch)
    cfg = exl3rt.Exl3Config(bits=BITS, bits_for=dict(EXPERT_OVERRIDES), cache_mode="off", progress=False)
    return _hf_tokens(bf16, cfg, dtype=torch.float32)


def _expert_names(experts: dict) -> dict[str, float]:
    out = {}
    for v in experts.values():
        for item in v.split(":", 1)[1].split("|")[0].split(","):
            name, k = item.split("@K")
            out[name] = float(k)
    return out


def _check_checkpoint_moe(got: dict, how: str = "checkpoint") -> None:
    experts = got["experts"]
    assert got["summary"]["mode"] == "checkpoint"
    assert len(experts) == MOE_LAYERS, experts
    assert all(v.startswith("Exl3CheckpointMoEMethod:") for v in experts.values()), experts
    ks = _expert_names(experts)  # every expert matrix went through the plugin's method, at its stored K
    assert ks == {f"model.layers.{i}.mlp.experts.{e}.{p}": EXPERT_K[e] for i in range(MOE_LAYERS)
                  for e in range(MOE_EXPERTS) for p in ("gate_proj", "up_proj", "down_proj")}
    assert all(v.split("|")[1] == "runtime ((3, 1), (4, 2), (5, 1))" for v in experts.values()), experts
    assert got["summary"]["layers"] == {**{f"model.layers.{i}.mlp.experts": how for i in range(MOE_LAYERS)},
                                        **{f"model.layers.{i}.self_attn.{n}": "checkpoint" for i in range(MOE_LAYERS)
                                           for n in ("qkv_proj", "o_proj")}}
    assert "online" not in got["summary"]  # nothing encoded


@pytest.fixture(scope="module")
def served_exl3_moe(exl3_qwen_moe, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("serve")
    got = _serve(exl3_qwen_moe, tmp / "unused-cache", tmp / "r.json", "--dtype", "float32")
    assert not (tmp / "unused-cache").exists()  # nothing encoded, no cache touched
    return got


def test_prequantized_moe_matches_transformers(bf16_qwen_moe, exl3_qwen_moe, served_exl3_moe, monkeypatch):
    """A Qwen3-MoE converted by ``exl3rt quantize`` with experts at K 3/4/5: every expert matrix is loaded from
    its stored codes by the plugin's checkpoint MoE method and run by a layer runtime (three tiers); the greedy
    tokens equal exl3rt's transformers path on the same codes, token for token. Both run in float32: in BF16
    this tiny random model has a near-tie (logits one BF16 ulp apart) that either side may break."""
    got = served_exl3_moe
    _check_checkpoint_moe(got)

    want, summary = _hf_tokens_from_stored_codes(bf16_qwen_moe, exl3_qwen_moe, monkeypatch)
    assert summary["moe"] == {f"model.layers.{i}.mlp.experts": "runtime ((3, 1), (4, 2), (5, 1))"
                              for i in range(MOE_LAYERS)}, summary["moe"]
    assert len({t for seq in want for t in seq}) >= 4, f"degenerate continuation {want}: not a useful check"
    assert got["tokens"] == want


def _rank_sliced_copy(ckpt: Path, out: Path, tp_size: int) -> Path:
    """``ckpt`` with its experts re-written rank-sliced (exl3rt.moe.rank_checkpoint), the other tensors as they are."""
    from safetensors.torch import save_file
    from exl3rt.format.checkpoint import Exl3Checkpoint
    from exl3rt.moe.rank_checkpoint import save_rank_sliced

    src = Exl3Checkpoint(ckpt)
    layers = {f"model.layers.{i}.mlp": [{p: src.load_linear(f"model.layers.{i}.mlp.experts.{e}.{p}")
                                         for p in ("gate_proj", "up_proj", "down_proj")} for e in range(MOE_EXPERTS)]
              for i in range(MOE_LAYERS)}
    config = json.loads((ckpt / "config.json").read_text())
    save_rank_sliced(out, layers, tp_size, config=config)
    rest = {n: src.tensor(n).contiguous() for n in src.tensor_names() if ".mlp.experts." not in n}
    save_file(rest, str(out / "model-rest.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: "model-rest.safetensors" for n in rest})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / f, out / f)
    return out


def test_prequantized_moe_rank_sliced_checkpoint(exl3_qwen_moe, served_exl3_moe, tmp_path):
    """The same experts stored rank-sliced (``…experts.<e>.<proj>.rank0.*``, TP 1 here: one CPU process) load
    rank-locally through the rank-sliced reader and give the same tokens as the per-expert checkpoint."""
    ckpt = _rank_sliced_copy(exl3_qwen_moe, tmp_path / "rank_sliced", 1)
    names = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.down_proj.rank0.trellis" in names
    assert not any(n.endswith("experts.3.down_proj.trellis") for n in names)
    got = _serve(ckpt, tmp_path / "unused-cache", tmp_path / "r.json", "--dtype", "float32")
    _check_checkpoint_moe(got, how="checkpoint (rank-sliced)")
    assert got["tokens"] == served_exl3_moe["tokens"]


# ---- checkpoints made by exllamav3's own converter (tests/data/exllamav3) ----------------------------------------
EXLLAMAV3_DATA = HERE.parent / "data" / "exllamav3"


@pytest.mark.parametrize("name", ["llama_mul1", "llama_3inst", "qwen3moe_mcg"])
def test_checkpoints_made_by_exllamav3_serve_as_transformers_runs_them(name, tmp_path):
    """vLLM serves each exllamav3-made checkpoint through the plugin (stored codes, nothing encoded: mixed rates, a
    half-integer rate, a quantized or unquantized head, MoE experts, two shards) and its greedy tokens equal exl3rt's
    transformers path on the same checkpoint, token for token, both in float32."""
    import exl3rt.integrations.transformers  # noqa: F401
    from transformers import AutoModelForCausalLM

    ckpt = EXLLAMAV3_DATA / name
    got = _serve(ckpt, tmp_path / "unused-cache", tmp_path / "r.json", "--dtype", "float32")
    assert got["summary"]["mode"] == "checkpoint"
    assert not (tmp_path / "unused-cache").exists()  # nothing encoded, no cache touched
    # vLLM fuses q/k/v and gate/up: 4 linears per dense layer, 2 beside the experts
    assert got["ours"] == (4 if name.startswith("qwen") else 8), got["linears"]
    routers = {n for n in got["linears"] if n.endswith(".mlp.gate")}    # stored unquantized, as exllamav3 leaves them
    assert all(v.startswith("Exl3CheckpointLinearMethod:") for n, v in got["linears"].items() if n not in routers)
    if name == "qwen3moe_mcg":
        assert len(got["experts"]) == 2 and all("Exl3" in v for v in got["experts"].values()), got["experts"]
    quantized_head = name != "llama_3inst"
    assert got["heads"]["lm_head"].startswith("Exl3CheckpointHeadMethod") == quantized_head, got["heads"]

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    want = _greedy(model)
    assert got["tokens"] == want
