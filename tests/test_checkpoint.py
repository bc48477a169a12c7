"""Checkpoint write -> read round trip, laziness, and clear errors that change nothing on disk."""

import json

import pytest
import torch
from safetensors.torch import save_file

from exl3rt.format import CheckpointWriter, EncodedLinear, Exl3Checkpoint, FormatError, write_checkpoint
from exl3rt.format.random import random_linear

LAYERS = {  # name -> (in, out, bits, codebook, bias)
    "model.layers.0.self_attn.q_proj": (256, 256, 4, "mcg", True),
    "model.layers.0.mlp.down_proj": (300, 256, 2.5, "mul1", False),
    "model.layers.1.mlp.up_proj": (256, 384, 3, "3inst", False),
    "model.layers.10.mlp.up_proj": (128, 128, 8, "mcg", False),
    "lm_head": (256, 512, 6, "mul1", False),
}
OTHER = {"model.embed_tokens.weight": torch.randn(512, 256).half(), "model.norm.weight": torch.ones(256).half()}


def build_linears():
    return {n: random_linear(i, o, k, cb, seed=s, bias=b, name=n)
            for s, (n, (i, o, k, cb, b)) in enumerate(LAYERS.items())}


def expected_bpw(names):
    from exl3rt.format.encoded import padded_width as pw
    w = {n: pw(LAYERS[n][0]) * pw(LAYERS[n][1]) for n in names}
    return sum(w[n] * LAYERS[n][2] for n in names) / sum(w.values())


@pytest.fixture
def written(tmp_path):
    lins = build_linears()
    out = write_checkpoint(tmp_path / "ckpt", lins, OTHER, {"architectures": ["LlamaForCausalLM"]},
                           max_shard_bytes=150_000)
    return out, lins


def test_round_trip_bit_exact(written):
    out, lins = written
    ckpt = Exl3Checkpoint(out)
    assert [li.name for li in ckpt.linears()] == [
        "lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.up_proj", "model.layers.10.mlp.up_proj"]
    for name, lin in lins.items():
        back = ckpt.load_linear(name)
        assert back.codebook == lin.codebook and back.bits == lin.bits
        for k, v in lin.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), (name, k)
        info = ckpt.linear_info(name)
        assert (info.in_padded, info.out_padded, info.bits, info.codebook) == (
            lin.in_padded, lin.out_padded, lin.bits, lin.codebook)
        assert info.nbytes == lin.nbytes
    for name, t in OTHER.items():
        assert torch.equal(ckpt.tensor(name), t)
    assert sorted(ckpt.other_tensor_names()) == sorted(OTHER)


