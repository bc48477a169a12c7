#!/usr/bin/env bash
# Does a checkpoint written by `exl3rt quantize` load in exllamav3 and compute the same thing?
#
# Run on a CUDA machine from the repo root, after preparing the checkpoints on any machine with
#     PYTHONPATH=src python benchmarks/prep_exllamav3_check.py .ex3check
# and putting the exllamav3 1.6.5 wheel and its missing dependencies (marisa_trie, llguidance,
# pydantic, pydantic_core, annotated_types, typing_inspection) in .whl/:
#     bash benchmarks/check_exllamav3_load.sh [.ex3check] [.whl]
# For each case it loads <case>/exl3 with exllamav3 (Config.from_directory, Model.from_config,
# model.load("cuda:0")), runs model.forward on the token ids of <case>/ref.pt (once through the
# EXL3 GEMM kernels, once through the reconstruct path) and compares the logits with the float32
# reference, then compares every linear exllamav3 loaded (its own decode and reconstruction) with
# exl3rt.format's, then probes 32-row and 1-row forwards (retried with infer_params.no_reconstruct
# if they fail: see docs/format.md, "Loading in exllamav3"). Writes $OUT/results.json (OUT defaults
# to <check>/out) and prints a table.
#
# exllamav3 JIT-builds its extension at first import (300 s on an H200 machine's 16 cores, sm_90 only). The
# built library is left, xz-compressed and split, in $OUT/ext.so.xz.*; put those parts in
# <check>/ext/ to skip the build next time (same image).
set -uo pipefail
CHECK=${1:-.ex3check}
WHL=${2:-.whl}
OUT=${OUT:-$CHECK/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} TORCH_EXTENSIONS_DIR=/tmp/tex
export PYTHONUNBUFFERED=1
if ls "$CHECK"/ext/ext.so.xz.* >/dev/null 2>&1; then
    mkdir -p /tmp/prebuilt && cat "$CHECK"/ext/ext.so.xz.* | xz -d > /tmp/prebuilt/exllamav3_ext.so || exit 1
    export PYTHONPATH=/tmp/prebuilt:$PYTHONPATH
    echo "using the prebuilt extension from $CHECK/ext"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
t0=$(date +%s)
timeout "${BUILD_TIMEOUT:-470}" python3 -c "import exllamav3.ext" 2>&1 | tail -40
rc=${PIPESTATUS[0]}
echo "import exllamav3.ext (build) took $(( $(date +%s) - t0 )) s, rc $rc"
[ "$rc" = 0 ] || exit 1
so=$(ls /tmp/tex/exllamav3_ext/exllamav3_ext*.so 2>/dev/null | head -1)
if [ -n "$so" ]; then
    ls -la "$so"
    xz -T0 -6 -c "$so" | split -b 15M - "$OUT/ext.so.xz."
    ls -la "$OUT"
fi

python3 - "$CHECK" "$OUT" <<'EOF'
import json, sys, time, traceback
from pathlib import Path

import torch

root, out = Path(sys.argv[1]), Path(sys.argv[2])
from exllamav3 import Config, Model
from exllamav3.modules import Linear
from exllamav3.version import __version__ as ex3_version
from exl3rt.format import Exl3Checkpoint

print("exllamav3", ex3_version)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def compare(lg, ref, vocab):
    lg = lg.float().cpu()[0, :, :vocab]
    ref = ref[: lg.shape[0]]
    return {"max_abs": float((lg - ref).abs().max()), "ref_max_abs": float(ref.abs().max()), "rel": rel(lg, ref),
            "argmax_agree": float((lg.argmax(-1) == ref.argmax(-1)).float().mean())}


def load(case, **infer):
    cfg = Config.from_directory(str(case / "exl3"))
    for k, v in infer.items():
        setattr(cfg.infer_params, k, v)
    model = Model.from_config(cfg)
    model.load("cuda:0")
    return cfg, model


def short_forwards(model, ids, ref, vocab):
    """Forwards of 32 rows and of 1 row (the first positions of the same causal sequence)."""
    res = {}
    for n in (32, 1):
        try:
            res[f"rows{n}"] = compare(model.forward(ids[:, :n].contiguous(), {}), ref, vocab)
        except Exception as exc:
            res[f"rows{n}"] = {"error": f"{type(exc).__name__}: {exc}"}
    return res


