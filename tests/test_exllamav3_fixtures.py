"""Checkpoints made by exllamav3's own converter (tests/data/exllamav3, see make_fixtures.py there) load through
``from_pretrained`` as they are stored.

Truth: the matrices exllamav3's kernel decoded from those codes (bit for bit), exllamav3's logits on the GPU, and a
float64 model rebuilt from the checkpoint (tests/float64_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exl3rt.format import Exl3Checkpoint, decode
from exl3rt.format.bits import bits_from_trellis
from exl3rt.runtime.linear import Exl3Linear
from float64_reference import rel_logits_error

DATA = Path(__file__).resolve().parent / "data" / "exllamav3"
# what each fixture's recipe asked exllamav3 for (make_fixtures.py): codebook, the rates present
FIXTURES = {
    "llama_mul1": ("mul1", {2, 3.5, 4, 6}),
    "llama_3inst": ("3inst", {3, 5}),
    "qwen3moe_mcg": ("mcg", {2, 3, 4}),
}


def _load(name, **kw):
    """``name``: a fixture under tests/data/exllamav3 or a path."""
    import exl3rt.integrations.transformers  # noqa: F401  (registers quant_method "exl3")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(DATA / name if isinstance(name, str) else name), dtype=torch.float32, **kw).eval()


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def loaded(request):
    return request.param, _load(request.param), load_file(str(DATA / f"{request.param}.reference.safetensors"))


def test_the_fixtures_are_what_their_script_says():
    for name in FIXTURES:
        meta = json.loads((DATA / name / "fixture.json").read_text())
        cfg = json.loads((DATA / name / "config.json").read_text())
        assert meta["made_by"] == "exllamav3 convert_model"
        assert cfg["quantization_config"]["quant_method"] == "exl3"
        assert cfg["quantization_config"]["version"] == "1.6.5"
    assert (DATA / "qwen3moe_mcg" / "model.safetensors.index.json").exists()     # sharded


def test_every_stored_matrix_loads_as_its_codes(loaded):
    name, model, _ = loaded
    codebook, rates = FIXTURES[name]
    ckpt = Exl3Checkpoint(DATA / name)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, Exl3Linear)}
    stored = {info.name for info in ckpt.linears()}
    assert set(mods) == stored
    for n, m in mods.items():
        enc = ckpt.load_linear(n)
        assert torch.equal(m.trellis, enc.trellis) and torch.equal(m.suh, enc.suh) and torch.equal(m.svh, enc.svh), n
    assert {m.codebook for m in mods.values()} == {codebook}
    assert {float(m.bits) for m in mods.values()} == rates
    if name.startswith("qwen3moe"):
        from exl3rt.runtime.experts import Exl3Experts

        experts = [m for m in model.modules() if isinstance(m, Exl3Experts)]
        assert len(experts) == 2 and all(e.num_experts == 8 for e in experts)
        assert all(isinstance(e.projection(6, "down_proj"), Exl3Linear) for e in experts)


def test_codes_decode_bit_for_bit_as_exllamav3_decoded_them(loaded):
    name, model, ref = loaded
    inner = {k[len("inner."):]: v for k, v in ref.items() if k.startswith("inner.")}
    assert len(inner) >= 3
    for key, want in inner.items():
        m = model.get_submodule(key)
        got = decode(m.trellis, bits_from_trellis(m.trellis), m.codebook)
        assert got.dtype == torch.float16 and torch.equal(got, want), key


def test_logits_match_the_float64_checkpoint_and_exllamav3(loaded):
    name, model, ref = loaded
    ids = ref["ids"]
    assert rel_logits_error(model, DATA / name, ids) < 1e-5
    with torch.no_grad():
        got = model(ids).logits.float()
    want = ref["logits"][..., : got.shape[-1]]
    # exllamav3 ran FP16 activations on the GPU
    assert float((got - want).norm() / want.norm()) < 1e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ---- a damaged checkpoint fails before anything loads, naming the tensor -----------------------------------------
def _damaged(tmp_path, name, edit, reindex):
    """A copy of fixture ``name`` whose (first) safetensors file went through ``edit(tensors) -> tensors``; with
    ``reindex`` its index (if any) is rewritten to match, else it still lists what the shard no longer has."""
    import shutil

    from safetensors.torch import save_file

    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    shard = sorted(p for p in dst.glob("model*.safetensors"))[0]
    tensors = edit(load_file(str(shard)))
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if reindex and index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: f for k, f in data["weight_map"].items() if f != shard.name or k in tensors}
        index.write_text(json.dumps(data))
    return dst


def _without(*names):
    return lambda t: {k: v for k, v in t.items() if k not in names}


def _renamed(old, new):
    return lambda t: {(new if k == old else k): v for k, v in t.items()}


def _marker_off_by_one(t):
    t["model.layers.0.self_attn.q_proj.mul1"] = t["model.layers.0.self_attn.q_proj.mul1"] + 1
    return t


@pytest.mark.parametrize("name,edit,named,why", [
    ("llama_mul1", _without("model.layers.0.self_attn.q_proj.suh"), "model.layers.0.self_attn.q_proj.suh",
     "is there"),
    ("llama_mul1", _without("model.layers.1.mlp.down_proj.trellis"), "model.layers.1.mlp.down_proj.trellis",
     "incomplete"),
    ("llama_mul1", _without("model.norm.weight"), "model.norm.weight", "incomplete"),
    ("llama_mul1", _without("model.layers.1.input_layernorm.weight"), "model.layers.1.input_layernorm.weight",
     "incomplete"),
    ("llama_mul1", _renamed("model.layers.0.mlp.up_proj.mul1", "model.layers.0.mlp.up_proj.mul2"),
     "model.layers.0.mlp.up_proj.mul2", "unknown codebook marker"),
    ("llama_mul1", _marker_off_by_one, "model.layers.0.self_attn.q_proj.mul1", "locked multiplier"),
    ("qwen3moe_mcg", _without("model.layers.0.mlp.experts.5.up_proj.svh"),
     "model.layers.0.mlp.experts.5.up_proj.svh", "is there"),
    # transformers fuses this architecture's experts: a tensor missing for one layer only is still caught
    ("qwen3moe_mcg", _without("model.layers.0.mlp.gate.weight"), "model.layers.0.mlp.gate.weight", "other layers"),
    ("qwen3moe_mcg-stale-index", _without("model.layers.0.mlp.experts.5.up_proj.svh"),
     "model.layers.0.mlp.experts.5.up_proj.svh", "index.json places it"),
])
def test_a_damaged_checkpoint_fails_naming_the_tensor(tmp_path, name, edit, named, why):
    from exl3rt.format.errors import FormatError

    name, _, stale = name.partition("-")
    path = _damaged(tmp_path, name, edit, reindex=not stale)
    with pytest.raises(FormatError) as err:
        _load(path)
    line = str(err.value)
    assert line.startswith(named + ":") and why in line and "\n" not in line


def test_a_truncated_shard_names_the_first_tensor_cut_off(tmp_path):
    import os
    import shutil

    from exl3rt.format.errors import FormatError
    from safetensors import safe_open

    dst = tmp_path / "m"
    shutil.copytree(DATA / "llama_mul1", dst)
    shard = dst / "model.safetensors"
    with safe_open(str(shard), "pt") as f:
        names = list(f.keys())
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(FormatError, match=r"^(\S+): cut off in .*truncated") as err:
        _load(dst)
    # the tensor stored last is the one cut: brute force over the header's offsets
    import json
    import struct
    raw = (DATA / "llama_mul1" / "model.safetensors").read_bytes()
    header = json.loads(raw[8: 8 + struct.unpack("<Q", raw[:8])[0]])
    last = max(names, key=lambda n: header[n]["data_offsets"][1])
    assert str(err.value).startswith(last + ":")


# ---- exl3rt inspect: what will load ------------------------------------------------------------------------------
def test_inspect_shows_what_from_pretrained_builds(capsys):
    from exl3rt.cli.main import main

    assert main(["inspect", str(DATA / "qwen3moe_mcg")]) == 0
    text = capsys.readouterr().out
    assert "quantization_config by exllamav3 1.6.5" in text
    # 2 layers x 4 attention linears + the head; 2 expert layers of 8 experts x 3 projections
    assert "Qwen3MoeForCausalLM, 2 layers: 9 Exl3Linear, 2 Exl3Experts layers (8 experts each, 48 linears in 16 " \
           "experts), lm_head EXL3 K4" in text
    assert "model.layers.0.mlp.experts.*.down_proj (8 experts)" in text and "experts.6." not in text
    assert main(["inspect", str(DATA / "qwen3moe_mcg"), "--all"]) == 0
    assert "model.layers.0.mlp.experts.6.down_proj " in capsys.readouterr().out

    # the plan is the loader's own: it agrees with what from_pretrained built
    assert main(["inspect", str(DATA / "llama_3inst"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["loads"]
    model = _load("llama_3inst")
    assert plan["linears"] == sorted(n for n, m in model.named_modules() if isinstance(m, Exl3Linear))
    assert plan["head"] is None and plan["dense"] == ["lm_head"]
    assert set(plan["other"]) == {n for n, _ in model.named_parameters()}     # embedding, norms, the fp16 head


def test_inspect_of_a_damaged_checkpoint_is_one_error_line(tmp_path, capsys):
    from exl3rt.cli.main import main

    path = _damaged(tmp_path, "llama_mul1", _without("model.layers.1.mlp.gate_proj.suh"), reindex=True)
    assert main(["inspect", str(path)]) != 0
    err = capsys.readouterr().err.strip()
    assert "model.layers.1.mlp.gate_proj.suh: missing" in err and len(err.splitlines()) == 1