def test_layout_files_and_config(written):
    out, lins = written
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    assert not list(out.glob("*.partial")) and not list(out.glob(".*tmp"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert "model.layers.0.self_attn.q_proj.mcg" in index["weight_map"]
    # every tensor of one linear lives in one shard
    for name in lins:
        files = {f for k, f in index["weight_map"].items() if k.startswith(name + ".")}
        assert len(files) == 1
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "exl3" and qc["head_bits"] == 6 and cfg["tie_word_embeddings"] is False
    assert qc["bits"] == round(expected_bpw([n for n in LAYERS if n != "lm_head"]), 2)
    side = json.loads((out / "quantization_config.json").read_text())
    ts = side["tensor_storage"]["model.layers.0.mlp.down_proj"]
    assert ts["bits_per_weight"] == 2.5 and ts["mul1_multiplier"] == 0x83DCD12D
    assert ts["stored_tensors"]["trellis"] == {"shape": [24, 16, 40], "torch_dtype": "int16"}


def test_summary_bpw(written):
    out, _ = written
    s = Exl3Checkpoint(out).summary()
    assert s["linears"] == len(LAYERS)
    assert s["bpw"] == pytest.approx(expected_bpw(LAYERS), rel=1e-12)


def test_bits_come_from_the_trellis_not_the_config(written):
    out, _ = written
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 7.0
    (out / "config.json").write_text(json.dumps(cfg))
    side = json.loads((out / "quantization_config.json").read_text())
    side["tensor_storage"]["lm_head"]["bits_per_weight"] = 2
    (out / "quantization_config.json").write_text(json.dumps(side))
    ckpt = Exl3Checkpoint(out)
    assert ckpt.linear_info("lm_head").bits == 6 and ckpt.load_linear("lm_head").bits == 6


def test_listing_reads_no_tensor_data(written, monkeypatch):
    import exl3rt.util.tensorfiles as mod

    calls = []

    class Recording:
        def __init__(self, *a, **k):
            self._h = mod_safe_open(*a, **k)

        def __getattr__(self, attr):
            return getattr(self._h, attr)

        def get_tensor(self, n):
            calls.append(n)
            return self._h.get_tensor(n)

    mod_safe_open = mod.safe_open
    monkeypatch.setattr(mod, "safe_open", Recording)
    out, _ = written
    ckpt = Exl3Checkpoint(out)
    ckpt.linears(), ckpt.summary(), ckpt.other_tensor_names()
    assert calls == []
    ckpt.load_linear("model.layers.1.mlp.up_proj")
    assert sorted(calls) == ["model.layers.1.mlp.up_proj.suh", "model.layers.1.mlp.up_proj.svh",
                             "model.layers.1.mlp.up_proj.trellis"]


def test_single_file_checkpoint(tmp_path):
    lin = random_linear(128, 256, 3, "mcg", seed=5)
    save_file(lin.state_dict("proj"), str(tmp_path / "one.safetensors"))
    ckpt = Exl3Checkpoint(tmp_path / "one.safetensors")
    assert [li.name for li in ckpt.linears()] == ["proj"]
    assert torch.equal(ckpt.load_linear("proj").trellis, lin.trellis)


def test_error_foreign_quant_method(written):
    out, _ = written
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="quant_method is 'gptq', not 'exl3'"):
        Exl3Checkpoint(out)


def test_error_missing_shard(written):
    out, _ = written
    victim = sorted(out.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(FormatError, match=f"shard '{victim.name}' is listed but missing"):
        Exl3Checkpoint(out)


def test_error_truncated_shard(written):
    out, _ = written
    victim = sorted(out.glob("model-*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:40])
    with pytest.raises(FormatError, match="not a readable safetensors file"):
        Exl3Checkpoint(out)


def test_error_no_such_path(tmp_path):
    with pytest.raises(FormatError, match="no such file or directory"):
        Exl3Checkpoint(tmp_path / "nope")


def test_error_not_a_quantized_linear(written):
    with pytest.raises(FormatError, match="model.norm: not a quantized linear"):
        Exl3Checkpoint(written[0]).load_linear("model.norm")


def test_writer_refuses_existing_checkpoint_and_changes_nothing(written):
    out, _ = written
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(FormatError, match=r"not empty \(README.md, config.json, model-00001-of-"):
        CheckpointWriter(out)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_writer_crash_leaves_no_checkpoint(tmp_path):
    out = tmp_path / "crash"
    with pytest.raises(RuntimeError):
        with CheckpointWriter(out, max_shard_bytes=1000) as w:
            w.add_linear("a", random_linear(128, 128, 4, seed=1))
            w.add_linear("b", random_linear(128, 128, 4, seed=2))  # flushes "a" to a partial shard
            raise RuntimeError("killed")
    assert sorted(p.name for p in out.iterdir()) == []


def test_writer_rejects_duplicate_names(tmp_path):
    w = CheckpointWriter(tmp_path / "dup")
    w.add_tensor("x", torch.zeros(2))
    with pytest.raises(FormatError, match="x: added twice"):
        w.add_tensor("x", torch.zeros(2))


def test_views_are_stored_compactly(tmp_path):
    big = torch.arange(1000, dtype=torch.float16)
    out = write_checkpoint(tmp_path / "v", {"p": random_linear(128, 128, 2, seed=0)}, {"t": big[10:20]})
    assert torch.equal(Exl3Checkpoint(out).tensor("t"), big[10:20])
    assert isinstance(Exl3Checkpoint(out).load_linear("p"), EncodedLinear)


def test_model_card_and_stored_bits_per_weight(written):
    """The checkpoint records what its quantized linears really store per weight (codes, scales, biases, codebook
    markers: summed here from the stored tensors themselves) and carries a model card with K per module, layer
    indices folded."""
    from safetensors import safe_open

    out, lins = written
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    bits = weights = 0
    for f in out.glob("model-*.safetensors"):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                name, _, part = k.rpartition(".")
                if name in lins:
                    t = s.get_tensor(k)
                    bits += t.numel() * t.element_size() * 8
    weights = sum(lin.trellis.shape[0] * lin.trellis.shape[1] * 256 for lin in lins.values())
    assert qc["bpw"] == pytest.approx(bits / weights, abs=1e-4) and qc["bpw"] > qc["bits"]
    card = (out / "README.md").read_text()
    assert card.startswith("<!-- written by exl3rt -->") and f"| {qc['bpw']} |" in card
    assert "| `model.layers.*.mlp.up_proj` | K" in card and "| architecture | LlamaForCausalLM |" in card
    assert "Original model card" not in card


def test_model_card_keeps_a_carried_readme_and_replaces_its_own(tmp_path):
    lins = {"model.layers.0.mlp.up_proj": random_linear(128, 256, 3, seed=1)}
    out = tmp_path / "ck"
    source_card = tmp_path / "README.md"
    source_card.write_text("# The source model\n\nIts own words.\n")
    with CheckpointWriter(out) as w:
        w.add_linear("model.layers.0.mlp.up_proj", lins["model.layers.0.mlp.up_proj"])
        w.add_file("README.md", source_card)
        w.finish({"architectures": ["LlamaForCausalLM"]}, source="org/source-model")
    card = (out / "README.md").read_text()
    assert "base_model: org/source-model" in card and "from `org/source-model`" in card
    assert card.endswith("## Original model card\n\n# The source model\n\nIts own words.\n")
    # written again over itself (as an overwrite does): the original stays once, our card is not stacked
    with CheckpointWriter(out, overwrite=True) as w:
        w.add_linear("model.layers.0.mlp.up_proj", lins["model.layers.0.mlp.up_proj"])
        w.finish({"architectures": ["LlamaForCausalLM"]}, source="org/source-model")
    again = (out / "README.md").read_text()
    assert again.count("<!-- written by exl3rt -->") == 1 and again.count("Its own words.") == 1 and again == card


def test_model_card_names_a_hub_source_as_it_is_and_a_local_path_by_its_last_part():
    from exl3rt.format.checkpoint_write import card_source

    assert card_source("org/model") == "org/model"
    assert card_source("/home/me/models/Llama-3-8B/") == "Llama-3-8B"
    assert card_source("./Llama-3-8B") == "Llama-3-8B"
    assert card_source("", "src-dir") == "src-dir" and card_source(None) is None
