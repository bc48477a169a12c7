"""Bad input to every ``exl3rt`` sub-command ends in one line on stderr and status 1 (argparse's usage error,
status 2, for a value no option takes) — never a traceback — and leaves the disk as it was.

Most cases fail before any model loads (the loaders are replaced by ones that fail the test if called); the few
that need transformers to find the problem use a one-layer tiny model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exl3rt.cli import evaluate, generate
from exl3rt.cli.main import main

pytest.importorskip("transformers")


# ---- helpers ----------------------------------------------------------------------------------------------

def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:         # argparse's usage errors and --help
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_error_line(rc: int, err: str, match: str = "") -> str:
    """Status 1 and exactly one ``exl3rt: error:`` line on stderr (matching ``match``); returns it."""
    assert "Traceback" not in err, err
    assert rc == 1, (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("exl3rt: error: "), err
    assert re.search(match, lines[0]), (match, lines[0])
    return lines[0]


def assert_usage_error(rc: int, err: str, match: str) -> None:
    """argparse's usage error: status 2, the last line names the option."""
    assert "Traceback" not in err, err
    assert rc == 2, (rc, err)
    last = err.strip().splitlines()[-1]
    assert re.match(r"exl3rt( \w+)*: error: ", last) and re.search(match, last), (match, last)


def snapshot(path: Path) -> dict[str, str]:
    """Every file under ``path`` with its content digest (and nothing else there)."""
    if not path.exists():
        return {}
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


@pytest.fixture
def no_load(monkeypatch):
    """generate / eval must not load a model: a case that reaches the loader fails the test."""
    def never(*a, **k):
        raise AssertionError("a model was loaded for input that should have been refused before")

    for mod in (generate, evaluate):
        monkeypatch.setattr(mod, "load", never)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tiny_models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("errs") / "tiny", layers=1)


def _copy(tiny: Path, dst: Path) -> Path:
    shutil.copytree(tiny, dst)
    return dst


def _truncate(d: Path) -> None:
    st = d / "model.safetensors"
    os.truncate(st, st.stat().st_size // 2)


def _garbage(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + bytes(64))


def _config(text: str):
    return lambda d: (d / "config.json").write_text(text)


def _index_missing_shard(d: Path) -> None:
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))


