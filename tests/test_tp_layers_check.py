"""``benchmarks/check_tp_layers.py`` on the CPU (gloo, two ranks): the script the two-GPU run uses, end to end.

Each rank runs its slices of a mixed K3/K4 MoE layer through ``torch.ops.exl3rt.moe`` and of a dense MLP through
``torch.ops.exl3rt.linear``, then all-reduces; the sum must equal the unsliced layer through the same ops (in fp32
on the CPU: up to the order of the additions) and be the same on both ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import check_tp_layers  # noqa: E402


def test_two_gloo_ranks_equal_the_single_layer(tmp_path):
    out = tmp_path / "tp.json"
    rc = check_tp_layers.main(["--backend", "gloo", "--tokens", "1", "6", "--hidden", "256", "--intermediate", "640",
                               "--experts", "6", "--topk", "3", "--iters", "1", "--tol", "1e-5", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["ok"]
    assert {(r["layer"], r["tokens"]) for r in res["rows"]} == {(k, t) for k in ("moe", "mlp") for t in (1, 6)}
    for r in res["rows"]:
        assert r["eager_ranks_agree"] and r["eager_rel_err"] < 1e-5, r
