"""Served speed on the GPU: vLLM with BF16 beside EXL3 checkpoints of the same shape, each start a fresh process.

Models (written once under ``--work``; random weights, so only speed is measured):

- ``llama``: Llama-3-8B-shaped (hidden 4096, MLP 14336, 32/8 heads, vocab 128256), ``--layers`` decoder layers; BF16,
  and EXL3 checkpoints at each ``--bits`` (random codes, the head at K6 as ``exl3rt quantize`` writes it);
- ``moe``: Qwen3-30B-A3B-shaped (hidden 2048, 128 experts of 768, top 8, 32/4 heads), ``--moe-layers`` layers.

Per start (vLLM's offline API, ``skip_tokenizer_init``, prompts as random token ids, ``ignore_eos``):

- load s: ``LLM(...)`` constructed (compile and CUDA-graph capture included); ``--starts 2`` starts each twice and
  reports the second, warm-cache load;
- weights GiB: the bytes of the model's parameters and buffers on the GPU;
- TPOT ms at each ``--concurrency``: c prompts of ``--in-len`` tokens, ``(t(out-len tokens) - t(1 token)) /
  (out-len - 1)``, best of ``--reps``;
- prefill: ``--prefill-prompts`` prompts of ``--prefill-len`` tokens, one token each: tokens/s.

Run from the repository root on the GPU machine with vLLM importable (docs/vllm.md, "Testing on an offline GPU
machine"):

    python3 benchmarks/bench_vllm_gpu.py --model llama --layers 8 --bits 4 3 2
    python3 benchmarks/bench_vllm_gpu.py --model moe --moe-layers 8 --bits 3

Prints a table (each EXL3 row beside BF16's, same run) and writes ``benchmarks/results/vllm_gpu_<model>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import answer_child, commit, run_json_child, write_json  # noqa: E402

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
         "torch_dtype": "bfloat16"}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
       "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
       "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
       "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
       "tie_word_embeddings": False, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
       "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
HEAD_BITS = 6


def linear_shapes(cfg: dict, layer: int) -> dict[str, tuple[int, int]]:
    """HF module name -> (out, in) of one decoder layer's linears (MoE: every expert)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    p = f"model.layers.{layer}"
    out = {f"{p}.self_attn.q_proj": (q, h), f"{p}.self_attn.k_proj": (kv, h), f"{p}.self_attn.v_proj": (kv, h),
           f"{p}.self_attn.o_proj": (h, q)}
    if "num_experts" in cfg:
        m = cfg["moe_intermediate_size"]
        for e in range(cfg["num_experts"]):
            out.update({f"{p}.mlp.experts.{e}.gate_proj": (m, h), f"{p}.mlp.experts.{e}.up_proj": (m, h),
                        f"{p}.mlp.experts.{e}.down_proj": (h, m)})
    else:
        i = cfg["intermediate_size"]
        out.update({f"{p}.mlp.gate_proj": (i, h), f"{p}.mlp.up_proj": (i, h), f"{p}.mlp.down_proj": (h, i)})
    return out


