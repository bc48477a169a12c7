"""exl3rt quantize: HF checkpoint -> EXL3 checkpoint, checked end to end against the original model."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("numba")

from exl3rt.cli.main import main  # noqa: E402
from exl3rt.convert import run as run_mod  # noqa: E402
from exl3rt.convert.run import WORK_DIR  # noqa: E402
from exl3rt.format import Exl3Checkpoint  # noqa: E402

from tiny_models import calibration_text, nonfinite_copy, tiny_llama, tiny_qwen_moe  # noqa: E402


@pytest.fixture(autouse=True)
def _no_encoding_cache(monkeypatch):
    """These tests are about the converter's own work (resumption, crashes, refusals): every layer encoded, no cache
    read (the cache path has its own test)."""
    monkeypatch.setenv("EXL3RT_CACHE_MODE", "off")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama")


def logits_with_exl3_weights(src_dir, exl3_dir, ids, tmp_path):
    """Logits of the original model, and of the same model with every quantized linear replaced by
    its EXL3 reconstruction: written back as a Hugging Face checkpoint and loaded by transformers
    itself (so transformers, not this test, maps per-expert tensors onto its fused MoE parameters)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from exl3rt.util.tensorfiles import TensorFiles

    source = TensorFiles(src_dir)
    ckpt = Exl3Checkpoint(exl3_dir)
    tensors = {n: source.tensor(n) for n in source.names()}
    for info in ckpt.linears():
        name = f"{info.name}.weight"
        if name not in tensors:
            continue  # a head made from tied embeddings: the original model has no such tensor
        out_f, in_f = tensors[name].shape
        w = ckpt.load_linear(info.name).reconstruct(trim=False)[:in_f, :out_f]
        tensors[name] = w.T.contiguous().to(tensors[name].dtype)
    deq = tmp_path / "dequantized"
    shutil.copytree(src_dir, deq, ignore=shutil.ignore_patterns("*.safetensors", "*.json"))
    shutil.copy(src_dir / "config.json", deq / "config.json")
    save_file(tensors, str(deq / "model.safetensors"))
    out = []
    for d in (src_dir, deq):
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        with torch.no_grad():
            out.append(model(ids).logits)
    return out[0], out[1]


def test_quantize_end_to_end(src, tmp_path, capsys):
    out = tmp_path / "exl3"
    assert main(["quantize", str(src), str(out), "--bits", "4", "--bits-for", "*.down_proj=5", "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    # the source's side files (tokenizer, generation config) are carried over byte for byte, weights are not
    side = sorted(p.name for p in src.iterdir() if p.suffix != ".safetensors" and p.name != "config.json")
    assert "tokenizer.json" in side and "generation_config.json" in side
    for name in side:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert not (out / "model.safetensors").exists()
    ckpt = Exl3Checkpoint(out)
    bits = {li.name: li.bits for li in ckpt.linears()}
    assert bits["lm_head"] == 6  # tied embedding -> separate quantized head
    assert bits["model.layers.1.mlp.down_proj"] == 5 and bits["model.layers.0.self_attn.q_proj"] == 4
    assert len(bits) == 2 * 7 + 1
    assert ckpt.linear_info("model.layers.0.mlp.up_proj").out_padded == 256  # 200 padded
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["quant_method"] == "exl3"
    assert "model.embed_tokens.weight" in ckpt.other_tensor_names()
    assert not (out / WORK_DIR).exists()
    # each layer reconstructs its source weight (HF [out, in] transposed) at its bitrate's error level
    from exl3rt.util.tensorfiles import TensorFiles

    source = TensorFiles(src)
    limit = {4: 0.075, 5: 0.04, 6: 0.02}  # Gaussian relative errors are ~0.067, 0.034, 0.017
    for info in ckpt.linears():
        name = "model.embed_tokens.weight" if info.name == "lm_head" else f"{info.name}.weight"
        w = source.tensor(name).float().T
        r = ckpt.load_linear(info.name).reconstruct(trim=False)[: w.shape[0], : w.shape[1]]
        assert float((r - w).norm() / w.norm()) < limit[info.bits], info.name
    ids = torch.randint(3, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    ref, got = logits_with_exl3_weights(src, out, ids, tmp_path)
    assert float((got - ref).norm() / ref.norm()) < 0.2  # errors of 15 layers compound in a random model


def test_resume_after_crash_gives_the_same_checkpoint(src, tmp_path, monkeypatch, capsys):
    full = tmp_path / "full"
    assert main(["quantize", str(src), str(full), "--bits", "3", "--quiet"]) == 0
    real = run_mod.quantize_weight
    calls = {"n": 0}

    def crashing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt  # the user pressed Ctrl-C in the sixth layer
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "quantize_weight", crashing)
    part = tmp_path / "part"
    capsys.readouterr()
    assert main(["quantize", str(src), str(part), "--bits", "3", "--quiet"]) == 130
    assert capsys.readouterr().err == (f"exl3rt: interrupted; 5 finished layer(s) are kept in {part / WORK_DIR}; "
                                       f"run the same command again to resume\n")
    assert not (part / "config.json").exists() and len(list((part / WORK_DIR / "layers").iterdir())) == 5
    monkeypatch.setattr(run_mod, "quantize_weight", real)
    summary = run_mod.convert_checkpoint(src, part, bits=3, progress=False)
    assert (summary["reused"], summary["encoded"]) == (5, 10)
    a, b = Exl3Checkpoint(full), Exl3Checkpoint(part)
    for info in a.linears():
        for k, v in a.load_linear(info.name).state_dict().items():
            assert torch.equal(b.load_linear(info.name).state_dict()[k], v), (info.name, k)


def test_refuses_to_mix_settings_and_to_overwrite(src, tmp_path, monkeypatch):
    part = tmp_path / "p"

    def boom(*a, **k):
        raise RuntimeError("stop")

    monkeypatch.setattr(run_mod, "quantize_weight", boom)
    with pytest.raises(RuntimeError):
        run_mod.convert_checkpoint(src, part, bits=4, progress=False)
    monkeypatch.undo()
    assert main(["quantize", str(src), str(part), "--bits", "3", "--quiet"]) == 1  # different settings
    done = tmp_path / "done"
    assert main(["quantize", str(src), str(done), "--bits", "2", "--quiet"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in done.iterdir()}
    assert main(["quantize", str(src), str(done), "--bits", "2", "--quiet"]) == 1
    assert {p.name: p.stat().st_mtime_ns for p in done.iterdir()} == before


@pytest.mark.parametrize("existing", ["none", "empty", "resumed"])
def test_refused_weight_changes_nothing_on_disk(src, tmp_path, capsys, existing):
    """A NaN in the fourth linear: one error line naming it, status 1, and what the run made is gone — OUT itself
    when the run created it, the work folder when OUT existed (empty) before; a resumed run leaves the work folder
    (another run's layers with the same settings) in place."""
    bad = tmp_path / "bad-src"
    (picked,) = nonfinite_copy(src, bad, lambda names: [n for n in names if n.endswith("_proj.weight")][3:4], at=(0, 1))
    out = tmp_path / "out"
    if existing == "empty":
        out.mkdir()
    before = None
    if existing == "resumed":
        real, calls = run_mod.quantize_weight, {"n": 0}

        def crash_second(*a, **k):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
            return real(*a, **k)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(run_mod, "quantize_weight", crash_second)
            assert main(["quantize", str(bad), str(out), "--bits", "3", "--quiet"]) == 130
        before = sorted(p.name for p in (out / WORK_DIR / "layers").iterdir())
        assert len(before) == 1
    capsys.readouterr()
    assert main(["quantize", str(bad), str(out), "--bits", "3", "--quiet"]) == 1
    err = capsys.readouterr().err
    layer = picked.rsplit(".", 1)[0]
    assert err.startswith(f"exl3rt: error: {layer}: 1 non-finite value(s)") and err.count("\n") == 1
    if existing == "none":
        assert not out.exists()
    elif existing == "empty":
        assert out.is_dir() and not any(out.iterdir())
    else:
        assert set(before) <= {p.name for p in (out / WORK_DIR / "layers").iterdir()}


def test_calibrated_conversion(src, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(calibration_text())
    out = tmp_path / "cal"
    assert main(["quantize", str(src), str(out), "--bits", "3", "--calibrate", str(text), "--calib-rows", "4",
                 "--calib-tokens", "64", "--quiet"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["calibration"]["id"]
    ids = torch.randint(3, 40, (1, 32), generator=torch.Generator().manual_seed(1))
    ref, got = logits_with_exl3_weights(src, out, ids, tmp_path)
    assert float((got - ref).norm() / ref.norm()) < 0.2


def test_moe_experts_become_per_expert_linears(tmp_path):
    src = tiny_qwen_moe(tmp_path / "moe")
    out = tmp_path / "moe-exl3"
    assert main(["quantize", str(src), str(out), "--bits", "4", "--quiet"]) == 0
    ckpt = Exl3Checkpoint(out)
    names = {li.name for li in ckpt.linears()}
    experts = {n for n in names if ".mlp.experts." in n}
    assert experts == {f"model.layers.{l}.mlp.experts.{e}.{p}" for l in range(2) for e in range(4)
                       for p in ("gate_proj", "up_proj", "down_proj")}
    assert "model.layers.0.mlp.gate.weight" in ckpt.other_tensor_names()  # the router stays unquantized
    ids = torch.randint(3, 64, (1, 24), generator=torch.Generator().manual_seed(2))
    ref, got = logits_with_exl3_weights(src, out, ids, tmp_path)
    assert float((got - ref).norm() / ref.norm()) < 0.2


def test_side_files_are_the_non_weight_files(tmp_path):
    """Carried over: tokenizer and template files, a README; not: weights of any format, weight indexes, the configs
    written anew, hidden files, folders."""
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "chat_template.jinja", "merges.txt", "README.md", "config.json", "quantization_config.json",
             "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.pth", "model.gguf", ".gitattributes"]
    for n in names:
        (tmp_path / n).write_text("x")
    (tmp_path / "original").mkdir()
    got = [p.name for p in run_mod.side_files(tmp_path)]
    assert got == ["README.md", "chat_template.jinja", "generation_config.json", "merges.txt",
                   "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def test_quantize_reads_and_publishes_through_the_encoding_cache(src, tmp_path, capsys, monkeypatch):
    """With the cache on, a second conversion of the same model reads every layer (nothing encoded) and writes the
    same codes; the keys are those of online quantization, so quantize_model on the same weights encodes nothing."""
    import exl3rt
    from transformers import AutoModelForCausalLM

    monkeypatch.delenv("EXL3RT_CACHE_MODE")
    cache = tmp_path / "cache"
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["quantize", str(src), str(a), "--bits", "3", "--cache-dir", str(cache), "--quiet"]) == 0
    assert "(15 encoded, 0 from the encoding cache" in capsys.readouterr().out
    assert main(["quantize", str(src), str(b), "--bits", "3", "--cache-dir", str(cache), "--quiet"]) == 0
    assert "(0 encoded, 15 from the encoding cache" in capsys.readouterr().out
    # an export from the cache alone: the same codes; what it lacks stops it before OUT exists
    c = tmp_path / "c"
    assert main(["quantize", str(src), str(c), "--bits", "3", "--cache-dir", str(cache), "--quiet", "--from-cache"]) == 0
    assert "(0 encoded, 15 from the encoding cache" in capsys.readouterr().out
    before = sorted(p.name for p in cache.rglob("*"))
    # (--bits 4 changes every decoder layer; the head keeps --head-bits)
    for args, why in (((str(cache), "--bits", "4"), "14 of 15 layers are not in the encoding cache"),
                      ((str(tmp_path / "empty"), "--bits", "3"), "not in the encoding cache at"),
                      ((str(cache), "--bits", "3", "--bits-for", "*.down_proj=4"), "2 of 15 layers")):
        d = tmp_path / "d"
        assert main(["quantize", str(src), str(d), "--cache-dir", args[0], *args[1:], "--quiet", "--from-cache"]) != 0
        err = capsys.readouterr().err
        assert why in err and "--from-cache" in err and not d.exists(), err
    assert main(["quantize", str(src), str(d), "--bits", "3", "--cache-mode", "off", "--from-cache"]) != 0
    assert "cache" in capsys.readouterr().err and not d.exists()
    assert sorted(p.name for p in cache.rglob("*")) == before          # an export never writes to the cache
    ca, cb, cc = Exl3Checkpoint(a), Exl3Checkpoint(b), Exl3Checkpoint(c)
    for li in ca.linears():
        x, y, z = ca.load_linear(li.name), cb.load_linear(li.name), cc.load_linear(li.name)
        for t in ("trellis", "suh", "svh"):
            assert torch.equal(getattr(x, t), getattr(y, t)) and torch.equal(getattr(x, t), getattr(z, t))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    summary = exl3rt.quantize_model(model, exl3rt.Exl3Config(bits=3, cache_dir=str(cache), progress=False),
                                    progress=False)
    assert summary["misses"] == 0 and summary["hits"] == 14       # every decoder linear (the head stays dense)
