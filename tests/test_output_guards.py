"""Output directories: a write never destroys what it did not make (exl3rt.format.output's rule).

Each case is a reproduction from a hostile-input campaign: OUT equal to, inside or around SRC, inside the encoding
cache, holding files exl3rt did not write, a save killed at each write point. Truth: the tree's bytes, modes and
times before and after (a refusal changes nothing), the files an uninterrupted run writes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl3rt.cli.main import main
from exl3rt.convert import run as run_mod
from exl3rt.format import Exl3Checkpoint
from exl3rt.format.errors import FormatError
from exl3rt.format.random import random_linear
from exl3rt.runtime.export import save_exl3
from exl3rt.util.fs import is_temp_name
from tiny_models import tiny_llama

import save_crash_points
from test_cache_hostile import snapshot as tree     # every name below a folder: type, bytes, link, mode, mtime


def refused(capsys, argv: list[str], match: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and err.startswith("exl3rt: error: "), (rc, err)
    assert match in err, err
    return err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", layers=1)


def sharded_copy(src: Path, dst: Path, shards: int = 4) -> Path:
    """``src`` (one model.safetensors) rewritten as ``shards`` shards with an index, as big models are stored."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    wmap = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        wmap.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return dst


@pytest.fixture
def fake_encoder(monkeypatch):
    """Random codes instead of the encoder (the write paths do not depend on them); use with --cache-mode off."""
    def quantize_weight(w, bits, codebook, *, name, **kwargs):
        lin = random_linear(w.shape[0], w.shape[1], bits, codebook, seed=zlib.crc32(name.encode()))
        lin.info = {"proxy_err": 0.01}
        return lin

    monkeypatch.setattr(run_mod, "quantize_weight", quantize_weight)


def quantize(src: Path, out: Path, *extra: str) -> list[str]:
    return ["quantize", str(src), str(out), "--bits", "2", "--quiet", "--cache-mode", "off", *extra]


# ---- where OUT may be --------------------------------------------------------------------------------------------

def test_foreign_shards_in_out_without_overwrite_are_refused_and_kept(tiny, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    for i in (1, 2):
        (out / f"model-0000{i}-of-00002.safetensors").write_bytes(os.urandom(64))
    before = tree(tmp_path)
    for extra in (["--from-cache"], []):
        refused(capsys, quantize(tiny, out, *extra),
                "not empty (model-00001-of-00002.safetensors, model-00002-of-00002.safetensors)")
        assert tree(tmp_path) == before


@pytest.mark.parametrize("layout", ["4 shards", "one file"])
@pytest.mark.parametrize("where", ["same", "inside", "around", "link"])
def test_out_overlapping_the_source_is_refused_before_anything_is_read(tiny, tmp_path, capsys, layout, where):
    src = sharded_copy(tiny, tmp_path / "src") if layout == "4 shards" else Path(shutil.copytree(tiny, tmp_path / "src"))
    out = {"same": src, "inside": src / "exl3", "around": tmp_path, "link": tmp_path / "link"}[where]
    if where == "link":
        out.symlink_to(src)
    before = tree(tmp_path)
    how = {"same": "is", "inside": "lies inside", "around": "contains", "link": "is"}[where]
    refused(capsys, quantize(src, out, "--overwrite"), f"the output directory {how} the source model")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("how", ["--cache-dir", "EXL3RT_CACHE_DIR"])
def test_out_inside_the_encoding_cache_is_refused(tiny, tmp_path, capsys, monkeypatch, how):
    cache = tmp_path / "cache"
    (cache / "v1" / "4a").mkdir(parents=True)
    (cache / "v1" / "4a" / "entry.safetensors").write_bytes(b"cached codes")
    extra = ["--cache-dir", str(cache)] if how == "--cache-dir" else []
    if how == "EXL3RT_CACHE_DIR":
        monkeypatch.setenv("EXL3RT_CACHE_DIR", str(cache))
    before = tree(tmp_path)
    for out in (cache / "v1" / "4a", cache):
        assert main(["quantize", str(tiny), str(out), "--bits", "2", "--quiet", *extra]) == 1
        err = capsys.readouterr().err
        assert "the encoding cache" in err and err.count("\n") == 1, err
        assert tree(tmp_path) == before


def test_a_file_put_inside_the_cache_by_hand_is_never_verified_away_or_pruned(tmp_path, capsys):
    cache = tmp_path / "cache"
    (cache / "v1" / "4a").mkdir(parents=True)
    (cache / "v1" / "4a" / "model-00001-of-00001.safetensors").write_bytes(b"a user's shard")
    before = tree(tmp_path)
    for argv in (["cache", "verify", "--root", str(cache), "--delete-invalid"],
                 ["cache", "prune", "--root", str(cache), "--max-size", "0", "--older-than", "0s"]):
        main(argv)
        capsys.readouterr()
        assert (cache / "v1" / "4a" / "model-00001-of-00001.safetensors").read_bytes() == b"a user's shard"
    assert {k: v[1] for k, v in tree(tmp_path).items()} == {k: v[1] for k, v in before.items()}


def test_save_exl3_into_the_encoding_cache_or_the_models_own_directory_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("EXL3RT_CACHE_DIR", str(cache))
    model = save_crash_points.tiny_model()
    src = tmp_path / "loaded-from"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"the original weights")
    model.name_or_path = str(src)
    before = tree(tmp_path)
    for out, what in ((cache / "v1", "the encoding cache"), (src, "the directory the model was loaded from")):
        with pytest.raises(FormatError, match=what):
            save_exl3(model, out, overwrite=True, progress=False)
        assert tree(tmp_path) == before


