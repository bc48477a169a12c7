"""Host time of an eager one-token forward, part by part: BF16 beside EXL3 in one process.

    python benchmarks/bench_host.py                      # Llama-3-8B-shaped, 4 layers, K4, CUDA
    python benchmarks/bench_host.py --cprofile           # and where the EXL3 model's host time goes, by function
    python benchmarks/bench_host.py --tiny --device cpu  # the same bookkeeping on a tiny model (what CI runs)

An eager one-token forward is bound by the host: the GPU finishes each kernel long before the next is launched.
So the question is not how fast the kernels are but how much Python and launch work each part of a decoder layer
costs. For each part (q/k/v on one input, o_proj, the attention, the MLP, a norm, one decoder layer, every layer
in turn, the whole forward) this times many calls back to back by the host's clock, and takes the best of
``--rounds`` rounds in which the BF16 and EXL3 models take turns (the host's speed drifts within a run). It also
counts Python garbage collections per forward and times the forward with the collector off.

On CUDA the EXL3 model runs as ``exl3rt generate`` and the transformers integration run it (q/k/v and gate/up
fused, the gated MLP as one call, kernels prewarmed); weights and codes are random (``bench_model.random_codes``).
Prints the table and writes benchmarks/results/host_<model>.json (or ``--json``).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, write_json  # noqa: E402

TINY = dict(kind="llama", hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)


def build(spec: dict, layers: int, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    spec = dict(spec)
    spec.pop("kind")
    spec["num_hidden_layers"] = layers
    cfg = LlamaConfig(**spec, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def to_exl3(model, bits: int) -> int:
    """Random EXL3 codes in place of every decoder linear, prepared as the integrations prepare a model; returns
    how many linears are EXL3 now."""
    import exl3rt
    import exl3rt.cache.key as ck
    import exl3rt.encode.quantize as q
    from bench_model import random_codes
    from exl3rt.integrations.generation import prepare_model
    from exl3rt.runtime.linear import Exl3Linear

    q.quantize_weight = random_codes
    ck.tensor_digest = lambda t: "random"
    exl3rt.quantize_model(model, exl3rt.Exl3Config(bits=bits, cache_mode="off", progress=False), progress=False)
    prepare_model(model, torch.bfloat16)
    return sum(isinstance(m, Exl3Linear) for m in model.modules())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_us(fn, iters: int, device: str) -> float:
    """Host µs per call of ``fn`` over ``iters`` calls back to back (the device finishes them after the clock
    stops: only the host's work is timed)."""
    for _ in range(3):
        fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t) / iters * 1e6
    sync(device)
    return dt


def parts(model, device: str) -> dict:
    """The calls timed, by name: each a decoder-layer part on a one-token input."""
    layer = model.model.layers[0]
    attn = layer.self_attn
    x = torch.randn(1, 1, model.config.hidden_size, device=device, dtype=torch.bfloat16)
    pos = torch.zeros(1, 1, dtype=torch.long, device=device)
    pe = model.model.rotary_emb(x, pos)
    one = torch.randint(3, model.config.vocab_size, (1, 1), device=device)

    def qkv():
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    def every_layer():
        h = x
        for lay in model.model.layers:
            h = lay(h, position_embeddings=pe, attention_mask=None, position_ids=pos)
        return h

    return {
        "q/k/v (three calls, one input)": qkv,
        "o_proj": lambda: attn.o_proj(x),
        "attention": lambda: attn(hidden_states=x, position_embeddings=pe, attention_mask=None),
        "mlp": lambda: layer.mlp(x),
        "input_layernorm": lambda: layer.input_layernorm(x),
        "decoder layer": lambda: layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos),
        "every layer in turn": every_layer,
        "model forward": lambda: model(one, use_cache=False),
    }


