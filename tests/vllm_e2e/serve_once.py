"""One vLLM start on a model with quantization="exl3": greedy tokens and the plugin's summary as JSON.

Run in the vLLM venv (a fresh process per start, so a second run really is a second start):

    python tests/vllm_e2e/serve_once.py MODEL OUT.json [--bits 4] [--online]

Environment: EXL3RT_CACHE_DIR (the cache), VLLM_* as set by the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPTS = [[1, 5, 9, 12, 7], [1, 20, 3, 3, 17, 30, 8]]


def _inspect(model):
    from exl3rt.integrations.vllm.quant_config import Exl3VllmConfig
    from exl3rt.integrations.vllm.checkpoint_method import Exl3CheckpointHeadMethod, Exl3CheckpointLinearMethod
    from exl3rt.integrations.vllm.online_method import Exl3OnlineLinearMethod
    from exl3rt.integrations.vllm.moe_method import Exl3MoEMethodBase
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    linears, experts, heads, ours, cfg = {}, {}, {}, 0, None
    for name, mod in model.named_modules():
        if isinstance(mod, ParallelLMHead):
            heads[name] = type(mod.quant_method).__name__
            if isinstance(mod.quant_method, Exl3CheckpointHeadMethod):
                cfg = mod.quant_method.quant_config
                heads[name] += ":" + ",".join(f"{m.name}@K{m.bits}" for m in mod.exl3)
            continue
        if isinstance(mod, RoutedExperts):
            qm = mod.quant_method
            experts[name] = type(qm).__name__
            if isinstance(qm, Exl3MoEMethodBase):
                cfg = qm.quant_config
                experts[name] += ":" + ",".join(f"{m.name}@K{m.bits}" for d in mod.exl3_experts for m in d.values())
                experts[name] += "|" + mod.exl3_moe.path + "|" + json.dumps(mod.exl3_moe.launch_kinds())
            continue
        if isinstance(mod, LinearBase):
            qm = type(mod.quant_method).__name__
            linears[name] = qm
            if isinstance(mod.quant_method, (Exl3OnlineLinearMethod, Exl3CheckpointLinearMethod)):
                ours += 1
                cfg = mod.quant_method.quant_config
                linears[name] += ":" + ",".join(f"{m.name}@K{m.bits}" for m in mod.exl3)
    summary = cfg.summary() if isinstance(cfg, Exl3VllmConfig) else {}
    # layers served through vLLM's own CPU GEMM over their decoded product (integrations/vllm/dense.py)
    dense = sorted(name for name, mod in model.named_modules() if getattr(mod, "exl3_dense", False))
    # layers whose shards run as one fused EXL3 call (CUDA: integrations/vllm/forward.fuse_layer)
    fused = sorted(name for name, mod in model.named_modules() if getattr(mod, "exl3_group", None) is not None)
    device = next((p.device.type for p in model.parameters()), "cpu")
    return {"linears": linears, "experts": experts, "heads": heads, "ours": ours, "summary": summary, "dense": dense,
            "fused": fused, "device": device}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--bits", type=float, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--compile", action="store_true", help="enforce_eager=False (vLLM compiles the model)")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    # every decode of a whole weight while vLLM generates (none once the weights are prepared at load)
    import exl3rt.kernels.ops as ops
    import exl3rt.runtime.linear as linear_mod
    decodes = {"n": 0, "counting": False}
    for mod in (ops, linear_mod):
        real = mod.reconstruct

        def counted(*a, _real=real, **k):
            decodes["n"] += decodes["counting"]
            return _real(*a, **k)
        mod.reconstruct = counted

    # every Triton compile of an exl3rt kernel while vLLM generates (none: every specialization was compiled in
    # process_weights_after_loading, before vLLM's profile run and graph capture); Triton calls the hook before each
    # JIT compile, a load from its disk cache included
    compiles = {"n": 0, "counting": False, "names": []}
    try:
        from triton import knobs

        chained = knobs.runtime.jit_cache_hook

        def on_compile(*a, **k):
            name = str(getattr(k.get("fn"), "module", "") or "")       # JitFunctionInfo(module, name, fn)
            if compiles["counting"] and name.startswith("exl3rt"):
                compiles["n"] += 1
                compiles["names"].append(k.get("repr", name)[:120])
            return chained(*a, **k) if chained else False
        knobs.runtime.jit_cache_hook = on_compile
    except (ImportError, AttributeError):       # no Triton (the CPU build) or one without the hook
        compiles["n"] = None

    kw = {}
    if args.bits is not None:
        bits = int(args.bits) if float(args.bits).is_integer() else args.bits
        kw["hf_overrides"] = {"quantization_config": {"quant_method": "exl3", "bits": bits}}
    llm = LLM(model=args.model, quantization="exl3", dtype=args.dtype, enforce_eager=not args.compile, max_model_len=128,
              skip_tokenizer_init=False, seed=0, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    decodes["counting"] = compiles["counting"] = True
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    seconds = time.perf_counter() - t0
    decodes["counting"] = compiles["counting"] = False
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    info = llm.apply_model(_inspect)[0]
    with open(args.out, "w") as f:
        json.dump({"tokens": tokens, "decodes_while_generating": decodes["n"], "generate_seconds": seconds,
                   "exl3rt_compiles_while_generating": compiles["n"], "compiled": compiles["names"][:8], **info},
                  f, indent=1, default=str)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown
