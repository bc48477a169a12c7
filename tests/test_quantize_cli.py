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

from tiny_models import calibration_text, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama")


def logits_with_exl3_weights(src_dir, exl3_dir, ids):
    """Run the original HF model with every quantized linear replaced by its EXL3 reconstruction."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(ids).logits
    ckpt = Exl3Checkpoint(exl3_dir)
    modules = dict(model.named_modules())
    for info in ckpt.linears():
        lin = modules[info.name]
        enc = ckpt.load_linear(info.name)
        w = enc.reconstruct(trim=False)[: lin.in_features, : lin.out_features]
        lin.weight = torch.nn.Parameter(w.T.contiguous(), requires_grad=False)
    with torch.no_grad():
        return ref, model(ids).logits


def test_quantize_end_to_end(src, tmp_path, capsys):
    out = tmp_path / "exl3"
    assert main(["quantize", str(src), str(out), "--bits", "4", "--bits-for", "*.down_proj=5", "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
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
    ref, got = logits_with_exl3_weights(src, out, ids)
    assert float((got - ref).norm() / ref.norm()) < 0.2  # errors of 15 layers compound in a random model


def test_resume_after_crash_gives_the_same_checkpoint(src, tmp_path, monkeypatch):
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
    with pytest.raises(KeyboardInterrupt):
        main(["quantize", str(src), str(part), "--bits", "3", "--quiet"])
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


def test_calibrated_conversion(src, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(calibration_text())
    out = tmp_path / "cal"
    assert main(["quantize", str(src), str(out), "--bits", "3", "--calibrate", str(text), "--calib-rows", "4",
                 "--calib-tokens", "64", "--quiet"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["calibration"]["id"]
    ids = torch.randint(3, 40, (1, 32), generator=torch.Generator().manual_seed(1))
    ref, got = logits_with_exl3_weights(src, out, ids)
    assert float((got - ref).norm() / ref.norm()) < 0.2
