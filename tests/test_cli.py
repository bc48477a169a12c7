"""The exl3rt command: inspect prints the right average bits per weight; help and errors are clear."""

import json

import pytest

from exl3rt.cli.example import HEAD, LAYER_PLAN, example_config
from exl3rt.cli.main import main
from exl3rt.format.encoded import padded_width

from test_checkpoint import LAYERS, expected_bpw, written  # noqa: F401  (fixture)


def test_inspect_roundtrip_checkpoint_prints_right_bpw(written, capsys):
    out, _ = written
    assert main(["inspect", str(out), "--validate"]) == 0
    text = capsys.readouterr().out
    assert f"bpw          {expected_bpw(LAYERS):.4f}" in text
    assert "model.layers.0.mlp.down_proj" in text and "2.5" in text and "validated" in text
    assert main(["inspect", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["totals"]["bpw"] == pytest.approx(expected_bpw(LAYERS), rel=1e-12)
    assert {r["name"]: r["bits"] for r in data["layers"]} == {n: v[2] for n, v in LAYERS.items()}


def test_example_checkpoint_bpw(tmp_path, capsys):
    out = tmp_path / "ex"
    assert main(["example", str(out)]) == 0
    assert main(["inspect", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    cfg = example_config()
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    dims = {"mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}
    weights, bits = 0, 0.0
    for suffix, (k, _) in LAYER_PLAN.items():
        a, b = dims.get(suffix, (h, h))
        weights += n * padded_width(a) * padded_width(b)
        bits += n * padded_width(a) * padded_width(b) * k
    weights += h * v
    bits += h * v * HEAD[0]
    assert data["totals"]["bpw"] == pytest.approx(bits / weights, rel=1e-12)
    assert data["totals"]["linears"] == 7 * n + 1


def test_help_teaches(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "exl3rt example" in text and "inspect" in text and "EXL3RT_LOG_LEVEL" in text
    # where the README and docs/ are (here the source checkout; an installed wheel's share/doc/exl3rt)
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    assert f"documentation: {root}/README.md and {root}/docs/" in text


def test_inspect_error_is_one_clear_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("exl3rt: error:") and "no such file or directory" in err


def test_closed_pipe_ends_quietly(tmp_path):
    """``exl3rt inspect ... | head``: when the reader has gone, the command stops with status 141 (as if killed by
    SIGPIPE) and writes nothing to stderr — no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys
    out = tmp_path / "ex"
    assert main(["example", str(out)]) == 0
    r, w = os.pipe()
    os.close(r)                                   # the reader is gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "exl3rt.cli.main", "inspect", str(out)], stdout=w,
                              stderr=subprocess.PIPE, timeout=300)
    finally:
        os.close(w)
    assert proc.returncode == 141, proc.stderr.decode()
    assert proc.stderr == b""


def test_bad_option_values_are_usage_errors(tmp_path, capsys):
    """Counts, windows and files are checked by argparse (status 2, one line naming the option) before anything
    loads; a --device this machine lacks is one ``exl3rt: error:`` line (status 1)."""
    import torch

    cases = [(["eval", "--ctx", "1"], "argument --ctx: 1 is too small: at least 2"),
             (["eval", "--max-tokens", "x"], "argument --max-tokens: 'x' is not an integer"),
             (["eval", "--text", str(tmp_path / "none.txt")], f"argument --text: {tmp_path / 'none.txt'}: no such file"),
             (["generate", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 is too small: at least 1"),
             (["quantize", "a", "b", "--calibrate", str(tmp_path)], f"argument --calibrate: {tmp_path}: no such file"),
             (["quantize", "a", "b", "--calib-rows", "0"], "argument --calib-rows: 0 is too small: at least 1")]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(msg), argv
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for cmd in (["generate"], ["eval"], ["quantize", str(tmp_path / "src"), str(tmp_path / "out")]):
        for dev, msg in ((f"cuda:{n}", "no CUDA device here" if n == 0 else f"only {n} CUDA device(s)"),
                         ("banana", "not a device"), ("meta", "exl3rt runs on cpu or cuda")):
            assert main(cmd + ["--device", dev]) == 1
            err = capsys.readouterr().err
            assert err.startswith(f"exl3rt: error: --device ") and msg in err and err.count("\n") == 1, (cmd, err)
    assert not (tmp_path / "out").exists()


def test_unwritable_output_is_one_line(tmp_path, capsys):
    """An OS error (here: OUT is a file, so nothing can be made under it) is one ``exl3rt: error:`` line, status 1."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["example", str(blocker / "sub")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("exl3rt: error:") and err.count("\n") == 1 and str(blocker) in err


BAD_BITS = ["inf", "-inf", "nan", "17", "0", "4.5", "7.5", "-1", "abc", "", "1e400", "2.25"]


@pytest.mark.parametrize("argv", [["generate", "--bits"], ["eval", "--bits", "4"], ["quantize", "s", "o", "--bits"],
                                  ["quantize", "s", "o", "--head-bits"]], ids=lambda a: " ".join(a))
def test_bits_outside_the_format_are_usage_errors(argv, tmp_path, capsys, monkeypatch):
    """Every --bits / --head-bits takes exactly what normalize_bits takes (plus 16 where it means unquantized) and
    refuses the rest as argparse usage errors (status 2, the last line naming the option), before anything runs."""
    from exl3rt.cli import evaluate, generate, quantize

    monkeypatch.setattr(generate, "run", lambda a: pytest.fail("generate ran"))
    monkeypatch.setattr(evaluate, "run", lambda a: pytest.fail("eval ran"))
    monkeypatch.setattr(quantize, "run", lambda a: pytest.fail("quantize ran"))
    option = argv[-1] if argv[-1].startswith("--") else argv[-2]
    for value in BAD_BITS + (["16"] if argv[0] == "quantize" and option == "--bits" else []):
        with pytest.raises(SystemExit) as e:
            main(argv + [value])
        assert e.value.code == 2, value
        last = capsys.readouterr().err.strip().splitlines()[-1]
        if value == "-inf":     # argparse reads it as an option: a missing value, or an unrecognized argument
            assert "expected one argument" in last or "unrecognized arguments: -inf" in last, last
        else:
            assert f"argument {option}: {value if value == '16' else repr(value)}" in last and "bitrate" in last, last


def test_bits_values_accepted():
    from exl3rt.cli.main import build_parser

    p = build_parser()
    assert p.parse_args(["generate", "--bits", "16"]).bits == 16
    assert p.parse_args(["generate", "--bits", "4.0"]).bits == 4
    assert isinstance(p.parse_args(["generate", "--bits", "4.0"]).bits, int)
    assert p.parse_args(["eval", "--bits", "1", "1.5", "8", "16"]).bits == [1, 1.5, 8, 16]
    q = p.parse_args(["quantize", "s", "o", "--bits", "3.5", "--head-bits", "16"])
    assert (q.bits, q.head_bits) == (3.5, 16)
    assert p.parse_args(["generate"]).bits == 4 and p.parse_args(["quantize", "s", "o"]).head_bits == 6


def test_env_bits_follow_normalize_bits():
    """EXL3RT_VLLM_BITS accepts exactly what normalize_bits accepts (it used to take 4.5 .. 7.5, and 'inf'
    crashed with OverflowError)."""
    from exl3rt import env
    from exl3rt.format.bits import ALL_BITS, normalize_bits
    from exl3rt.format.errors import FormatError

    values = [str(k) for k in ALL_BITS] + BAD_BITS[:-1] + ["4.0", "8.5", "16", "0.5", " 3 "]
    for raw in values:
        try:
            want = normalize_bits(raw)
        except FormatError:
            want = None
        if want is None or not raw.strip():
            if not raw.strip():
                assert env.VLLM_BITS.get({"EXL3RT_VLLM_BITS": raw}) is None   # unset
                continue
            with pytest.raises(env.EnvError, match="EXL3RT_VLLM_BITS="):
                env.VLLM_BITS.get({"EXL3RT_VLLM_BITS": raw})
        else:
            got = env.VLLM_BITS.get({"EXL3RT_VLLM_BITS": raw})
            assert got == want and type(got) is type(want), raw
    assert {env.VLLM_BITS.get({"EXL3RT_VLLM_BITS": str(k)}) for k in ALL_BITS} == set(ALL_BITS)


def test_inspect_without_transformers_lists_the_codes_and_says_what_it_did_not_check(tmp_path, capsys, monkeypatch):
    """The base install has no transformers: inspect still lists the codes and totals, and says the load plan needs
    exl3rt[hf] instead of failing."""
    out = tmp_path / "ex"
    assert main(["example", str(out)]) == 0
    capsys.readouterr()
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)     # import transformers -> ImportError
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "not checked: transformers is not installed" in text and "exl3rt[hf]" in text and "bpw" in text
