"""``exl3rt.evaluation.compare`` against a float64 brute force, and ``benchmarks/bench_quality.py`` end to end on a tiny
random model (that the measurement runs and its numbers are consistent; a random model says nothing about quality)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from exl3rt.evaluation import Reference, perplexity, token_windows

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_quality.py"


class TableModel(torch.nn.Module):
    """logits[t] = table[token t] (+ the position, so windows differ): a model whose output is known exactly."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.float(), requires_grad=False)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1], dtype=torch.float32)[None, :, None]
        return SimpleNamespace(logits=self.table[input_ids] + 0.01 * pos)


class CharTokenizer:
    bos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + (ord(c) % 6) for c in text]}


def brute(windows, p_logits, q_logits):
    """KL, top-1, ppl by explicit loops in float64."""
    kl = nll = 0.0
    agree = n = 0
    for w in windows:
        lp, lq = p_logits(w), q_logits(w)
        for i in range(len(w) - 1):
            p = [math.exp(v) for v in lp[i]]
            zp = sum(p)
            q = [math.exp(v) for v in lq[i]]
            zq = sum(q)
            kl += sum(pv / zp * (math.log(pv / zp) - math.log(qv / zq)) for pv, qv in zip(p, q))
            agree += max(range(len(p)), key=lambda v: p[v]) == max(range(len(q)), key=lambda v: q[v])
            nll -= math.log(q[w[i + 1]] / zq)
            n += 1
    return kl / n, agree / n, math.exp(nll / n)


def test_compare_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    table_p = torch.randn(7, 7, generator=g, dtype=torch.float64)
    table_q = table_p + 0.3 * torch.randn(7, 7, generator=g, dtype=torch.float64)
    p, q = TableModel(table_p), TableModel(table_q)
    tok = CharTokenizer()
    text = "the quick brown fox jumps over the lazy dog " * 3
    windows = token_windows(tok, text, ctx=16)
    assert [len(w) for w in windows][:-1] == [16] * (len(windows) - 1) and windows[0][0] == 0

    def logits(table):
        return lambda w: [[float(table[t, v]) + 0.01 * i for v in range(7)] for i, t in enumerate(w)]

    ref = Reference(p, windows)
    got = ref.compare(q)
    kl, top1, ppl = brute(windows, logits(table_p), logits(table_q))
    assert got.kl == pytest.approx(kl, rel=1e-5)
    assert got.top1 == pytest.approx(top1)
    assert got.ppl == pytest.approx(ppl, rel=1e-5)
    assert got.tokens == sum(len(w) - 1 for w in windows)
    # the model against itself: no divergence, full agreement, its own perplexity as perplexity() computes it
    same = ref.compare(p)
    assert same.kl == pytest.approx(0.0, abs=1e-7) and same.top1 == 1.0
    assert same.ppl == pytest.approx(perplexity(p, tok, text, ctx=16).ppl, rel=1e-6)
    assert ref.result == same


def test_windows_refuse_empty_text():
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        token_windows(CharTokenizer(), "", ctx=8)
    with pytest.raises(ValueError, match="at least 2"):
        token_windows(CharTokenizer(), "abc", ctx=1)


def test_bench_quality_tiny(tmp_path):
    out = tmp_path / "quality.json"
    png = tmp_path / "quality.png"
    try:
        import matplotlib  # noqa: F401
        plot = ["--plot", str(png)]
    except ImportError:        # the `quality` extra brings it; the script refuses --plot without it
        plot = []
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--exl3-bits", "2", "4", "--codebooks", "mcg",
                          "--calibrated-bits", "2", "--chars", "1500", "--work-dir", str(tmp_path / "work"),
                          "--cache-dir", str(tmp_path / "cache"), "--json", str(out), *plot],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {r["label"]: r for r in res["rows"]}
    # the tiny model: 2 layers of q,k,v,o (256x256) and gate, up, down (256x512): no padding at these widths, so
    # EXL3's stored bits are K per weight plus the fp16 input/output scales of each matrix
    assert res["linear_weights"] == 2 * (4 * 256 * 256 + 3 * 256 * 512)
    for label, k in (("EXL3 K2 mcg online", 2), ("EXL3 K4 mcg online", 4), ("EXL3 K2 mcg calibrated", 2)):
        r = rows[label]
        scales = 2 * (4 * (256 + 256) + 2 * (256 + 512) + (512 + 256)) * 16
        assert r["bpw"] == pytest.approx(k + scales / res["linear_weights"], rel=1e-9)
        for t in r["texts"].values():
            assert 0 < t["kl"] < 10 and 0 <= t["top1"] <= 1 and math.isfinite(t["ppl"])
    # more bits, closer to the reference (a random model's weights are Gaussian: the encoder's case)
    assert rows["EXL3 K4 mcg online"]["kl"] < rows["EXL3 K2 mcg online"]["kl"]
    assert set(res["texts"]) >= {"prose", "python-docs"}
    for r in res["rows"]:
        assert "error" not in r, r
    # every peer either ran or says why not
    sys.path.insert(0, str(SCRIPT.parent))
    import quality_peers
    ran = {r["label"] for r in res["rows"]}
    said = {n["label"] for n in res["not_run"]}
    assert {c.label for c in quality_peers.all_configs()} <= ran | said
    assert {"RTN int4 g128", "RTN int4 g32"} <= ran          # the baseline needs no other library
    if os.environ.get("EXL3RT_QUALITY_PEERS_REQUIRED"):      # .ci/quality_check.sh: every CPU peer but GPTQ
        assert {c.label for c in quality_peers.all_configs() if c.method != "gptq"} <= ran, res["not_run"]
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
