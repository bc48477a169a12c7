"""What a new user meets in the first hour: every checkpoint exl3rt writes runs in `exl3rt generate` (it carries a
tokenizer, or one is given with --tokenizer), errors say the whole cause and the fix, nothing is silent (a quantized
model quantized again, a long CPU step, a cache read called quantizing, a low bitrate's wrong answers, an
unquantized folder given to inspect)."""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import exl3rt
from exl3rt.cli.main import main

pytest.importorskip("transformers")

PROMPT = ["--prompt", "the quick", "--max-new-tokens", "2", "--quiet"]


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(rc: int, err: str) -> str:
    """Status 1 and exactly one ``exl3rt: error:`` line; returns it."""
    assert rc == 1 and "Traceback" not in err, (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("exl3rt: error: "), err
    return lines[0]


def replied(out: str) -> bool:
    """generate printed the prompt's reply block and its timing line."""
    return "\n> the quick\n" in out and re.search(r"exl3rt: generated \d+ tokens", out) is not None


def tokenizer_names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.name.startswith("tokenizer") or p.name == "special_tokens_map.json"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tiny_models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("first") / "tiny", layers=1)


@pytest.fixture(scope="module")
def online(tiny):
    """The README's online load: from_pretrained with an exl3rt.Exl3Config, K=3."""
    import exl3rt.integrations.transformers  # noqa: F401  (registers the method)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32,
                                                quantization_config=exl3rt.Exl3Config(bits=3, progress=False))


@pytest.fixture(scope="module")
def saved(online, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("first") / "model-exl3"
    online.save_pretrained(str(out))
    return out


# ---- 1. tokenizers: every checkpoint exl3rt writes runs -----------------------------------------------------

def test_save_pretrained_carries_the_source_tokenizer_and_generate_runs_it(tiny, saved, capsys):
    assert tokenizer_names(tiny) and tokenizer_names(saved) == tokenizer_names(tiny)
    for name in tokenizer_names(tiny):
        assert (saved / name).read_bytes() == (tiny / name).read_bytes(), name
    manifest = json.loads((saved / "quantization_config.json").read_text())["files"]
    assert tokenizer_names(tiny) <= set(manifest)        # owned: a later save may replace them
    rc, out, err = run(capsys, ["generate", "--model", str(saved), *PROMPT])
    assert rc == 0 and replied(out) and "EXL3 checkpoint, as stored" in out, err


def test_save_pretrained_replaces_its_own_tokenizer_copy_and_keeps_one_it_did_not_write(tiny, online, tmp_path):
    out = tmp_path / "out"
    online.save_pretrained(str(out))
    (out / "tokenizer.json").write_text("stale copy")             # listed in the manifest: replaced
    online.save_pretrained(str(out))
    assert (out / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    mine = tmp_path / "mine"            # tokenizer.save_pretrained(dir) before model.save_pretrained(dir): kept
    mine.mkdir()
    (mine / "tokenizer.json").write_text("the user's own")
    online.save_pretrained(str(mine))
    assert (mine / "tokenizer.json").read_text() == "the user's own"
    assert (mine / "tokenizer_config.json").read_bytes() == (tiny / "tokenizer_config.json").read_bytes()
    assert "tokenizer.json" not in json.loads((mine / "quantization_config.json").read_text())["files"]


def test_quantize_output_runs_in_generate(tiny, online, tmp_path, capsys):
    out = tmp_path / "q"
    rc, _, err = run(capsys, ["quantize", str(tiny), str(out), "--bits", "3", "--quiet"])
    assert rc == 0, err
    assert tokenizer_names(out) == tokenizer_names(tiny)
    rc, out_text, err = run(capsys, ["generate", "--model", str(out), *PROMPT])
    assert rc == 0 and replied(out_text), err


def test_example_writes_a_tokenizer_of_its_vocabulary_and_generate_runs_it(tmp_path, capsys):
    from transformers import AutoTokenizer

    from exl3rt.cli.example import example_config

    out = tmp_path / "ex"
    rc, text, _ = run(capsys, ["example", str(out)])
    assert rc == 0 and "with a character-level tokenizer" in text and text.count("\n") == 1
    vocab = example_config()["vocab_size"]
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == vocab
    tokens = tok.convert_ids_to_tokens(list(range(vocab)))
    assert len(set(tokens)) == vocab and all(tokens)              # every id the model emits is some text
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2) == (example_config()["bos_token_id"],
                                                              example_config()["eos_token_id"])
    sentence = "What is the capital of France? Paris."
    assert tok.decode(tok(sentence)["input_ids"], skip_special_tokens=True) == sentence
    rc, text, err = run(capsys, ["generate", "--model", str(out), *PROMPT])
    assert rc == 0 and replied(text), err


def test_example_tokenizer_fits_a_small_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    from exl3rt.cli.example import write_example_checkpoint

    out = write_example_checkpoint(tmp_path / "small", hidden=128, intermediate=200, layers=1, vocab=64)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == 64 and len(set(tok.convert_ids_to_tokens(list(range(64))))) == 64


def test_example_without_the_tokenizers_package_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)         # import tokenizers -> ImportError (base install)
    out = tmp_path / "ex"
    rc, text, _ = run(capsys, ["example", str(out)])
    assert rc == 0 and "no tokenizer: the tokenizers package is not installed" in text
    assert not tokenizer_names(out) and (out / "config.json").is_file()