def _dangling_shard(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(d / "gone.safetensors")


def _shard_is_a_directory(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


# name -> (how the copy of the tiny model is spoiled, or a non-model path; the error line's pattern)
BAD_MODELS = {
    "missing": (None, r"--model \S+missing: no such directory"),
    "empty dir": ("empty", r"not a Hugging Face model directory \(no config.json\)"),
    "non-model dir": ("junk", r"not a Hugging Face model directory \(no config.json\)"),
    "a file": ("file", r"not a directory; point --model at a Hugging Face model directory"),
    "truncated safetensors": (_truncate, r"^exl3rt: error: [\w.]+: cut off in \S*model.safetensors .*the file is truncated"),
    "garbage safetensors": (_garbage, r"model.safetensors: not a readable safetensors file"),
    "config not JSON": (_config("{'hidden_size': 128"), r"config.json: invalid JSON"),
    "config a JSON list": (_config("[1, 2]"), r"config.json: expected a JSON object"),
    "index names a missing shard": (_index_missing_shard, r"shard 'model-00002-of-00002.safetensors' is listed but "
                                                          r"missing"),
    "dangling shard link": (_dangling_shard, r"model.safetensors: not a readable safetensors file"),
    "shard is a directory": (_shard_is_a_directory, r"model.safetensors: not a readable safetensors file"),
    "no weights": (_no_weights, r"no .safetensors files"),
}


def bad_model(tiny: Path, tmp_path: Path, case: str) -> Path:
    how = BAD_MODELS[case][0]
    path = tmp_path / case.replace(" ", "-")
    if how is None:
        return path
    if how == "empty":
        path.mkdir()
    elif how == "junk":
        path.mkdir()
        (path / "notes.txt").write_text("not a model")
    elif how == "file":
        path.write_text("not a directory")
    else:
        how(_copy(tiny, path))
    return path


# ---- generate / eval: refused before anything loads --------------------------------------------------------

@pytest.mark.parametrize("case", list(BAD_MODELS))
@pytest.mark.parametrize("cmd", ["generate", "eval"])
def test_bad_model_directory_is_one_line_before_the_load(cmd, case, tiny, tmp_path, capsys, no_load):
    path = bad_model(tiny, tmp_path, case)
    before = snapshot(path)
    rc, _, err = run(capsys, [cmd, "--model", str(path), "--cache-dir", str(tmp_path / "cache"), "--quiet"])
    assert_error_line(rc, err, BAD_MODELS[case][1])
    assert snapshot(path) == before and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_generate_empty_prompt_refused_before_the_model_is_looked_for(prompt, tmp_path, capsys, monkeypatch, no_load):
    def never(*a, **k):
        raise AssertionError("the model was looked for before the prompt was checked")

    monkeypatch.setattr(generate, "model_path", never)
    rc, _, err = run(capsys, ["generate", "--prompt", prompt, "--cache-dir", str(tmp_path / "c")])
    assert_error_line(rc, err, r"--prompt is empty")
    assert not (tmp_path / "c").exists()


def test_eval_text_file_problems(tiny, tmp_path, capsys, no_load):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81 not utf-8")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n\t ")
    for path, pattern in ((binary, r"--text \S+binary.txt: not UTF-8 text"),
                          (empty, r"--text \S+empty.txt: the file holds no text to score"),
                          (blank, r"--text \S+blank.txt: the file holds no text to score")):
        rc, _, err = run(capsys, ["eval", "--model", str(tiny), "--text", str(path)])
        assert_error_line(rc, err, pattern)
    for path in (tmp_path, tmp_path / "missing.txt"):       # a directory, a missing file: argparse
        rc, _, err = run(capsys, ["eval", "--model", str(tiny), "--text", str(path)])
        assert_usage_error(rc, err, r"argument --text: .*: no such file")


def test_bits_16_is_the_unquantized_model(monkeypatch, tiny, capsys):
    """``--bits 16`` loads the unquantized model: generate's one load, and eval's baseline row (once, however
    often it is asked for); repeated bitrates are scored once."""
    from types import SimpleNamespace

    from exl3rt.cli._args import UsageError

    loads: list = []

    def fake_load(args, path, bits):
        loads.append(bits)
        return SimpleNamespace(model=None, tokenizer=None, seconds=0.0, bits=bits, summary={}, stored=False)

    monkeypatch.setattr(evaluate, "load", fake_load)
    monkeypatch.setattr(evaluate, "describe_load", lambda ld: "loaded")
    import exl3rt.evaluation as ev
    monkeypatch.setattr(ev, "perplexity", lambda *a, **k: SimpleNamespace(ppl=10.0, tokens=5))
    for argv, want in ((["--bits", "3", "16", "3"], [None, 3]), (["--bits", "16", "--no-baseline"], [None]),
                       (["--bits", "2", "16", "--no-baseline"], [None, 2]), (["--bits", "2", "--no-baseline"], [2])):
        loads.clear()
        rc, out, _ = run(capsys, ["eval", "--model", str(tiny), *argv, "--json"])
        assert rc == 0 and loads == want, argv
        assert [r["bits"] for r in json.loads(out)["rows"]] == want

    def stop(args, path, bits):
        loads.append(bits)
        raise UsageError("stop")

    monkeypatch.setattr(generate, "load", stop)
    loads.clear()
    rc, _, err = run(capsys, ["generate", "--model", str(tiny), "--bits", "16"])
    assert loads == [None] and rc == 1 and err == "exl3rt: error: stop\n"


def test_a_safetensors_error_past_the_header_check_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """A file that goes bad between the header check and the load (safetensors' own error, raised inside
    transformers) is still one line, status 1."""
    from safetensors import SafetensorError

    def corrupt(*a, **k):
        raise SafetensorError("Error while deserializing header: incomplete metadata, file not fully covered")

    monkeypatch.setattr(generate, "load", corrupt)
    rc, _, err = run(capsys, ["generate", "--model", str(tiny), "--cache-dir", str(tmp_path / "c")])
    assert_error_line(rc, err, r"^exl3rt: error: Error while deserializing header: incomplete metadata")


def test_bad_environment_variable_is_one_line(tmp_path, capsys, monkeypatch, no_load):
    monkeypatch.setenv("EXL3RT_LOG_LEVEL", "chatty")
    rc, _, err = run(capsys, ["inspect", str(tmp_path)])
    assert_error_line(rc, err, r"EXL3RT_LOG_LEVEL='chatty': expected one of DEBUG")


# ---- generate / eval: problems only transformers finds (a few real, tiny loads) ---------------------------

def _spoil_config(tiny: Path, dst: Path, **changes) -> Path:
    _copy(tiny, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _without_tokenizer(tiny: Path, dst: Path) -> Path:
    _copy(tiny, dst)
    for p in dst.iterdir():
        if p.name.startswith("tokenizer") or p.name == "special_tokens_map.json":
            p.unlink()
    return dst


def test_config_transformers_cannot_use(tiny, tmp_path, capsys):
    for changes, pattern in (({"model_type": None}, r"transformers cannot use its config.json: Unrecognized model"),
                             ({"model_type": "no-such-arch"}, r"cannot use its config.json: .*no-such-arch")):
        path = _spoil_config(tiny, tmp_path / f"m{len(pattern)}", **changes)
        rc, _, err = run(capsys, ["generate", "--model", str(path), "--cache-dir", str(tmp_path / "c"), "--quiet"])
        assert_error_line(rc, err, pattern)
    path = _without_tokenizer(tiny, tmp_path / "notok")
    rc, _, err = run(capsys, ["eval", "--model", str(path), "--cache-dir", str(tmp_path / "c"), "--quiet"])
    assert_error_line(rc, err, r"--model \S+notok: no usable tokenizer")
    assert not (tmp_path / "c").exists()


def test_checkpoint_that_does_not_match_its_config(tiny, tmp_path, capsys):
    """Shapes that contradict config.json: the first mismatching tensor, named (an unquantized load: a quantized
    one reports the same, after encoding the layers)."""
    path = _spoil_config(tiny, tmp_path / "wide", hidden_size=256)
    rc, _, err = run(capsys, ["generate", "--model", str(path), "--bits", "16", "--quiet", "--max-new-tokens", "1"])
    assert_error_line(rc, err, r"the checkpoint does not match its config.json: model.embed_tokens.weight is "
                               r"\[64, 128\] in the checkpoint, \[64, 256\] by config.json \(and \d+ more\)")


def test_checkpoint_missing_selected_weights(tiny, tmp_path, capsys):
    """Linears the quantized load selected but the checkpoint lacks: one line naming them (only q_proj is left, so
    the load encodes one layer before it finds out)."""
    from safetensors.torch import load_file, save_file

    path = _copy(tiny, tmp_path / "holes")
    tensors = load_file(str(path / "model.safetensors"))
    gone = sorted(n for n in tensors if n.endswith("_proj.weight") and "q_proj" not in n)
    for n in gone:
        del tensors[n]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = run(capsys, ["generate", "--model", str(path), "--bits", "2", "--cache-dir", str(tmp_path / "c"),
                              "--quiet", "--max-new-tokens", "1"])
    line = assert_error_line(rc, err, rf"--model \S+holes: {len(gone)} selected weight\(s\) were not in the "
                                      rf"checkpoint")
    assert all(n in line for n in gone[:5])


def test_a_real_process_prints_one_line(tiny, tmp_path):
    """The console entry point end to end: a truncated checkpoint is one stderr line and status 1 (no traceback
    from transformers), an empty prompt too."""
    bad = _copy(tiny, tmp_path / "bad")
    _truncate(bad)
    for extra in ([], ["--prompt", ""]):
        model = str(bad if not extra else tiny)
        proc = subprocess.run([sys.executable, "-m", "exl3rt.cli.main", "generate", "--model", model, "--quiet",
                               "--cache-dir", str(tmp_path / "c"), *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("exl3rt: error: "), proc.stderr
    assert not (tmp_path / "c").exists()


# ---- quantize ---------------------------------------------------------------------------------------------

QUANTIZE_SRC_CASES = {
    "missing": (None, r"missing: no such file or directory"),
    "empty dir": ("empty", r"no .safetensors files"),
    "non-model dir": ("junk", r"no .safetensors files"),
    "a file": ("file", r"expected a model directory or a .safetensors file"),
    "truncated safetensors": (_truncate, r"cut off in \S*model.safetensors .*the file is truncated"),
    "garbage safetensors": (_garbage, r"not a readable safetensors file"),
    "config not JSON": (_config("{oops"), r"config.json: invalid JSON"),
    "index names a missing shard": (_index_missing_shard, r"is listed but missing"),
    "dangling shard link": (_dangling_shard, r"not a readable safetensors file"),
}


@pytest.mark.parametrize("case", list(QUANTIZE_SRC_CASES))
def test_quantize_bad_source_writes_nothing(case, tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(BAD_MODELS, case, QUANTIZE_SRC_CASES[case])
    src = bad_model(tiny, tmp_path, case)
    before = snapshot(src)
    out = tmp_path / "out"
    rc, _, err = run(capsys, ["quantize", str(src), str(out), "--bits", "2", "--quiet"])
    assert_error_line(rc, err, QUANTIZE_SRC_CASES[case][1])
    assert not out.exists() and snapshot(src) == before


def test_quantize_bad_options_write_nothing(tiny, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = tmp_path / "out"
    cases = [
        (["--bits", "2.5"], r"--bits 2.5: half-integer bitrates need --codebook mul1"),
        (["--head-bits", "1.5"], r"--head-bits 1.5: half-integer bitrates need --codebook mul1"),
        (["--bits-for", "*.down_proj=4.5"], r"--bits-for \*.down_proj=4.5: unsupported bitrate"),
        (["--bits-for", "down_proj"], r"--bits-for 'down_proj': expected PATTERN=K"),
        (["--bits-for", "*.down_proj=2.5"], r"down_proj: K = 2.5 \(half-integer\) needs --codebook mul1"),
    ]
    for extra, pattern in cases:
        rc, _, err = run(capsys, ["quantize", str(tiny), str(out), "--quiet", *extra])
        assert_error_line(rc, err, pattern)
        assert not out.exists(), extra
    for dst, pattern in ((blocker, r"OUT \S+a-file: exists and is not a directory"),
                         (blocker / "sub", r"OUT \S+sub: lies under \S+a-file, which is not a directory")):
        rc, _, err = run(capsys, ["quantize", str(tiny), str(dst), "--quiet"])
        assert_error_line(rc, err, pattern)
    assert blocker.read_text() == "x"
    for extra, pattern in ((["--bits", "16"], r"argument --bits: 16 \(unquantized\) is not a bitrate this option"),
                           (["--bits", "inf"], r"argument --bits: 'inf' is not a bitrate"),
                           (["--head-bits", "17"], r"argument --head-bits: '17' is not a bitrate"),
                           (["--calib-tokens", "1"], r"argument --calib-tokens: 1 is too small"),
                           (["--seed", "x"], r"argument --seed: invalid int value")):
        rc, _, err = run(capsys, ["quantize", str(tiny), str(out), "--quiet", *extra])
        assert_usage_error(rc, err, pattern)
    assert not out.exists()


def test_quantize_into_its_own_source_is_refused(tiny, tmp_path, capsys):
    src = _copy(tiny, tmp_path / "src")
    before = snapshot(src)
    rc, _, err = run(capsys, ["quantize", str(src), str(src), "--quiet"])
    assert_error_line(rc, err, r"the output directory is the source model")
    assert snapshot(src) == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_files(tiny, tmp_path, capsys, no_load):
    src = _copy(tiny, tmp_path / "locked")
    (src / "config.json").chmod(0)
    try:
        for argv in (["generate", "--model", str(src)], ["quantize", str(src), str(tmp_path / "out")],
                     ["inspect", str(src)]):
            rc, _, err = run(capsys, argv)
            assert_error_line(rc, err, r"config.json")
    finally:
        (src / "config.json").chmod(0o644)
    assert not (tmp_path / "out").exists()


# ---- inspect, example, cache --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing", "empty dir", "a file", "truncated safetensors", "config not JSON",
                                  "dangling shard link"])
def test_inspect_bad_path(case, tiny, tmp_path, capsys):
    path = bad_model(tiny, tmp_path, case)
    before = snapshot(path)
    rc, _, err = run(capsys, ["inspect", str(path)])
    assert_error_line(rc, err, r"^exl3rt: error: \S+")
    assert snapshot(path) == before


def test_example_refusals_leave_the_disk_alone(tmp_path, capsys):
    ex = tmp_path / "ex"
    assert main(["example", str(ex)]) == 0
    capsys.readouterr()
    before = snapshot(ex)
    rc, _, err = run(capsys, ["example", str(ex)])
    assert_error_line(rc, err, r"not empty \(README.md, config.json, model-00001-of-00001.safetensors")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, _, err = run(capsys, ["example", str(blocker)])
    assert_error_line(rc, err, r"OUT \S+file: exists and is not a directory")
    for seed, pattern in (("-1", r"-1 is too small: at least 0"), ("9" * 30, r"9{30} is too large: at most 4294967295"),
                          ("1.5", r"'1.5' is not an integer")):
        rc, _, err = run(capsys, ["example", str(tmp_path / "new"), "--seed", seed])
        assert_usage_error(rc, err, r"argument --seed: " + pattern)
    assert snapshot(ex) == before and blocker.read_text() == "x" and not (tmp_path / "new").exists()


def test_cache_bad_input(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, _, err = run(capsys, ["cache", "verify", "--root", str(blocker)])
    assert_error_line(rc, err, r"not a directory")
    for argv, pattern in ((["prune", "--max-size", "lots"], r"argument --max-size: 'lots' is not a size"),
                          (["prune", "--older-than", "5y"], r"argument --older-than: '5y' is not an age"),
                          (["shrink"], r"invalid choice: 'shrink'")):
        rc, _, err = run(capsys, ["cache", *argv, "--root", str(tmp_path / "c")] if argv[0] == "prune" else
                         ["cache", *argv])
        assert_usage_error(rc, err, pattern)
    assert blocker.read_text() == "x" and not (tmp_path / "c").exists()


@pytest.mark.parametrize("verb", ["ls", "stats", "verify", "prune"])
def test_cache_root_that_is_a_file_is_one_line(tmp_path, capsys, verb):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    assert main(["cache", verb, "--root", str(f)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"exl3rt: error: {f}: not a directory") and err.count("\n") == 1
    assert f.read_text() == "x"


def test_cache_prune_size_too_large_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["cache", "prune", "--root", str(tmp_path), "--max-size", "9" * 400])
    assert exc.value.code == 2
    assert "too large a size" in capsys.readouterr().err
