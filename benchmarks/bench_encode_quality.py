"""Encoder quality against exllamav3 1.6.5 on its own golden layers (same weights, same K, same codebook).

For every golden file: the reference's relative error ||recon - W|| / ||W|| and ours (CPU backend),
and their ratio; for *_calib files the proxy error tr(E H E^T)/tr(W H W^T) of both. Prints a table,
writes JSON (benchmarks/results/encode_quality.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
from common import commit, write_json
from safetensors import safe_open

from exl3rt.encode.quantize import proxy_error, quantize_weight

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--golden", default=str(REPO.parent / "shared" / "golden"))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="benchmarks/results/encode_quality.json")
    args = ap.parse_args()
    files = sorted(Path(args.golden).glob("[0-9]*.safetensors"))
    if not files:
        sys.exit(f"no golden files in {args.golden}")
    rows = []
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            g = {k: h.get_tensor(k) for k in h.keys()}
            meta = h.metadata()
        k = float(meta["K"])
        k = int(k) if k.is_integer() else k
        w = g["weight"]
        hess = g.get("H")
        dev_w = w.to(args.device)
        dev_h = None if hess is None else hess.to(args.device)
        enc = quantize_weight(dev_w, k, meta["codebook"], hessian=dev_h, seed=int(meta["seed"]),
                              backend=args.backend).to("cpu")
        ours = float((enc.reconstruct() - w).norm() / w.norm())
        ref = float((g["recon"] - w).norm() / w.norm())
        row = {"file": f.name, "K": k, "codebook": meta["codebook"], "ref_rel_err": ref, "our_rel_err": ours,
               "ratio": ours / ref, "seconds": enc.info["seconds"], "backend": enc.info["backend"]}
        if hess is not None:
            row["ref_proxy"] = float(meta["proxy_err"])
            row["our_proxy"] = proxy_error(w, enc.reconstruct(), hess)
        rows.append(row)
    print(f"{'file':<42} {'ref err':>8} {'our err':>8} {'ratio':>6} {'ref proxy':>10} {'our proxy':>10}")
    for r in rows:
        px = f"{r['ref_proxy']:>10.6f} {r['our_proxy']:>10.6f}" if "ref_proxy" in r else ""
        print(f"{r['file']:<42} {r['ref_rel_err']:>8.5f} {r['our_rel_err']:>8.5f} {r['ratio']:>6.3f} {px}")
    write_json(args.out, {"date": dt.date.today().isoformat(), "commit": commit(), "device": args.device,
                          "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
