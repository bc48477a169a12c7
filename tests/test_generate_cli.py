"""`exl3rt generate` and `exl3rt eval` end to end on a tiny random Llama (the default SmolLM2 run is
the README's demo; here `--model` points at a tiny model so the test takes seconds)."""

from __future__ import annotations

import json
import re

import pytest

from exl3rt.cli.main import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("gen") / "tiny", layers=1)


def _counts(out: str) -> tuple[int, int]:
    m = re.search(r"(\d+) hits, (\d+) misses", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def test_generate_encodes_once_then_hits_the_cache(tiny, tmp_path, capsys):
    args = ["generate", "--model", str(tiny), "--bits", "3", "--cache-dir", str(tmp_path / "c"),
            "--max-new-tokens", "4", "--prompt", "the quick", "--quiet"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert _counts(first) == (0, 7)                     # 1 layer: q k v o gate up down
    assert "generated 4 tokens" in first
    assert main(args) == 0
    second = capsys.readouterr().out
    assert _counts(second) == (7, 0)
    reply = lambda out: out.split("> the quick\n", 1)[1].split("\n", 1)[0]   # noqa: E731
    assert reply(first) == reply(second)                # same codes, same greedy tokens


def test_generate_readonly_cache_writes_nothing(tiny, tmp_path, capsys):
    root = tmp_path / "ro"
    args = ["generate", "--model", str(tiny), "--bits", "2", "--cache-dir", str(root), "--cache-mode", "readonly",
            "--max-new-tokens", "2", "--quiet"]
    assert main(args) == 0
    assert _counts(capsys.readouterr().out) == (0, 7)
    assert not root.exists()


def test_generate_rejects_a_path_without_config(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("exl3rt: error: --model") and "no config.json" in err and err.count("\n") == 1


def test_eval_table_orders_bitrates(tiny, tmp_path, capsys):
    from tiny_models import calibration_text

    text = tmp_path / "t.txt"
    text.write_text(calibration_text(300, seed=5))
    args = ["eval", "--model", str(tiny), "--bits", "2", "6", "--cache-dir", str(tmp_path / "c"), "--text", str(text),
            "--ctx", "64", "--json", "--quiet"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["bits"] for r in rows] == [None, 2, 6]
    base, k2, k6 = (r["ppl"] for r in rows)
    # K=6 is close to the unquantized model and closer than K=2 (a random model's ppl is near its vocab size)
    assert abs(k6 / base - 1) < 0.01
    assert abs(k2 / base - 1) > abs(k6 / base - 1)
    assert rows[1]["misses"] == 7 and rows[2]["misses"] == 7


def test_generate_bad_bits_is_a_clear_error(tiny, tmp_path, capsys):
    rc = main(["generate", "--model", str(tiny), "--bits", "2.5", "--cache-dir", str(tmp_path / "c"), "--quiet"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.startswith("exl3rt: error:") and "mul1" in err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("cmd,bits,status", [("eval", ["4", "0"], 2), ("eval", ["2.5"], 1), ("generate", ["9"], 2),
                                             ("generate", ["3.5"], 1), ("generate", ["inf"], 2), ("generate", ["17"], 2),
                                             ("eval", ["4", "nan"], 2)])
def test_bad_bits_refused_before_anything_loads(cmd, bits, status, tmp_path, capsys, monkeypatch):
    """A bad ``--bits`` is refused before the model is even looked for — ``eval`` used to score the unquantized
    model first and fail minutes later, ``generate --bits inf`` / ``17`` ran unquantized. A value that is no
    bitrate at all is argparse's usage error (status 2); half-integer K without ``--codebook mul1`` one
    ``exl3rt: error:`` line (status 1)."""
    from exl3rt.cli import evaluate, generate

    def never(*a, **k):
        raise AssertionError("the model was looked for / loaded before --bits was checked")

    for mod in (evaluate, generate):
        monkeypatch.setattr(mod, "model_path", never)
        monkeypatch.setattr(mod, "load", never)
    try:
        rc = main([cmd, "--bits", *bits, "--cache-dir", str(tmp_path / "c")])
    except SystemExit as e:
        rc = e.code
    assert rc == status
    err = capsys.readouterr().err
    if status == 1:
        assert err.startswith("exl3rt: error: --bits") and "mul1" in err and err.count("\n") == 1
    else:
        assert err.strip().splitlines()[-1].endswith(f"argument --bits: '{bits[-1]}' is not a bitrate: use 1..8, "
                                                     f"or 1.5, 2.5, 3.5 with --codebook mul1, or 16 (unquantized)")
    assert not (tmp_path / "c").exists()


def test_generate_names_a_refused_weight_in_one_line(tiny, tmp_path, capsys):
    """A NaN weight: ``exl3rt generate`` ends with one ``exl3rt: error:`` line naming the tensor — not transformers'
    load report and RuntimeError — and status 1."""
    import logging

    from tiny_models import nonfinite_copy

    src = tmp_path / "nan"
    (name,) = nonfinite_copy(tiny, src, lambda names: [n for n in names if n.endswith("self_attn.q_proj.weight")],
                             float("inf"), at=(1, 2))

    seen: list[str] = []

    class Keep(logging.Handler):              # transformers logs through its own, non-propagating logger
        def emit(self, record):
            seen.append(record.getMessage())

    keep = Keep()
    logging.getLogger("transformers").addHandler(keep)
    try:
        rc = main(["generate", "--model", str(src), "--bits", "3", "--cache-dir", str(tmp_path / "c"), "--quiet"])
    finally:
        logging.getLogger("transformers").removeHandler(keep)
    assert rc == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"exl3rt: error: {name.rsplit('.', 1)[0]}:") and "non-finite" in last
    assert "Traceback" not in err and not any("LOAD REPORT" in m for m in seen)


def test_generate_runs_an_exl3_checkpoint_as_stored_with_the_online_tokens(tiny, tmp_path, capsys):
    """A checkpoint from exl3rt quantize as --model loads as it is (nothing encoded, no cache) and gives the
    tokens of the online path with the same settings; another method's checkpoint is refused in one line."""
    import json

    out = tmp_path / "exl3"
    assert main(["quantize", str(tiny), str(out), "--bits", "3", "--head-bits", "16", "--quiet"]) == 0
    capsys.readouterr()
    common = ["--max-new-tokens", "6", "--prompt", "the quick", "--quiet", "--cache-dir", str(tmp_path / "c")]
    assert main(["generate", "--model", str(out), *common]) == 0
    stored = capsys.readouterr().out
    assert "EXL3 checkpoint, as stored" in stored and "nothing encoded" in stored
    assert not (tmp_path / "c").exists()            # the cache was not touched
    assert main(["generate", "--model", str(tiny), "--bits", "3", *common]) == 0
    online = capsys.readouterr().out

    def reply(text):
        return text.split("\n> the quick\n", 1)[1].split("\nexl3rt:", 1)[0]
    assert reply(stored) == reply(online)

    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (out / "config.json").write_text(json.dumps(cfg))
    assert main(["eval", "--model", str(out), "--bits", "4"]) == 1
    err = capsys.readouterr().err
    assert "quant_method 'gptq'); this command runs EXL3 checkpoints as stored" in err and err.count("\n") == 1


def test_eval_scores_a_checkpoint_as_stored_beside_its_source(tiny, tmp_path, capsys):
    """`exl3rt eval --model <EXL3> --source <original>`: two rows, and the checkpoint's perplexity is the online
    path's at the same settings (the same codes)."""
    out = tmp_path / "exl3"
    assert main(["quantize", str(tiny), str(out), "--bits", "3", "--head-bits", "16", "--quiet"]) == 0
    capsys.readouterr()
    common = ["--max-tokens", "200", "--ctx", "64", "--quiet", "--json", "--cache-dir", str(tmp_path / "c")]
    assert main(["eval", "--model", str(out), "--source", str(tiny), *common]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["stored"] for r in rows] == [False, True] and rows[0]["bits"] is None
    assert main(["eval", "--model", str(tiny), "--bits", "3", "--no-baseline", *common]) == 0
    online = json.loads(capsys.readouterr().out)["rows"][0]
    assert rows[1]["ppl"] == pytest.approx(online["ppl"], rel=1e-6) and rows[1]["bits"] == pytest.approx(3.0)
    assert rows[1]["delta_pct"] == pytest.approx(100 * (online["ppl"] / rows[0]["ppl"] - 1), rel=1e-4)
    assert main(["eval", "--model", str(tiny), "--source", str(tiny), "--bits", "3"]) == 1
    assert "--source names the unquantized model of an EXL3 checkpoint" in capsys.readouterr().err


def test_generate_prints_prefill_and_decode_rates_and_takes_eager(tiny, tmp_path, capsys):
    args = ["generate", "--model", str(tiny), "--bits", "4", "--cache-dir", str(tmp_path / "c"),
            "--max-new-tokens", "5", "--prompt", "the quick", "--quiet", "--eager"]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("exl3rt: generated"))
    m = re.search(r"generated (\d+) tokens: prefill (\d+) tokens in \d+ ms \((\d+) tokens/s\), "
                  r"decode (\d+) tokens at ([\d.]+) tokens/s \(eager; layers prepared in [\d.]+ s\)", line)
    assert m, line
    new, prompt, decode = int(m.group(1)), int(m.group(2)), int(m.group(4))
    assert new == 5 and decode == 4 and prompt >= 2 and float(m.group(5)) > 0


def test_fast_mode_gives_the_eager_tokens(tiny, tmp_path):
    """The fast mode's static KV cache (compiled only on a GPU) decodes the tokens the eager loop does, and the
    timing counts what was generated."""
    import torch
    from transformers import AutoModelForCausalLM

    import exl3rt
    from exl3rt.integrations.generation import generate_timed

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    exl3rt.quantize_model(model, exl3rt.Exl3Config(bits=4, cache_dir=str(tmp_path / "c"), progress=False),
                          progress=False)
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    eager, te = generate_timed(model, ids, 6, fast=False, pad_token_id=0)
    warmed = []
    fast, tf = generate_timed(model, ids, 6, fast=True, pad_token_id=0, on_warmup=lambda: warmed.append(1))
    assert torch.equal(fast, eager)
    assert warmed == [1] and tf.mode == "fast" and te.mode == "eager" and te.warmup_s == 0
    n = int(eager.shape[1]) - ids.shape[1]
    assert te.new_tokens == tf.new_tokens == n and te.prompt_tokens == 6
    assert te.prefill_s > 0 and (n < 2 or te.decode_tok_s > 0)
    with pytest.raises(ValueError, match="one sequence"):
        generate_timed(model, torch.cat([ids, ids]), 2, fast=False, pad_token_id=0)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the compiled decode step runs on a GPU")
def test_fast_mode_on_a_gpu_compiles_the_step_and_gives_the_eager_tokens(tmp_path):
    """On CUDA transformers compiles the static-cache step (CUDA graphs around the EXL3 custom ops): the same
    greedy tokens as the eager loop, the compile counted in the warm-up, not in the decode rate."""
    import torch
    from transformers import AutoModelForCausalLM

    import exl3rt
    from exl3rt.integrations.generation import generate_timed
    from tiny_models import tiny_llama

    src = tiny_llama(tmp_path / "m", hidden=256, intermediate=512, layers=2, init_std=0.5)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float16).eval().cuda()
    exl3rt.quantize_model(model, exl3rt.Exl3Config(bits=4, cache_dir=str(tmp_path / "c"), progress=False),
                          progress=False)
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]], device="cuda")
    eager, te = generate_timed(model, ids, 12, fast=False, pad_token_id=0)
    fast, tf = generate_timed(model, ids, 12, fast=True, pad_token_id=0)
    assert torch.equal(fast, eager)
    assert tf.warmup_s > 0 and tf.new_tokens == te.new_tokens and tf.decode_tok_s > 0
