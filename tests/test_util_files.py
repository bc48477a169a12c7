"""util: our safetensors writer against the safetensors library, atomic publication, temporaries, names."""

import json
import os
import random
import struct
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exl3rt.util import fs, safetensors_io
from exl3rt.util.names import file_name_problem, module_path_problem
from exl3rt.util.safetensors_io import write_safetensors

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.int8, torch.bool, torch.float64, torch.float8_e4m3fn]


def random_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(int(torch.randint(1, 9, (), generator=g))):
        dt = DTYPES[int(torch.randint(0, len(DTYPES), (), generator=g))]
        shape = [int(s) for s in torch.randint(0, 5, (int(torch.randint(0, 4, (), generator=g)),), generator=g)]
        t = (torch.randn(shape, generator=g) * 50).to(dt)
        out[f"t{int(torch.randint(0, 1000, (), generator=g))}.{i}"] = t
    return out


@pytest.mark.parametrize("seed", range(12))
def test_write_safetensors_is_byte_identical_to_the_library(tmp_path, seed):
    tensors = random_tensors(seed)
    meta = {"format": "pt", "note": 'quotes " and ünïcode', "n": str(seed)} if seed % 2 else None
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata=meta)
    size = write_safetensors(tmp_path / "ours.safetensors", tensors, metadata=meta)
    ours, lib = (tmp_path / "ours.safetensors").read_bytes(), (tmp_path / "lib.safetensors").read_bytes()
    assert size == len(ours) == len(lib)
    if meta is None:
        assert ours == lib
    else:   # the library orders metadata keys by a hash map: the same header, keys in another order
        n = struct.unpack("<Q", ours[:8])[0]
        assert struct.unpack("<Q", lib[:8])[0] == n
        assert json.loads(ours[8:8 + n]) == json.loads(lib[8:8 + n])
        assert ours[8 + n:] == lib[8 + n:]


def test_write_safetensors_takes_views_and_device_tensors_and_writes_only_its_path(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_io, "_CHUNK", 7)   # many write calls per tensor
    base = torch.arange(600, dtype=torch.float32).reshape(20, 30)
    tensors = {"view": base[:, 3:17], "t": base.T, "half": base[::2].half()}
    write_safetensors(tmp_path / "x.safetensors", tensors, {"a": "b"})
    assert os.listdir(tmp_path) == ["x.safetensors"]
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"a": "b"}
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v)


def test_write_safetensors_refuses_what_the_format_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="complex"):
        write_safetensors(tmp_path / "x", {"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="metadata"):
        write_safetensors(tmp_path / "x", {"a": torch.zeros(2)}, {"k": 3})


def test_atomic_path_publishes_with_the_mode_and_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "f.bin"
    with fs.atomic_path(target, mode=0o640) as tmp:
        assert stat.S_IMODE(tmp.stat().st_mode) == 0o600   # private while written
        assert fs.is_temp_name(tmp.name) and fs.temp_target(tmp.name) == "f.bin"
        tmp.write_bytes(b"x")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 and target.read_bytes() == b"x"
    with pytest.raises(RuntimeError):
        with fs.atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == ["f.bin"] and target.read_bytes() == b"x"


def test_temp_files_finds_ours_and_the_librarys_but_no_links_or_dirs(tmp_path):
    for name in (".a.safetensors.k2j3h4g5.tmp", ".tmpAb3x_9", "entry.safetensors", ".hidden", "x.tmp"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / ".dir.abcdef12.tmp").mkdir()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(b"keep")
    (tmp_path / ".link.abcdef12.tmp").symlink_to(outside)
    assert [p.name for p in fs.temp_files(tmp_path)] == [".a.safetensors.k2j3h4g5.tmp", ".tmpAb3x_9"]
    assert fs.temp_files(tmp_path, min_age=3600) == []
    assert fs.sweep_temp_files(tmp_path) == 2
    assert outside.read_bytes() == b"keep" and (tmp_path / ".link.abcdef12.tmp").is_symlink()


def _escapes(base: Path, name: str) -> bool:
    p = base / f"{name}.safetensors"
    return os.path.normpath(p).rsplit(os.sep, 1)[0] != str(base) or p.parent != base


def test_a_name_the_check_accepts_never_leaves_the_folder_brute_force():
    """Every string over a small alphabet of dangerous characters, up to length 4: an accepted module path
    always names a file directly inside the folder, and every name with '/', '\\\\', '..' or a bad character is
    refused."""
    base = Path("/x/layers")
    alphabet = "a./\\_- é:"
    rnd = random.Random(0)
    names = {"".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 6))) for _ in range(20000)}
    accepted = 0
    for n in names:
        ok = module_path_problem(n) is None
        if ok:
            accepted += 1
            assert not _escapes(base, n), n
            assert all(seg and set(seg) <= set("a_-") for seg in n.split(".")), n
        else:
            bad = ("/" in n or "\\" in n or ".." in n or n.startswith(".") or n.endswith(".")
                   or not set(n) <= set("a._-"))
            assert bad, n
    assert accepted > 100


@pytest.mark.parametrize("name,ok", [("model-00001-of-00002.safetensors", True), ("model.safetensors", True),
                                     ("../x.safetensors", False), ("/etc/passwd", False), (".hidden", False),
                                     ("a/b.safetensors", False), ("", False), ("x" * 201, False), (3, False)])
def test_shard_file_names(name, ok):
    assert (file_name_problem(name) is None) == ok


def test_a_directory_reads_its_index_else_model_safetensors_alone_else_every_file(tmp_path):
    from exl3rt.util.tensorfiles import TensorFiles

    t = {"a.weight": torch.zeros(2)}
    save_file(t, str(tmp_path / "model.safetensors"))
    save_file({"stray": torch.ones(3)}, str(tmp_path / "reference.safetensors"))
    assert TensorFiles(tmp_path).names() == ["a.weight"]          # what transformers loads too
    (tmp_path / "model.safetensors").unlink()
    assert TensorFiles(tmp_path).names() == ["stray"]
    save_file({"b.weight": torch.zeros(1)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"b.weight": "model-00001-of-00001.safetensors"}}))
    assert TensorFiles(tmp_path).names() == ["b.weight"]