# ---- what --overwrite may replace ---------------------------------------------------------------------------------

def test_overwrite_replaces_the_checkpoint_and_keeps_every_other_file(tiny, tmp_path, capsys, fake_encoder, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(run_mod, "CheckpointWriter", _small_shards(run_mod.CheckpointWriter))
    assert main(quantize(tiny, out)) == 0
    first = {p.name for p in out.iterdir()}
    assert len([n for n in first if n.startswith("model-")]) > 1
    manifest = json.loads((out / "quantization_config.json").read_text())["files"]
    assert set(manifest) == first, "the manifest lists exactly what the write published"
    (out / "notes.txt").write_text("mine")
    (out / "extra").mkdir()
    (out / "extra" / "model-00001-of-00001.safetensors").write_bytes(b"not at the top level: never touched")
    kept = {k: v for k, v in tree(out).items() if k.startswith(("notes", "extra"))}
    monkeypatch.undo()
    refused(capsys, quantize(tiny, out, "--bits", "3"), "not empty (README.md, config.json, extra, generation_config")
    assert main(quantize(tiny, out, "--bits", "3", "--overwrite")) == 0
    after = {p.name for p in out.iterdir()}
    assert sorted(n for n in after if n.startswith("model-")) == ["model-00001-of-00001.safetensors"]
    assert {k: v for k, v in tree(out).items() if k.startswith(("notes", "extra"))} == kept
    assert after == first - {n for n in first if n.startswith("model-")} | {"model-00001-of-00001.safetensors",
                                                                             "notes.txt", "extra"}
    assert {li.bits for li in Exl3Checkpoint(out).linears()} == {3, 6}


def _small_shards(cls):
    def make(*a, **k):
        k["max_shard_bytes"] = 30_000
        return cls(*a, **k)
    return make


def test_overwrite_refuses_to_replace_a_file_exl3rt_did_not_write(tiny, tmp_path, capsys, fake_encoder):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("somebody else's tokenizer")
    (out / "config.json").write_text("{}")
    before = tree(tmp_path)
    refused(capsys, quantize(tiny, out, "--overwrite"), "would replace tokenizer.json, which exl3rt did not write")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("foreign", ["model.safetensors", "pytorch_model.bin"])
def test_weights_of_another_layout_are_refused_by_quantize_and_save(tiny, tmp_path, capsys, fake_encoder, foreign):
    out = tmp_path / "out"
    out.mkdir()
    (out / foreign).write_bytes(b"other weights")
    before = tree(tmp_path)
    refused(capsys, quantize(tiny, out, "--overwrite"), f"holds weights of another layout ({foreign})")
    with pytest.raises(FormatError, match=rf"holds weights of another layout \({foreign}\)"):
        save_exl3(save_crash_points.tiny_model(), out, overwrite=True, progress=False)
    assert tree(tmp_path) == before


def test_save_pretrained_replaces_its_own_files_and_keeps_the_rest(tmp_path, monkeypatch):
    """An online-quantized model: save_pretrained writes, then writes again over itself (fewer shards), never into
    the directory it was loaded from, and keeps a file it did not write."""
    import exl3rt
    import exl3rt.integrations.transformers  # noqa: F401  (registers the method)
    from transformers import AutoModelForCausalLM

    src = tiny_llama(tmp_path / "src", layers=1)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, quantization_config=exl3rt.Exl3Config(
        bits=2, cache_dir=str(tmp_path / "cache"), progress=False))
    before = tree(src)
    with pytest.raises(FormatError, match="the directory the model was loaded from"):
        model.save_pretrained(str(src))
    assert tree(src) == before
    out = tmp_path / "out"
    model.save_pretrained(str(out), max_shard_size=20_000)
    many = sorted(p.name for p in out.glob("model-*"))
    assert len(many) > 1 and (out / "generation_config.json").is_file()
    (out / "notes.txt").write_text("mine")
    model.save_pretrained(str(out))
    assert sorted(p.name for p in out.glob("model-*")) == ["model-00001-of-00001.safetensors"]
    assert (out / "notes.txt").read_text() == "mine"
    assert not any(is_temp_name(p.name) for p in out.iterdir())


