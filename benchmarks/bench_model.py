"""Whole models in transformers on the GPU: EXL3 (random codes, no encoding) beside BF16 in the same run.

    python benchmarks/bench_model.py --model llama8b --bits 4
    python benchmarks/bench_model.py --model llama8b --bits 2 3 6          # one BF16 row, then one row per K
    python benchmarks/bench_model.py --model qwen3moe --layers 16 --profile  # mixed K3/K4 experts; GPU time by kernel
    python benchmarks/bench_model.py --bits 4 --exllamav3 /tmp/ckpt         # and exllamav3 on the same codes

The model is built from a config with random BF16 weights on the GPU and timed; then every decoder linear (and
every expert) is replaced in place by EXL3 codes (``quantize_model`` with the encoder swapped for random codes
of the right shapes: the kernels' time does not depend on the codes) and timed again. Rows of the table:

- ``forward eager``: one token, no KV cache, ``model(ids)`` as ``generate`` runs it eagerly (ms);
- ``forward graph``: the same forward captured by hand in one CUDA graph, replayed (ms);
- ``forward compiled``: the same under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs);
- ``decode``: greedy tokens/s after a ``--prompt``-token prompt, static KV cache, ``generate`` compiling the
  decode step (``cache_implementation="static"``): (new tokens - 1) / (time(N new) - time(1 new));
- ``prefill``: one ``--prefill``-token forward, eager (ms).

``--exllamav3 DIR`` (when ``exllamav3`` imports): the EXL3 model is written to DIR as a checkpoint
(``exl3rt.runtime.export.save_exl3``: the same codes, bit for bit), freed, and loaded by exllamav3, whose
eager one-token forward (``model.forward(ids, {})``, no cache, as ours) and prefill are timed in the same
process; its logits are compared with ours.

Prints the table and writes benchmarks/results/model_<model>.json.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, median_ms, write_json  # noqa: E402

CONFIGS = {
    # Llama-3-8B's shapes
    "llama8b": dict(kind="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096),
    # Qwen3-30B-A3B's shapes (48 layers in the real model)
    "qwen3moe": dict(kind="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=4096,
                     norm_topk_prob=True),
}


def build(name: str, layers: int | None):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    spec = dict(CONFIGS[name])
    kind = spec.pop("kind")
    if layers:
        spec["num_hidden_layers"] = layers
    cfg = (LlamaConfig if kind == "llama" else Qwen3MoeConfig)(**spec, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def random_codes(weight, bits, codebook="mcg", hessian=None, seed=0, **_):
    """What the encoder would return, with uniformly random codes, made on the weight's device."""
    from exl3rt.format.encoded import EncodedLinear, padded_width
    from exl3rt.format.bits import words16_per_tile

    n_in, n_out = weight.shape
    in_p, out_p = padded_width(n_in), padded_width(n_out)
    dev = weight.device
    g = torch.Generator(device=dev).manual_seed(int(seed) & 0x7FFFFFFF)
    trellis = torch.randint(-32768, 32768, (in_p // 16, out_p // 16, words16_per_tile(bits)), dtype=torch.int16,
                            device=dev, generator=g)

    def scales(n, s):
        sign = torch.where(torch.rand(n, device=dev, generator=g) < 0.5, -1.0, 1.0)
        return (sign * s * (0.5 + torch.rand(n, device=dev, generator=g))).to(torch.float16)

    enc = EncodedLinear(trellis=trellis, suh=scales(in_p, 0.02 / n_in ** 0.25), svh=scales(out_p, 0.02),
                        codebook=codebook, in_features=n_in, out_features=n_out)
    enc.info = {"proxy_err": 0.0}
    return enc


def fuse_as(model, fuse: str) -> None:
    """``on``: q/k/v and gate/up fused and the gated MLPs as one call (prepare_model's default); ``apart``: the same
    groups fused, each MLP's layers still called apart; ``off``: nothing fused. Compiles the kernels."""
    from exl3rt.integrations.generation import prepare_model
    from exl3rt.runtime.fusion import fuse_gated_mlps, fuse_linears

    if fuse != "off":
        fuse_linears(model, mlps=False)
        if fuse == "on":
            fuse_gated_mlps(model)
    prepare_model(model, torch.bfloat16, fuse=False)
    torch.cuda.synchronize()


def to_exl3(model, bits, moe_mixed: bool, fuse: str = "on"):
    import exl3rt
    import exl3rt.cache.key as ck
    import exl3rt.encode.quantize as q

    q.quantize_weight = random_codes
    ck.tensor_digest = lambda t: "random"   # cache off: the key only carries the shapes here
    kw = {}
    if moe_mixed:   # K3 experts, the first quarter of each layer's experts at K4
        n = model.config.num_experts
        kw["expert_bits"] = {f"model.layers.{i}.mlp.experts": {e: 4 for e in range(n // 4)}
                             for i in range(model.config.num_hidden_layers)}
    cfg = exl3rt.Exl3Config(bits=3 if moe_mixed else bits, cache_mode="off", progress=False, **kw)
    summary = exl3rt.quantize_model(model, cfg, progress=False)
    fuse_as(model, fuse)     # compiles every kernel specialization before any timing
    return summary


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median ms of ``fn()`` over ``iters`` calls, each between two CUDA events."""
    return median_ms(fn, iters, warmup=warmup)


def interleaved_eager(args) -> dict:
    """One-token eager forwards of BF16, EXL3 unfused and EXL3 fused models held side by side, timed in turns
    (``args.rounds`` rounds): an eager forward is bound by the host, whose speed drifts within a run, so each
    model's best round is compared with the others' taken minutes apart at most."""
    models = {"bf16": build(args.model, args.layers)}
    variants = ((("exl3 fused, MLP apart", "apart"),) if args.fuse == "gated-both" else (("exl3 unfused", "off"),)) \
        + (("exl3 fused", "on"),)
    for label, fuse in variants:
        models[label] = build(args.model, args.layers)
        to_exl3(models[label], args.bits[0], args.model == "qwen3moe", fuse=fuse)
    one = torch.randint(3, models["bf16"].config.vocab_size, (1, 1), device="cuda")
    best = {k: float("inf") for k in models}
    with torch.no_grad():
        for r in range(args.rounds):
            for k, m in models.items():
                best[k] = min(best[k], timed(lambda: m(one, use_cache=False), args.iters))
            print(f"round {r}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in best.items()), flush=True)
    print(f"\n{args.model} eager one-token forward, best of {args.rounds} interleaved rounds of {args.iters} "
          f"(median each), K{args.bits[0]}, {torch.cuda.get_device_name()}")
    for k, v in best.items():
        print(f"{k:<14}{v:>9.2f} ms{v / best['bf16']:>8.2f}x")
    return {k + " forward eager ms": v for k, v in best.items()}


def profile(fn, label: str, top: int = 12) -> None:
    """GPU time of one call of ``fn`` by kernel name (the top ``top``), and the sum over all kernels."""
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in evs)
    print(f"{label}: GPU kernel time {total / 1e3:.2f} ms in {sum(e.count for e in evs)} launches")
    for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.3f} ms {e.count:6d}x  {e.key[:90]}")


def measure(model, args, label: str) -> dict:
    out: dict = {}
    vocab = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(1)
    one = torch.randint(3, vocab, (1, 1), device="cuda", generator=g)
    with torch.no_grad():
        ref = model(one, use_cache=False).logits.float()
        out["_ref"] = (one, ref)
        if "eager" in args.modes:
            out["forward eager ms"] = timed(lambda: model(one, use_cache=False), args.iters)
            print(f"{label}: forward eager {out['forward eager ms']:.2f} ms", flush=True)
        if args.profile:
            try:
                profile(lambda: model(one, use_cache=False), label)
            except Exception as exc:    # the profiler is a diagnostic; the timings go on without it
                print(f"{label}: profile failed: {exc!r}")
        if "graph" in args.modes:     # the whole one-token forward captured by hand in one CUDA graph
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    model(one, use_cache=False)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = model(one, use_cache=False).logits
            graph.replay()
            torch.cuda.synchronize()
            out["graph vs eager rel err"] = float((static.float() - ref).norm() / ref.norm())
            out["forward graph ms"] = timed(graph.replay, args.iters)
            print(f"{label}: forward graph {out['forward graph ms']:.2f} ms (rel err vs eager "
                  f"{out['graph vs eager rel err']:.1e})", flush=True)
            del graph, static
        if "compiled" in args.modes:
            t0 = time.perf_counter()
            cm = torch.compile(model, mode="reduce-overhead", fullgraph=True)
            got = cm(one, use_cache=False).logits.float()
            cm(one, use_cache=False)
            out["compile s"] = time.perf_counter() - t0
            out["compiled vs eager rel err"] = float((got - ref).norm() / ref.norm())
            out["forward compiled ms"] = timed(lambda: cm(one, use_cache=False), args.iters)
            print(f"{label}: forward compiled {out['forward compiled ms']:.2f} ms (compile {out['compile s']:.0f} s, "
                  f"rel err vs eager {out['compiled vs eager rel err']:.1e})", flush=True)
            torch._dynamo.reset()
        if args.decode:
            prompt = torch.randint(3, vocab, (1, args.prompt), device="cuda", generator=g)

            def gen(n):
                return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, cache_implementation="static",
                                      pad_token_id=0)
            t0 = time.perf_counter()
            gen(args.decode)          # compiles the decode step
            out["decode compile s"] = time.perf_counter() - t0

            def wall(n):
                torch.cuda.synchronize()
                t = time.perf_counter()
                gen(n)
                torch.cuda.synchronize()
                return time.perf_counter() - t
            t1 = min(wall(1) for _ in range(2))
            tn = min(wall(args.decode) for _ in range(2))
            out["decode tok/s"] = (args.decode - 1) / (tn - t1)
            print(f"{label}: decode {out['decode tok/s']:.1f} tok/s", flush=True)
            torch._dynamo.reset()
        if args.prefill:
            ids = torch.randint(3, vocab, (1, args.prefill), device="cuda", generator=g)
            out["prefill ms"] = timed(lambda: model(ids, use_cache=False), max(3, args.iters // 4))
            print(f"{label}: prefill {args.prefill} {out['prefill ms']:.1f} ms", flush=True)
            if args.profile:
                try:
                    profile(lambda: model(ids, use_cache=False), f"{label} prefill {args.prefill}")
                except Exception as exc:
                    print(f"{label}: prefill profile failed: {exc!r}")
    return out


def measure_exllamav3(model, args, ours: dict) -> dict:
    """exllamav3 on the codes of ``model``: written as a checkpoint, ``model`` freed, loaded, timed."""
    from exllamav3 import Config, Model

    from exl3rt.runtime.export import save_exl3

    out: dict = {}
    t0 = time.perf_counter()
    path = save_exl3(model, args.exllamav3, overwrite=True, progress=False)
    out["checkpoint write s"] = time.perf_counter() - t0
    one, ref = ours["_ref"]
    model.to("meta")
    torch.cuda.empty_cache()
    cfg = Config.from_directory(str(path))
    ex = Model.from_config(cfg)
    ex.load("cuda:0")
    with torch.no_grad():
        ids = one.cpu()
        got = ex.forward(ids, {}).float().to(ref.device)[..., : ref.shape[-1]]
        out["logits rel diff vs exl3rt"] = float((got - ref).norm() / ref.norm())
        out["forward eager ms"] = timed(lambda: ex.forward(ids, {}), args.iters)
        print(f"exllamav3: forward eager {out['forward eager ms']:.2f} ms (logits vs exl3rt rel "
              f"{out['logits rel diff vs exl3rt']:.1e})", flush=True)
        if args.prefill:
            long = torch.randint(3, model.config.vocab_size, (1, args.prefill))
            try:
                out["prefill ms"] = timed(lambda: ex.forward(long, {}), max(3, args.iters // 4))
                print(f"exllamav3: prefill {args.prefill} {out['prefill ms']:.1f} ms", flush=True)
            except Exception as exc:      # its attention may need a cache at this length
                print(f"exllamav3: prefill failed: {exc!r}"[:300], flush=True)
    ex.unload()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(CONFIGS), default="llama8b")
    ap.add_argument("--bits", type=int, nargs="+", default=[4],
                    help="K of the dense model's linears; several: one EXL3 row each, beside one BF16 row")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the real model")
    ap.add_argument("--modes", nargs="+", default=["eager", "graph", "compiled"],
                    help="one-token forward modes: eager, graph (captured by hand), compiled (reduce-overhead)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--decode", type=int, default=128, help="new tokens in the decode measurement (0: skip)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=2048, help="prefill tokens (0: skip)")
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--interleave", action="store_true",
                    help="only the eager one-token forward: BF16, EXL3 unfused and fused held side by side and "
                         "timed in turns (--rounds), against the host's drift")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fuse", choices=("on", "off", "apart", "both", "gated-both"), default="on",
                    help="on: q/k/v and gate/up as one fused call each and each gated MLP as one call "
                         "(exl3rt.runtime.fuse_linears, the default of prepare_model); apart: the groups fused, "
                         "the MLP's layers called apart; both: the unfused model first, then the same codes "
                         "fused; gated-both: 'apart' first, then 'on' (with --interleave: those two beside BF16)")
    ap.add_argument("--exllamav3", metavar="DIR", default=None,
                    help="write the (last) EXL3 model to DIR and time exllamav3 on the same codes")
    ap.add_argument("--profile", action="store_true",
                    help="also print where the GPU time of one eager one-token forward (and of the prefill) goes "
                         "(top kernels); profile in a run of its own: times taken after a profile in the same "
                         "process read up to 2x slow")
    args = ap.parse_args()
    if args.interleave:
        rows = interleaved_eager(args)
        write_json(Path(__file__).resolve().parent / "results" / f"model_{args.model}_interleaved.json", {
            "date": datetime.date.today().isoformat(), "commit": commit(), "device": torch.cuda.get_device_name(),
            "model": args.model, "args": vars(args), "rows": rows})
        return 0

    model = build(args.model, args.layers)
    rows = {}
    if not args.skip_bf16:
        rows["bf16"] = measure(model, args, "bf16")
    moe = args.model == "qwen3moe"
    for i, bits in enumerate([3] if moe else args.bits):
        if i:       # a fresh BF16 model for the next K (the codes replace the linears in place)
            del model
            torch.cuda.empty_cache()
            model = build(args.model, args.layers)
        t0 = time.perf_counter()
        first = {"both": "off", "gated-both": "apart"}.get(args.fuse, args.fuse)
        to_exl3(model, bits, moe, fuse=first)
        label = "exl3 K3/K4 experts" if moe else f"exl3 K{bits}"
        print(f"{label}: codes installed in {time.perf_counter() - t0:.0f} s", flush=True)
        if args.fuse in ("both", "gated-both"):
            rows[label + (" unfused" if first == "off" else " MLP-apart")] = measure(model, args, f"{label} {first}")
            from exl3rt.runtime.fusion import fuse_gated_mlps, fuse_linears
            from exl3rt.integrations.generation import prepare_model
            fuse_linears(model) if first == "off" else fuse_gated_mlps(model)
            prepare_model(model, torch.bfloat16, fuse=False)
            torch.cuda.synchronize()
        rows[label] = measure(model, args, label)
    if args.exllamav3:
        rows["exllamav3"] = measure_exllamav3(model, args, rows[label])
    for r in rows.values():
        r.pop("_ref", None)

    keys = sorted({k for r in rows.values() for k in r})
    print(f"\n{args.model} ({model.config.num_hidden_layers} layers), {torch.cuda.get_device_name()}")
    names = list(rows)
    base = rows.get("bf16")
    print(f"{'':<26}" + "".join(f"{name:>20}" for name in names)
          + ("".join(f"{'/bf16 ' + n.split()[-1]:>12}" for n in names[1:]) if base else ""))
    for k in keys:
        vals = [rows[name].get(k) for name in names]
        line = f"{k:<26}" + "".join(f"{v:>20.3f}" if v is not None else f"{'-':>20}" for v in vals)
        if base:
            line += "".join(f"{v / vals[0]:>11.2f}x" if v is not None and vals[0] else f"{'-':>12}"
                            for v in vals[1:])
        print(line)
    write_json(Path(__file__).resolve().parent / "results" / f"model_{args.model}.json", {
        "date": datetime.date.today().isoformat(), "commit": commit(), "device": torch.cuda.get_device_name(),
        "model": args.model, "layers": model.config.num_hidden_layers, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
