"""Encoding cache costs: the content hash (candidates) and cache read / publish throughput.

1. Hash throughput on a --hash-mb MB bf16 tensor (default 100 MB), best of --repeats:
   sha256, blake2b (hashlib), blake3 on one thread and on all cores, xxh3_128 and xxh64 (if the
   xxhash package is installed), and exl3rt.cache.tensor_digest (the chosen one, with its tensor view).
2. Cache throughput for --layers random layers of --shape IN OUT at K = --bits (default 8 x 4096 x 4096,
   K = 4, i.e. 8 MiB trellis each) in a temporary directory: publish (write + fsync + rename) and read
   (load_or_encode hits: header, key and payload-digest checks, finiteness, EncodedLinear validation).
   Reads come from the page cache (warm), so they measure the CPU-side cost, not the disk.
Prints a table and writes JSON (default benchmarks/results/cache.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import platform
import tempfile
import time

import torch
from common import commit, write_json

from exl3rt.cache import CacheKey, EncodingCache, tensor_digest
from exl3rt.format.random import random_linear


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def hash_rows(mb: int, repeats: int) -> list[dict]:
    t = torch.randn(mb * 1_000_000 // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    buf = memoryview(t.view(torch.uint8).numpy())
    cands = {"sha256": lambda: hashlib.sha256(buf).hexdigest(),
             "blake2b": lambda: hashlib.blake2b(buf).hexdigest()}
    try:
        import blake3
        cands["blake3 (1 thread)"] = lambda: blake3.blake3(buf).hexdigest()
        cands["blake3 (all cores)"] = lambda: blake3.blake3(buf, max_threads=blake3.blake3.AUTO).hexdigest()
    except ImportError:
        print("blake3 not installed")
    try:
        import xxhash
        cands["xxh3_128"] = lambda: xxhash.xxh3_128(buf).hexdigest()
        cands["xxh64"] = lambda: xxhash.xxh64(buf).hexdigest()
    except ImportError:
        print("xxhash not installed (pip install xxhash to compare it)")
    cands["tensor_digest (chosen)"] = lambda: tensor_digest(t)
    rows = []
    for name, fn in cands.items():
        sec = best_of(fn, repeats)
        rows.append({"hash": name, "bytes": t.nbytes, "seconds": sec, "gb_per_s": t.nbytes / sec / 1e9})
    return rows


def cache_rows(n_in: int, n_out: int, bits, layers: int, repeats: int) -> dict:
    lins = [random_linear(n_in, n_out, bits, "mcg", seed=i) for i in range(layers)]
    for lin in lins:
        lin.info["proxy_err"] = 0.01
    keys = [CacheKey(source_digest=f"{i:064x}", source_dtype="torch.bfloat16", source_shape=(n_out, n_in),
                     bits=bits, codebook="mcg", seed=0, encoder_version=1, in_features=n_in, out_features=n_out,
                     in_padded=lins[0].in_padded, out_padded=lins[0].out_padded) for i in range(layers)]
    with tempfile.TemporaryDirectory(prefix="exl3rt-bench-cache-") as root:
        cache = EncodingCache(root, "readwrite")
        t0 = time.perf_counter()
        for k, lin in zip(keys, lins):
            cache.load_or_encode(k, lambda lin=lin: lin)
        publish = time.perf_counter() - t0
        entry_bytes = sum(cache.path_for(k).stat().st_size for k in keys)
        reader = EncodingCache(root, "readonly")

        def read_all():
            for k in keys:
                assert reader.load_or_encode(k, lambda: None).hit  # type: ignore[arg-type,return-value]

        read = best_of(read_all, repeats)
    return {"shape": [n_in, n_out], "bits": bits, "layers": layers, "entry_bytes": entry_bytes,
            "publish_seconds": publish, "publish_gb_per_s": entry_bytes / publish / 1e9,
            "read_seconds": read, "read_gb_per_s": entry_bytes / read / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hash-mb", type=int, default=100)
    ap.add_argument("--shape", type=int, nargs=2, default=[4096, 4096], metavar=("IN", "OUT"))
    ap.add_argument("--bits", type=float, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cache.json")
    args = ap.parse_args()
    bits = int(args.bits) if float(args.bits).is_integer() else args.bits
    hashes = hash_rows(args.hash_mb, args.repeats)
    print(f"hash of a {args.hash_mb} MB bf16 tensor (best of {args.repeats})")
    print(f"{'hash':<24} {'ms':>8} {'GB/s':>7}")
    for r in hashes:
        print(f"{r['hash']:<24} {1e3 * r['seconds']:>8.1f} {r['gb_per_s']:>7.2f}")
    io = cache_rows(*args.shape, bits, args.layers, args.repeats)
    print(f"\ncache, {io['layers']} entries of {io['shape'][0]} x {io['shape'][1]} K={bits} "
          f"({io['entry_bytes'] / io['layers'] / 2**20:.1f} MiB each)")
    print(f"publish  {io['publish_gb_per_s']:.2f} GB/s  (write + fsync + rename + dir fsync)")
    print(f"read     {io['read_gb_per_s']:.2f} GB/s  (warm page cache, fully validated)")
    write_json(args.out, {
        "what": "encoding cache: content hash candidates and entry read/publish throughput",
        "date": dt.date.today().isoformat(), "commit": commit(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "hash": hashes, "cache": io,
    })


if __name__ == "__main__":
    main()