def dense_logits_rel_err(model, one: torch.Tensor) -> float:
    """The EXL3 model's logits against the same model with every EXL3 linear replaced by an ``nn.Linear`` holding
    its decoded weight (``format.reconstruct``, fp32 then bf16): relative error. Replaces them in place."""
    from exl3rt.runtime.linear import Exl3Linear
    from exl3rt.runtime.surgery import replace_module

    got = model(one, use_cache=False).logits.float()
    from exl3rt.runtime.fusion import unfuse_linears
    unfuse_linears(model)
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, Exl3Linear)]:
        dense = torch.nn.Linear(m.in_features, m.out_features, bias=False, device=one.device, dtype=torch.bfloat16)
        dense.weight.data.copy_(m.dequantized_weight(torch.float32).t())
        replace_module(model, name, dense)
    want = model(one, use_cache=False).logits.float()
    return float((got - want).norm() / want.norm())


def gc_per_forward(fn, n: int) -> float:
    """Python garbage collections per call of ``fn`` (any generation)."""
    count = [0]

    def cb(phase, info):
        if phase == "start":
            count[0] += 1
    gc.callbacks.append(cb)
    try:
        for _ in range(n):
            fn()
    finally:
        gc.callbacks.remove(cb)
    return count[0] / n


def profile_text(fn, n: int, top: int) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (the host's cost per layer is the point)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--iters", type=int, default=300, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=3, help="rounds in which the two models take turns; best kept")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 8B-shaped one")
    ap.add_argument("--cprofile", action="store_true", help="print the EXL3 model forward's top functions")
    ap.add_argument("--json", default=None, help="where to write the results")
    args = ap.parse_args(argv)
    from bench_model import CONFIGS

    name = "tiny" if args.tiny else "llama8b"
    spec = TINY if args.tiny else CONFIGS["llama8b"]
    models = {"bf16": build(spec, args.layers, args.device), "exl3": build(spec, args.layers, args.device)}
    n_exl3 = to_exl3(models["exl3"], args.bits)
    calls = {k: parts(m, args.device) for k, m in models.items()}
    best = {k: {p: float("inf") for p in calls[k]} for k in models}
    extra = {k: {} for k in models}
    with torch.no_grad():
        for r in range(args.rounds):
            for k in models:
                for p, fn in calls[k].items():
                    best[k][p] = min(best[k][p], host_us(fn, args.iters, args.device))
                fwd = calls[k]["model forward"]
                gc.disable()
                try:
                    off = host_us(fwd, args.iters, args.device)
                finally:
                    gc.enable()
                extra[k]["model forward, gc off"] = min(extra[k].get("model forward, gc off", float("inf")), off)
                extra[k]["gc collections per forward"] = gc_per_forward(fwd, args.iters)
            print(f"round {r}: model forward bf16 {best['bf16']['model forward']:.1f} µs, "
                  f"exl3 {best['exl3']['model forward']:.1f} µs", flush=True)
        if args.cprofile:
            for k in models:
                print(f"\n==== {k}: model forward x{args.iters}, by own time")
                print("\n".join(profile_text(calls[k]["model forward"], args.iters, 25).splitlines()[4:36]))
        one = torch.randint(3, models["exl3"].config.vocab_size, (1, 1), device=args.device)
        rel = dense_logits_rel_err(models["exl3"], one)
    rows = {k: {**best[k], **extra[k]} for k in models}
    print(f"\nhost µs per call, {name} ({args.layers} layers), K{args.bits}, {n_exl3} EXL3 linears, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}; EXL3 logits vs its decoded "
          f"weights as nn.Linear: {rel:.1e} relative")
    print(f"{'':<34}{'bf16':>10}{'exl3':>10}{'exl3/bf16':>11}")
    for p in rows["bf16"]:
        a, b = rows["bf16"][p], rows["exl3"][p]
        ratio = f"{b / a:>10.2f}x" if a else f"{'-':>11}"
        print(f"{p:<34}{a:>10.1f}{b:>10.1f}{ratio}")
    out = args.json or Path(__file__).resolve().parent / "results" / f"host_{name}.json"
    write_json(out, {"date": datetime.date.today().isoformat(), "commit": commit(),
                     "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                     "model": name, "layers": args.layers, "bits": args.bits, "exl3_linears": n_exl3,
                     "exl3_vs_decoded_rel_err": rel,
                     "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
