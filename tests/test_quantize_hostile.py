"""exl3rt quantize against hostile checkpoints and hard kills: names never become paths outside OUT, and a
rerun after a SIGKILL at any write point finishes with the same checkpoint as an uninterrupted run."""

import json
import stat

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("numba")

from exl3rt.cli.main import main  # noqa: E402
from exl3rt.convert.run import WORK_DIR, convert_checkpoint  # noqa: E402
from exl3rt.format import Exl3Checkpoint, write_checkpoint  # noqa: E402
from exl3rt.format.random import random_linear  # noqa: E402
from exl3rt.util.fs import is_temp_name  # noqa: E402
from exl3rt.util.safetensors_io import write_safetensors  # noqa: E402

import crash_points  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def _no_encoding_cache(monkeypatch):
    """These tests are about the converter's own work (resumption, crashes, refusals): every layer encoded, no cache
    read (the cache path has its own test)."""
    monkeypatch.setenv("EXL3RT_CACHE_MODE", "off")


def snapshot(root):
    """Every path below ``root`` with its bytes (files) or None (directories)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def hostile_source(path, name):
    """A one-linear 'model' whose tensor has the given name, plus a plain norm."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    write_safetensors(path / "model.safetensors", {name: torch.randn(128, 128).to(torch.bfloat16),
                                                   "model.norm.weight": torch.ones(128)})
    return path


@pytest.mark.parametrize("name", [
    "../../../x.weight",
    "/abs/path/x.weight",
    "{victim}/model-00001-of-00002.weight",
    "model.layers.0..mlp.weight",
    "model.layers.0.mlp\\up.weight",
    "model.layers.0.mlp up.weight",
])
def test_a_hostile_tensor_name_is_refused_and_nothing_is_written(tmp_path, capsys, name):
    victim = tmp_path / "victim-model"
    victim.mkdir()
    (victim / "model-00001-of-00002.safetensors").write_bytes(b"another model's shard")
    name = name.format(victim=victim)
    src = hostile_source(tmp_path / "src", name)
    out = tmp_path / "nest" / "deeper" / "out"
    before = snapshot(tmp_path)
    assert main(["quantize", str(src), str(out), "--bits", "2", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"exl3rt: error: tensor {name!r}") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before     # OUT not created, the other model's shard as it was


def test_an_index_naming_a_shard_outside_the_directory_is_refused(tmp_path, capsys):
    src = hostile_source(tmp_path / "src", "model.layers.0.mlp.up_proj.weight")
    (tmp_path / "elsewhere.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    index = {"weight_map": {"model.layers.0.mlp.up_proj.weight": "../elsewhere.safetensors",
                            "model.norm.weight": "model.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    before = snapshot(tmp_path)
    assert main(["quantize", str(src), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "'../elsewhere.safetensors'" in err and "model.layers.0.mlp.up_proj.weight" in err and err.count("\n") == 1
    assert snapshot(tmp_path) == before


def test_inspect_refuses_a_checkpoint_with_a_hostile_name(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ok", {"model.layers.0.mlp.up_proj": random_linear(128, 128, 2, seed=1)})
    tensors = {n.replace("model.layers.0", "../../x"): Exl3Checkpoint(ckpt).tensor(n)
               for n in Exl3Checkpoint(ckpt).tensor_names()}
    bad = tmp_path / "bad"
    bad.mkdir()
    write_safetensors(bad / "model.safetensors", tensors)
    (bad / "config.json").write_text((ckpt / "config.json").read_text())
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("exl3rt: error: tensor '../../x.mlp.up_proj.") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------ kills
@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama", layers=1)


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory):
    """An uninterrupted run (in a child, with the event list) and its files."""
    scratch = tmp_path_factory.mktemp("reference")
    status, events = crash_points.run_child(src, scratch / "out", 2, None, scratch)
    assert status == 0
    return events, crash_points.tree(scratch / "out")


def test_the_uninterrupted_run_leaves_only_the_checkpoint(reference):
    events, files = reference
    assert not any(is_temp_name(n.rsplit("/", 1)[-1]) or n.startswith(WORK_DIR) for n in files)
    modes = {stat.S_IMODE(m) for m, _ in files.values()}
    assert len(modes) == 1, f"shards and configs got different permission bits: {sorted(map(oct, modes))}"
    kinds = {e.split(" ")[0] for e in events}
    assert kinds == {"mid-write", "written", "renamed", "cleanup"}, kinds


def test_a_rerun_after_a_kill_at_every_write_point_recovers(src, reference, tmp_path):
    events, files = reference
    assert len(crash_points.one_of_each_kind(events)) >= 12, events
    for i in range(len(events)):
        out = tmp_path / f"out-{i}"
        status, _ = crash_points.run_child(src, out, 2, i, tmp_path)
        assert crash_points.killed(status), f"the child was not killed at event {i} ({events[i]}): {status}"
        summary = crash_points.check_recovery(src, out, 2, files, tmp_path)
        config_done = any(e == "renamed config.json" for e in events[: i + 1])
        assert summary.get("completed_before", False) == config_done, (i, events[i], summary)


def test_a_second_run_into_the_same_out_is_refused_while_the_first_holds_the_lock(src, tmp_path, capsys):
    import filelock

    out = tmp_path / "out"
    (out / WORK_DIR).mkdir(parents=True)
    with filelock.FileLock(str(out / WORK_DIR / "lock"), timeout=0):
        assert main(["quantize", str(src), str(out), "--bits", "2", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "another exl3rt quantize is writing here" in err and err.count("\n") == 1
    assert not (out / "config.json").exists()


def test_overwrite_replaces_a_checkpoint_with_fewer_shards_and_leaves_no_stale_one(src, tmp_path, monkeypatch):
    from exl3rt.convert import run as run_mod

    def quantize_weight(w, bits, codebook, *, name, **kwargs):
        lin = random_linear(w.shape[0], w.shape[1], bits, codebook, seed=len(name))
        lin.info = {"proxy_err": 0.01}
        return lin

    monkeypatch.setattr(run_mod, "quantize_weight", quantize_weight)
    out = tmp_path / "out"
    convert_checkpoint(src, out, bits=2, progress=False, max_shard_bytes=20_000)
    many = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(many) > 1
    convert_checkpoint(src, out, bits=3, progress=False, overwrite=True)
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert {li.bits for li in Exl3Checkpoint(out).linears()} == {3, 6}
