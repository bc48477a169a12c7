"""``benchmarks/bench_host.py`` on the CPU: the host-time benchmark times the model it says it times.

Every decoder linear of its EXL3 model is an EXL3 layer, and the script's own check runs on the timed model: its
logits against the same model with each EXL3 layer replaced by an ``nn.Linear`` holding the decoded weight. On the
CPU both sides multiply by the weight ``format.reconstruct`` decodes, so this checks the bookkeeping (the layers
replaced, the check wired to the timed model); on a GPU the same check compares the kernels with the decode.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_host.py"


def test_tiny_model_on_cpu(tmp_path):
    out = tmp_path / "host.json"
    # its own process: the script swaps the encoder and the cache's digest for random codes, module-wide
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--layers", "2", "--iters", "3",
                          "--rounds", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["exl3_linears"] == 7 * 2
    # bf16 activations against the decoded weight in bf16: the same products up to the matmul's rounding
    assert res["exl3_vs_decoded_rel_err"] < 2e-2
    for model in ("bf16", "exl3"):
        row = res["rows"][model]
        for part in ("q/k/v (three calls, one input)", "o_proj", "attention", "mlp", "decoder layer",
                     "every layer in turn", "model forward", "model forward, gc off"):
            assert math.isfinite(row[part]) and row[part] > 0, (model, part)
        assert row["gc collections per forward"] >= 0