def test_tokenizer_option_runs_a_folder_without_one(tiny, saved, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(saved, bare)
    for name in tokenizer_names(bare):
        (bare / name).unlink()
    rc, out, err = run(capsys, ["generate", "--model", str(bare), "--tokenizer", str(tiny), *PROMPT])
    assert rc == 0 and replied(out), err


def test_a_folder_without_a_tokenizer_is_one_line_with_the_whole_cause_and_the_fix(saved, tmp_path, capsys):
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    shutil.copytree(saved, bare)
    for name in tokenizer_names(bare):
        (bare / name).unlink()
    with pytest.raises(Exception) as caught:           # what transformers itself says about this folder
        AutoTokenizer.from_pretrained(str(bare))
    cause = " ".join(str(caught.value).split())
    rc, _, err = run(capsys, ["generate", "--model", str(bare), *PROMPT])
    line = error_line(rc, err)
    assert line.startswith(f"exl3rt: error: --model {bare}: no usable tokenizer")
    assert cause in line                                # all of it, not cut at its first colon
    assert line.endswith("the folder has no tokenizer files: pass --tokenizer PATH (e.g. the source model's folder), "
                         "or copy the source's tokenizer files into it")
    empty = tmp_path / "empty"
    empty.mkdir()
    for value, pattern in ((str(tmp_path / "missing"), r"--tokenizer \S+missing: no such directory"),
                           (str(empty), r"--tokenizer \S+empty: no usable tokenizer \(.+\); the folder has no "
                                        r"tokenizer files")):
        rc, _, err = run(capsys, ["generate", "--model", str(saved), "--tokenizer", value, *PROMPT])
        assert re.search(pattern, error_line(rc, err))


# ---- 2. summary() and quantize_model on a quantized model ------------------------------------------------------

def test_summary_has_totals_and_names_layers_only_when_asked(online, saved):
    from transformers import AutoModelForCausalLM

    from exl3rt.runtime.linear import Exl3Linear

    quantized = sorted(n for n, m in online.named_modules() if isinstance(m, Exl3Linear))
    s = online.hf_quantizer.summary()
    assert "names" not in s and s["layers"] == len(quantized) == 7 and s["avg_bits"] == 3
    assert sorted(online.hf_quantizer.summary(layers=True)["names"]) == quantized
    stored = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    s = stored.hf_quantizer.summary()
    assert "names" not in s and s["linears"] == 7 and s["bpw"] == pytest.approx(3.0)
    assert stored.hf_quantizer.summary(layers=True)["names"] == quantized


def test_quantize_model_refuses_a_model_that_is_already_quantized(online):
    from exl3rt.runtime.policy import PolicyError

    before = {n: t.clone() for n, t in online.state_dict().items()}
    with pytest.raises(PolicyError, match=r"quantize_model: the model is already quantized \(7 EXL3 modules, e\.g\. "
                                          r"model\.layers\.0\.\S+\) and nothing else in it would be"):
        exl3rt.quantize_model(online, exl3rt.Exl3Config(bits=4), progress=False)
    after = online.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)


def test_quantize_model_still_quantizes_what_an_earlier_pass_left_dense(tiny, caplog):
    from transformers import AutoModelForCausalLM

    from exl3rt.runtime.linear import Exl3Linear

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    first = exl3rt.quantize_model(model, exl3rt.Exl3Config(bits=3, ignore=["*.self_attn.*"]), progress=False)
    assert first["layers"] == 3 and "names" not in first
    second = exl3rt.quantize_model(model, exl3rt.Exl3Config(bits=3), progress=False, layers=True)
    assert sorted(second["names"]) == [f"model.layers.0.self_attn.{p}_proj" for p in "koqv"]
    assert sum(isinstance(m, Exl3Linear) for m in model.modules()) == 7
    dense = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="exl3rt.runtime"):
        s = exl3rt.quantize_model(dense, exl3rt.Exl3Config(bits=3, ignore=["*"]), progress=False)
    assert s["layers"] == 0 and "found no linear to quantize" in caplog.text


# ---- 3./4. progress: the CPU decode, cache reads, transformers' advice ------------------------------------------

def _random_model(n: int = 6):
    from torch import nn

    from exl3rt.format.random import random_linear
    from exl3rt.runtime.linear import Exl3Linear

    return nn.Sequential(*(Exl3Linear.from_encoded(random_linear(128, 256, 2, seed=i), name=f"l{i}")
                           for i in range(n)))


def test_prepare_model_shows_a_bar_while_it_decodes_many_cpu_layers(capsys):
    from exl3rt.integrations.generation import PREPARE_PROGRESS_WEIGHTS, prepare_model

    model = _random_model()
    total = 6 * 128 * 256
    assert total < PREPARE_PROGRESS_WEIGHTS
    prepare_model(model, torch.float32)                  # a few small layers: quick, no bar
    assert capsys.readouterr().err == ""
    assert not any(m.prepare_decodes(torch.float32) for m in model)       # decoded and kept
    model = _random_model()
    prepare_model(model, torch.float32, progress_min_weights=total)
    err = capsys.readouterr().err
    assert "exl3rt: preparing layers (decoding weights)" in err
    last = err.strip().splitlines()[-1]
    assert "100.0%" in last and f"{total / 1000:.1f}k/{total / 1000:.1f}kw" in last
    assert not any(m.prepare_decodes(torch.float32) for m in model)
    prepare_model(model, torch.float32, progress_min_weights=1)          # nothing left to decode: no bar
    prepare_model(_random_model(), torch.float32, progress_min_weights=1, progress=False)
    assert capsys.readouterr().err == ""
    from exl3rt.format.reconstruct import reconstruct

    w = model[0].dequantized_weight(torch.float32)
    ref = reconstruct(model[0].trellis, model[0].suh, model[0].svh, model[0].codebook)
    torch.testing.assert_close(w, ref[:128, :256], rtol=0, atol=0)


def test_progress_label_says_what_the_pass_did():
    from exl3rt.runtime.online import OnlineStats, progress_label

    assert progress_label(None) == "exl3rt: quantizing"
    assert progress_label(OnlineStats(layers=3, misses=3)) == "exl3rt: quantizing"
    assert progress_label(OnlineStats(layers=3, hits=3)) == "exl3rt: loading from the encoding cache"
    mixed = OnlineStats(layers=3, hits=1, misses=2)
    assert progress_label(mixed) == "exl3rt: quantizing (1 of 3 matrices from the cache)"


def test_a_load_from_a_warm_cache_is_labelled_loading(tiny, online, capsys):
    from transformers import AutoModelForCausalLM

    capsys.readouterr()
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32,
                                                 quantization_config=exl3rt.Exl3Config(bits=3))
    assert model.hf_quantizer.summary()["misses"] == 0
    err = capsys.readouterr().err
    assert "exl3rt: loading from the encoding cache [" in err and "exl3rt: quantizing" not in err


