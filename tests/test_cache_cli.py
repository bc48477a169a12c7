"""`exl3rt cache ls | stats | verify | prune` on a small cache in tmp_path."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest
import torch

from exl3rt.cache import CacheKey, EncodingCache
from exl3rt.cli.cache import parse_age, parse_size
from exl3rt.cli.main import main
from exl3rt.format.random import random_linear


def _encode():
    enc = random_linear(128, 256, 2)
    enc.info["proxy_err"] = 0.25
    return enc


@pytest.fixture
def populated(tmp_path):
    cache = EncodingCache(tmp_path / "c", "readwrite")
    paths = []
    for i in range(3):
        w = torch.randn(256, 128, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        paths.append(cache.load_or_encode(CacheKey.for_weight(w, bits=2), _encode).path)
        t = time.time() - i * 86400 - 60
        os.utime(paths[-1], (t, t))
    return cache, paths


def test_ls_and_stats(populated, capsys):
    cache, paths = populated
    assert main(["cache", "ls", "--root", str(cache.root)]) == 0
    text = capsys.readouterr().out
    assert all(p.name[:16] in text for p in paths) and "128x256 K=2 mcg" in text and "3 entries" in text
    assert main(["cache", "ls", "--root", str(cache.root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["path"] for r in rows) == sorted(map(str, paths))
    assert all(r["proxy_err"] == 0.25 and r["key"]["bits"] == 2 for r in rows)
    assert main(["cache", "stats", "--root", str(cache.root), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["entries"] == 3 and s["bytes"] == sum(p.stat().st_size for p in paths)


def test_root_from_environment(populated, monkeypatch, capsys):
    cache, _ = populated
    monkeypatch.setenv("EXL3RT_CACHE_DIR", str(cache.root))
    assert main(["cache", "stats"]) == 0
    assert "entries          3" in capsys.readouterr().out


def test_verify_exit_status_and_delete(populated, capsys):
    cache, paths = populated
    assert main(["cache", "verify", "--root", str(cache.root)]) == 0
    assert "3 of 3 entries valid" in capsys.readouterr().out
    paths[1].write_bytes(paths[1].read_bytes()[:100])
    assert main(["cache", "verify", "--root", str(cache.root)]) == 1
    out = capsys.readouterr().out
    assert f"INVALID {paths[1]}" in out and "--delete-invalid" in out and paths[1].exists()
    assert main(["cache", "verify", "--root", str(cache.root), "--delete-invalid"]) == 1
    assert "(deleted)" in capsys.readouterr().out and not paths[1].exists()
    assert main(["cache", "verify", "--root", str(cache.root)]) == 0


def test_prune(populated, capsys):
    cache, paths = populated  # ages ~1 min, 1 day, 2 days
    assert main(["cache", "prune", "--root", str(cache.root), "--older-than", "12h", "--dry-run"]) == 0
    assert "would remove 2 entries" in capsys.readouterr().out and all(p.exists() for p in paths)
    assert main(["cache", "prune", "--root", str(cache.root), "--older-than", "36h"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out and not paths[2].exists()
    assert main(["cache", "prune", "--root", str(cache.root), "--max-size", str(paths[0].stat().st_size)]) == 0
    assert not paths[1].exists() and paths[0].exists()
    assert main(["cache", "prune", "--root", str(cache.root), "--max-size", "0"]) == 0
    assert main(["cache", "ls", "--root", str(cache.root)]) == 0
    assert "no cache entries" in capsys.readouterr().out


def test_sizes_ages_and_bad_arguments(tmp_path, capsys):
    assert parse_size("20G") == 20 * 10**9 and parse_size("500M") == 500 * 10**6
    assert parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("1024") == 1024 and parse_size("0") == 0
    assert parse_age("7d") == 7 * 86400 and parse_age("12h") == 43200 and parse_age("30m") == 1800
    for bad in ("lots", "-1G", "5X"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            parse_size(bad)
    with pytest.raises(SystemExit) as e:
        main(["cache", "prune", "--root", str(tmp_path), "--older-than", "soon"])
    assert e.value.code == 2 and "not an age; use e.g. 7d" in capsys.readouterr().err


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        main(["cache", "--help"])
    text = capsys.readouterr().out
    assert "exl3rt cache prune --older-than 30d" in text and "EXL3RT_CACHE_DIR" in text
    assert main(["cache"]) == 2
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "cache" in capsys.readouterr().out