results = []
for case in sorted(p for p in root.iterdir() if (p / "ref.pt").exists()):
    r = {"case": case.name}
    results.append(r)
    try:
        ref = torch.load(case / "ref.pt")
        r["args"], r["model"] = ref["args"], ref["model"]
        t = time.perf_counter()
        cfg, model = load(case)
        r["load_s"] = round(time.perf_counter() - t, 2)
        ids, vocab = ref["ids"], cfg.vocab_size
        r["seq"] = int(ids.shape[1])
        for mode, params in (("kernel", {}), ("reconstruct", {"reconstruct": True})):
            lg = model.forward(ids, dict(params))
            r[f"{mode}_logits_shape"] = list(lg.shape)
            r[f"{mode}_vs_deq"] = compare(lg, ref["deq"], vocab)
            r[f"{mode}_vs_orig"] = compare(lg, ref["orig"], vocab)
        ckpt = Exl3Checkpoint(case / "exl3")
        layers = {}
        for m in model:
            if not isinstance(m, Linear) or m.inner is None:
                continue
            if m.quant_type != "exl3":
                layers[m.key] = {"quant_type": m.quant_type}
                continue
            ours = ckpt.load_linear(m.key)
            q_ex = m.inner.get_inner_weight_tensor().cpu()
            w_ex = m.inner.get_weight_tensor().float().cpu()
            q_us = ours.decode()
            w_us = ours.reconstruct(trim=False)
            layers[m.key] = {
                "K": m.inner.K, "codebook": "mcg" if m.inner.mcg else "mul1" if m.inner.mul1 else "3inst",
                "shape": list(w_ex.shape), "ours_shape": list(w_us.shape),
                "Q_equal": bool(torch.equal(q_ex, q_us)), "Q_max_abs": float((q_ex.float() - q_us.float()).abs().max()),
                "W_rel": rel(w_ex, w_us), "W_max_abs": float((w_ex - w_us).abs().max()),
            }
        r["layers"] = layers
        r["short"] = short_forwards(model, ids, ref["deq"], vocab)
        model.unload()
        del model
        if any("error" in v for v in r["short"].values()):
            # exllamav3's own knob that turns the fused (mgemm) K/V bundle off
            cfg, model = load(case, no_reconstruct=True)
            r["short_no_reconstruct"] = short_forwards(model, ids, ref["deq"], vocab)
            model.unload()
            del model
        torch.cuda.empty_cache()
    except Exception as exc:
        r["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()

(out / "results.json").write_text(json.dumps(results, indent=2))


def short(d):
    return "error" if "error" in d else f"{d['rel']:.1e}/{d['argmax_agree']:.2f}"


print()
print("logits vs the float32 reference (transformers on the exl3rt-dequantized checkpoint): max|d| / max|ref|,")
print("relative Frobenius error, argmax agreement; 'orig rel': vs the unquantized model; per-layer: Q (decoded")
print("trellis) bit-exact count, worst relative difference of W; short forwards (rel/argmax), 'nr' = no_reconstruct")
print(f"{'case':24s} {'seq':>3s} | {'kernel max|d|/max|ref|':>21s} {'rel':>8s} {'argmax':>6s} | {'recon rel':>9s} "
      f"{'argmax':>6s} | {'orig rel':>8s} | {'Q exact':>7s} {'W rel max':>9s} | {'32 rows':>13s} {'1 row':>13s} | "
      f"{'32 rows nr':>13s} {'1 row nr':>13s}")
for r in results:
    if "error" in r:
        print(f"{r['case']:24s} ERROR {r['error'][:200]}")
        continue
    k, c, o = r["kernel_vs_deq"], r["reconstruct_vs_deq"], r["kernel_vs_orig"]
    lq = [v for v in r["layers"].values() if "Q_equal" in v]
    nr = r.get("short_no_reconstruct", {})
    print(f"{r['case']:24s} {r['seq']:3d} | {k['max_abs']:9.2e}/{k['ref_max_abs']:9.2e}  {k['rel']:8.2e} "
          f"{k['argmax_agree']:6.3f} | {c['rel']:9.2e} {c['argmax_agree']:6.3f} | {o['rel']:8.3f} | "
          f"{sum(v['Q_equal'] for v in lq):3d}/{len(lq):<3d} {max(v['W_rel'] for v in lq):9.2e} | "
          f"{short(r['short']['rows32']):>13s} {short(r['short']['rows1']):>13s} | "
          f"{short(nr['rows32']) if nr else '-':>13s} {short(nr['rows1']) if nr else '-':>13s}")
    for name, v in {**r["short"], **{f"nr_{a}": b for a, b in nr.items()}}.items():
        if "error" in v:
            print(f"    {name}: {v['error'][:160]}")
EOF