def test_transformers_dtype_advice_is_dropped_while_exl3rt_prepares_the_bundled_model(tiny, monkeypatch):
    import inspect

    import transformers.quantizers.quantizer_gguf as gguf
    from transformers.utils import logging as hf_logging

    import exl3rt.models
    from exl3rt.cli._load import model_path

    advice = "Pass `dtype=torch.float32` to avoid it"
    assert advice in inspect.getsource(gguf)             # the message transformers really logs
    logger = hf_logging.get_logger(gguf.__name__)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    def fake_prepare(quiet=False):
        logger.warning(f"Loading a GGUF checkpoint ... {advice} -- the weights stay quantized regardless")
        logger.warning("another warning")
        return tiny

    monkeypatch.setattr(exl3rt.models, "smollm2_bf16_dir", fake_prepare)
    keep = Keep()
    logging.getLogger("transformers").addHandler(keep)
    try:
        path, _ = model_path(argparse.Namespace(model=None, quiet=True))
        fake_prepare()                                  # outside that call it is shown as transformers wants
    finally:
        logging.getLogger("transformers").removeHandler(keep)
    assert path == tiny
    assert len(seen) == 3 and seen[0] == seen[2] == "another warning" and advice in seen[1]


# ---- 7. the low-bit note ----------------------------------------------------------------------------------------

def test_generate_notes_that_k3_on_a_small_model_wants_calibration_and_k4_does_not(tiny, saved, online, capsys):
    note = re.compile(r"^exl3rt: note: K=3 on a \d+ k-parameter model often gives wrong answers without calibration: "
                      rf"calibrate \(exl3rt quantize {re.escape(str(tiny))} OUT --bits 3 --calibrate TEXT, then "
                      r"--model OUT\) or use --bits 4 or more$", re.M)
    rc, out, err = run(capsys, ["generate", "--model", str(tiny), "--bits", "3", *PROMPT])
    assert rc == 0 and replied(out) and len(note.findall(out)) == 1, err
    rc, out, err = run(capsys, ["generate", "--model", str(tiny), "--bits", "4", *PROMPT])
    assert rc == 0 and replied(out) and "note:" not in out, err
    # a stored K3 checkpoint: its maker chose the bitrate (and may have calibrated it)
    rc, out, err = run(capsys, ["generate", "--model", str(saved), *PROMPT])
    assert rc == 0 and replied(out) and "note:" not in out, err


def test_eval_notes_it_once_beside_the_table_and_on_stderr_with_json(tiny, online, capsys):
    common = ["--model", str(tiny), "--no-baseline", "--max-tokens", "24", "--ctx", "12", "--quiet"]
    rc, out, err = run(capsys, ["eval", *common, "--bits", "3"])
    assert rc == 0 and len(re.findall(r"exl3rt: note: K=3 on a \d+ k-parameter model", out)) == 1, err
    rc, out, err = run(capsys, ["eval", *common, "--bits", "3", "--json"])
    assert rc == 0 and json.loads(out)["rows"][0]["bits"] == 3 and "exl3rt: note: K=3" in err
    rc, out, err = run(capsys, ["eval", *common, "--bits", "4"])
    assert rc == 0 and "note:" not in out + err


def test_low_bits_note_bounds():
    from exl3rt.cli._load import low_bits_note

    src = Path("m")
    assert low_bits_note(3, 135_000_000, src).startswith("note: K=3 on a 135 M-parameter model")
    assert "--bits 2.5 --codebook mul1 --calibrate" in low_bits_note(2.5, 10**8, src, "mul1")
    assert low_bits_note(3.5, 10**8, src) is None and low_bits_note(4, 10**8, src) is None
    assert low_bits_note(2, 10**9, src) is None and low_bits_note(3, 999_999_999, src) is not None


# ---- 10. inspect of an unquantized folder ---------------------------------------------------------------------

def test_inspect_of_an_unquantized_folder_or_file_exits_1(tmp_path, capsys):
    from tiny_models import tiny_llama

    bf16 = tiny_llama(tmp_path / "bf16", layers=1, dtype=torch.bfloat16)
    for extra in ([], ["--json"], ["--validate"]):
        rc, out, err = run(capsys, ["inspect", str(bf16), *extra])
        line = error_line(rc, err)
        assert out == "" and f"{bf16}: no EXL3 tensors, so not an EXL3 checkpoint" in line
        assert f"exl3rt quantize {bf16} OUT" in line and f"exl3rt generate --model {bf16}" in line
    rc, _, err = run(capsys, ["inspect", str(bf16 / "model.safetensors")])
    assert "no EXL3 tensors" in error_line(rc, err)