def plain_tensors(cfg: dict, layer: int) -> dict[str, tuple]:
    h, p = cfg["hidden_size"], f"model.layers.{layer}"
    out = {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
    if cfg["model_type"] == "qwen3_moe":
        out.update({f"{p}.self_attn.q_norm.weight": (cfg["head_dim"],), f"{p}.self_attn.k_norm.weight":
                    (cfg["head_dim"],), f"{p}.mlp.gate.weight": (cfg["num_experts"], h)})
    return out


def write_model(out: Path, cfg: dict, layers: int, bits) -> Path:
    """A random model directory: BF16 (``bits`` None) or an EXL3 checkpoint at K ``bits`` (head K6)."""
    import torch

    if (out / "config.json").is_file():
        return out
    from exl3rt.format.checkpoint_write import CheckpointWriter
    from exl3rt.format.random import random_linear

    cfg = dict(cfg, num_hidden_layers=layers)
    g = torch.Generator().manual_seed(0)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    h, v = cfg["hidden_size"], cfg["vocab_size"]
    if bits is None:
        from safetensors.torch import save_file
        out.mkdir(parents=True, exist_ok=True)
        wmap, n = {}, 0
        for i in range(-1, layers + 1):          # one shard per layer, the embedding / head at the ends
            part = {}
            if i == -1:
                part["model.embed_tokens.weight"] = rand(v, h)
            elif i == layers:
                part.update({"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": rand(v, h)})
            else:
                part.update({f"{k}.weight": rand(*s) for k, s in linear_shapes(cfg, i).items()})
                part.update({k: torch.ones(*s, dtype=torch.bfloat16) if "norm" in k else rand(*s)
                             for k, s in plain_tensors(cfg, i).items()})
            n += 1
            name = f"model-{n:05d}-of-{layers + 2:05d}.safetensors"
            save_file(part, str(out / name), metadata={"format": "pt"})
            wmap.update({k: name for k in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return out
    seed = 0
    with CheckpointWriter(out) as w:
        w.add_tensor("model.embed_tokens.weight", rand(v, h).half())
        for i in range(layers):
            for name, (o, n_in) in linear_shapes(cfg, i).items():
                seed += 1
                w.add_linear(name, random_linear(n_in, o, bits, "mcg", seed=seed))
            for k, s in plain_tensors(cfg, i).items():
                w.add_tensor(k, torch.ones(*s, dtype=torch.float16) if "norm" in k else rand(*s).half())
        w.add_tensor("model.norm.weight", torch.ones(h, dtype=torch.float16))
        w.add_linear("lm_head", random_linear(h, v, HEAD_BITS, "mcg", seed=seed + 1))
        cfg["torch_dtype"] = "float16"
        w.finish(cfg)
    return out


def child(spec: dict) -> dict:
    """One vLLM start: load, weight bytes, TPOT at each concurrency, prefill throughput."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")      # apply_model's function
    import torch
    from vllm import LLM, SamplingParams

    conc = spec["concurrency"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", skip_tokenizer_init=True, seed=0,
              max_model_len=max(spec["prefill_len"], spec["in_len"] + spec["out_len"]) + 16,
              max_num_seqs=max(conc), enable_prefix_caching=False, gpu_memory_utilization=spec["gpu_util"],
              enforce_eager=spec["eager"], max_num_batched_tokens=max(spec["prefill_len"], 8192))
    load = time.perf_counter() - t0

    def weight_bytes(model):
        seen, total = set(), 0
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_cuda and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    gib = llm.apply_model(weight_bytes)[0] / 2**30
    vocab = llm.llm_engine.model_config.get_vocab_size()
    g = torch.Generator().manual_seed(0)

    def prompts(n, length):
        return [{"prompt_token_ids": torch.randint(10, vocab, (length,), generator=g).tolist()} for _ in range(n)]

    def timed(batch, tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t

    tpot = {}
    for c in conc:
        batch = prompts(c, spec["in_len"])
        timed(batch, spec["out_len"])                                   # warm-up
        best = float("inf")
        for _ in range(spec["reps"]):
            best = min(best, (timed(batch, spec["out_len"]) - timed(batch, 1)) / (spec["out_len"] - 1))
        tpot[str(c)] = best * 1e3
    long = prompts(spec["prefill_prompts"], spec["prefill_len"])
    timed(long[:1], 1)
    pre = min(timed(long, 1) for _ in range(spec["reps"]))
    return {"load_s": load, "weights_gib": gib, "tpot_ms": tpot,
            "prefill_tok_s": spec["prefill_prompts"] * spec["prefill_len"] / pre}


def run_child(spec: dict) -> dict:
    return run_json_child(__file__, spec, spec["label"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("llama", "moe"), default="llama")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the Llama-3-8B-shaped model")
    ap.add_argument("--moe-layers", type=int, default=8, help="decoder layers of the Qwen3-30B-A3B-shaped model")
    ap.add_argument("--bits", type=float, nargs="+", default=[4, 3, 2])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--prefill-prompts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--starts", type=int, default=1, help="starts per configuration (2: report the warm-cache load)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's torch.compile + CUDA graphs)")
    ap.add_argument("--gpu-util", type=float, default=0.85)
    ap.add_argument("--work", default="/tmp/exl3rt-vllm-gpu", help="where the models are written (reused)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        answer_child(child, args.child)

    cfg, layers = (LLAMA, args.layers) if args.model == "llama" else (MOE, args.moe_layers)
    work = Path(args.work)
    bits = [int(b) if float(b).is_integer() else b for b in args.bits]
    configs = [("bf16", None)] + [(f"exl3-K{b:g}", b) for b in bits]
    base = {k: getattr(args, k) for k in ("concurrency", "in_len", "out_len", "prefill_len", "prefill_prompts", "reps",
                                          "eager", "gpu_util")}
    results = {}
    for label, k in configs:
        t = time.perf_counter()
        path = write_model(work / f"{args.model}-{layers}L-{label}", cfg, layers, k)
        print(f"{label}: model at {path} ({time.perf_counter() - t:.0f} s)", flush=True)
        got = None
        for s in range(args.starts):
            got = run_child({**base, "model": str(path), "label": label})
            print(f"  start {s + 1}: load {got['load_s']:.1f} s, weights {got['weights_gib']:.2f} GiB, TPOT ms "
                  + ", ".join(f"b{c} {v:.2f}" for c, v in got["tpot_ms"].items())
                  + f", prefill {got['prefill_tok_s']:.0f} tok/s", flush=True)
        results[label] = got
    ref = results["bf16"]
    import torch
    import vllm
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{args.model}, {layers} layers, {device}, vLLM {vllm.__version__}, "
          f"{'eager' if args.eager else 'torch.compile + CUDA graphs'}; ratios: EXL3 / BF16, same run")
    head = "| | weights GiB | load s | " + " | ".join(f"TPOT b{c} ms" for c in args.concurrency) + \
           f" | prefill {args.prefill_len} tok/s |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for label, r in results.items():
        cells = [f"{r['weights_gib']:.2f}", f"{r['load_s']:.0f}"]
        for c in args.concurrency:
            v = r["tpot_ms"][str(c)]
            cells.append(f"{v:.2f}" + ("" if label == "bf16" else f" ({v / ref['tpot_ms'][str(c)]:.2f}×)"))
        p = r["prefill_tok_s"]
        cells.append(f"{p:.0f}" + ("" if label == "bf16" else f" ({ref['prefill_tok_s'] / p:.2f}× time)"))
        print(f"| {label} | " + " | ".join(cells) + " |")
    write_json(args.json or f"benchmarks/results/vllm_gpu_{args.model}.json",
               {"date": dt.date.today().isoformat(), "commit": commit(), "device": device, "vllm": vllm.__version__,
                "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "child"},
                "results": results})


if __name__ == "__main__":
    main()