# ---- a killed save -------------------------------------------------------------------------------------------------

def test_a_save_killed_at_every_write_point_is_swept_and_redone_by_the_next_save(tmp_path):
    status, events = save_crash_points.run_child(tmp_path / "reference", None, tmp_path)
    assert status == 0 and len(events) >= 12, events
    assert {e.split(" ")[0] for e in events} == {"mid-write", "written", "renamed"}
    reference = tree(tmp_path / "reference")
    for i in range(len(events)):
        out = tmp_path / f"out-{i}"
        status, _ = save_crash_points.run_child(out, i, tmp_path)
        assert status == -9, (i, events[i], status)
        done = any(e == "renamed config.json" for e in events[: i + 1])
        assert (out / "config.json").exists() == done, (i, events[i])    # nothing half-written looks complete
        status, _ = save_crash_points.run_child(out, None, tmp_path)
        assert status == 0
        got = tree(out)
        assert sorted(got) == sorted(reference), (i, events[i], sorted(set(got) ^ set(reference)))
        assert all(got[n][1] == reference[n][1] for n in got), (i, events[i])


# ---- errors name the file ----------------------------------------------------------------------------------------

def test_a_full_disk_names_the_file_and_leaves_no_checkpoint(tmp_path, capsys, monkeypatch):
    import exl3rt.format.checkpoint_write as cw

    def full(path, tensors, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cw, "write_safetensors", full)
    out = tmp_path / "ex"
    err = refused(capsys, ["example", str(out)], "No space left on device")
    assert str(out / "part-00001.safetensors.partial") in err
    assert list(out.iterdir()) == []


def test_a_name_too_long_names_the_option(tmp_path, capsys):
    long = str(tmp_path / ("x" * 601))
    for argv, option in ((["example", long], "OUT"), (["quantize", str(tmp_path), long], "OUT"),
                         (["generate", "--model", long], "--model")):
        err = refused(capsys, argv, "File name too long")
        assert err.startswith(f"exl3rt: error: {option} ") and f"({len(long)} characters)" in err and len(err) < 400, err
