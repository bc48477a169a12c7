"""vLLM's OpenAI server with the exl3rt plugin under load: concurrent streamed chat requests for a fixed time.

Starts ``python -m vllm.entrypoints.openai.api_server`` on ``--model`` (an EXL3 checkpoint, or a BF16 model: then
``--bits`` encodes it at load; ``--bf16`` serves it unquantized as the baseline) in its own process group, waits for
``/health``, then keeps ``--concurrency`` streamed ``/v1/chat/completions`` requests in flight for ``--seconds``
(each ``--max-tokens`` tokens, ``ignore_eos``). Per request: TTFT (request sent to the first content chunk) and
TPOT ((end of the stream - first content) / (completion tokens - 1), the token count from the stream's usage
chunk). A request that fails or comes back empty is counted and makes the
exit status 1. The server is stopped whatever happens.

    python3 benchmarks/bench_vllm_server.py --model /tmp/ckpt-exl3 --concurrency 32 --seconds 60

Prints p50 / p99 of TTFT and TPOT and writes ``benchmarks/results/vllm_server_<model>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, write_json  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"   # works with any tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "m", "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(max(args.concurrency, 1)), "--chat-template", CHAT_TEMPLATE,
           "--uvicorn-log-level", "warning", *args.server_args]
    if not args.bf16:
        cmd += ["--quantization", "exl3"]
        if args.bits is not None:
            cmd += ["--hf-overrides", json.dumps({"quantization_config": {"quant_method": "exl3", "bits": args.bits}})]
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER=os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"))
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float, log: Path) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s:\n{log.read_text()[-4000:]}")


async def one_request(session, url: str, i: int, max_tokens: int) -> dict:
    body = {"model": "m", "stream": True, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"request {i}: the quick brown fox jumps over the lazy dog"}]}
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                return {"ok": False, "error": f"HTTP {r.status}: {(await r.text())[:200]}"}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                choices = chunk.get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
    except Exception as exc:      # a dropped connection, a malformed chunk: counted as a failure
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
    if not stamps:
        return {"ok": False, "error": "empty response"}
    n = tokens or len(stamps)        # the server's count (several tokens may share a chunk)
    tpot = (time.perf_counter() - t0 - (stamps[0] - t0)) / (n - 1) if n > 1 else None
    return {"ok": True, "ttft": stamps[0] - t0, "tpot": tpot, "tokens": n}


async def load(base: str, concurrency: int, seconds: float, max_tokens: int) -> list[dict]:
    import aiohttp

    url = base + "/v1/chat/completions"
    results: list[dict] = []
    deadline = time.perf_counter() + seconds
    counter = iter(range(10**9))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def worker():
            while time.perf_counter() < deadline:
                results.append(await one_request(session, url, next(counter), max_tokens))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bits", type=float, default=None, help="encode a BF16 model at load at this K")
    ap.add_argument("--bf16", action="store_true", help="serve the model unquantized (the baseline)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--json", default=None)
    ap.add_argument("server_args", nargs="*", help="more arguments for the server (after --)")
    args = ap.parse_args()
    if args.bits is not None and float(args.bits).is_integer():
        args.bits = int(args.bits)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(os.environ.get("OUT", "/tmp")) / f"server-{port}.log"
    proc = start_server(args, port, log)
    try:
        ready = wait_ready(base, proc, args.ready_timeout, log)
        print(f"server ready in {ready:.0f} s; {args.concurrency} streams for {args.seconds:g} s", flush=True)
        t0 = time.perf_counter()
        results = asyncio.run(load(base, args.concurrency, args.seconds, args.max_tokens))
        wall = time.perf_counter() - t0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
    ok = [r for r in results if r["ok"]]
    bad = [r for r in results if not r["ok"]]
    ttft = [r["ttft"] * 1e3 for r in ok]
    tpot = [r["tpot"] * 1e3 for r in ok if r["tpot"] is not None]
    summary = {"requests": len(results), "failed": len(bad), "errors": sorted({r["error"] for r in bad})[:5],
               "wall_s": wall, "ready_s": ready, "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
               "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99), "mean": statistics.fmean(ttft)} if ttft else None,
               "tpot_ms": {"p50": pct(tpot, 0.5), "p99": pct(tpot, 0.99), "mean": statistics.fmean(tpot)} if tpot else None}
    line = f"{len(results)} requests, {len(bad)} failed or empty"
    if ttft and tpot:
        line += (f"; TTFT ms p50 {summary['ttft_ms']['p50']:.1f} p99 {summary['ttft_ms']['p99']:.1f}; TPOT ms p50 "
                 f"{summary['tpot_ms']['p50']:.2f} p99 {summary['tpot_ms']['p99']:.2f}; "
                 f"{summary['output_tokens_per_s']:.0f} tokens/s out")
    print(line + ("" if not bad else f"; errors: {summary['errors']}"))
    write_json(args.json or f"benchmarks/results/vllm_server_{Path(args.model).name}.json",
               {"date": dt.date.today().isoformat(), "commit": commit(), "args": vars(args), **summary})
    return 1 if bad or not ok else 0


if __name__ == "__main__":
    sys.exit(main())
