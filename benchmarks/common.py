"""Helpers shared by the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any


def commit() -> str:
    """Short hash of HEAD with ``-dirty`` when the working tree differs from it (a copy of a working
    tree, e.g. on the device machine, may carry a stale checkout's HEAD), or 'unknown' outside git."""
    try:
        return subprocess.check_output(["git", "describe", "--always", "--dirty", "--abbrev=7"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


def median_ms(fn, iters: int, *, warmup: int = 0, cuda: bool = True) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after ``warmup`` untimed ones: each call between two
    CUDA events (``cuda``), else by the host's clock."""
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def finish_tp_check(args, rows: list, ok: bool, summary: str) -> int:
    """The end of a tensor-parallel check: print ``OK``/``FAIL`` with ``summary``, write the JSON (commit, device,
    backend, TP size, torch, the arguments, the rows) to ``args.json``, return the exit code."""
    import torch

    print(f"{'OK' if ok else 'FAIL'}: {summary}")
    device = torch.cuda.get_device_name(0) if args.backend == "nccl" else "cpu"
    write_json(args.json, {"commit": commit(), "device": device, "backend": args.backend, "tp": args.tp,
                           "torch": torch.__version__, "config": vars(args), "rows": rows, "ok": ok})
    return 0 if ok else 1


def run_json_child(script: str, spec: dict[str, Any], what: str, env: dict[str, str] | None = None,
                   timeout: float = 3600) -> dict[str, Any]:
    """Run ``script --child <spec as JSON>`` in a fresh interpreter and return the JSON object it printed last
    (a line starting with ``{``); ``what`` names the start in the error when it fails."""
    import sys

    out = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], capture_output=True, text=True,
                         env=env, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{what} failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-6000:]}")
    return json.loads(lines[-1])


def answer_child(fn, spec_json: str) -> None:
    """The ``--child`` side of :func:`run_json_child`: print ``fn(spec)`` as JSON and leave at once (vLLM's
    interpreter teardown is slow and can hang)."""
    import os
    import sys

    print(json.dumps(fn(json.loads(spec_json))), flush=True)
    sys.stdout.flush()
    os._exit(0)
