"""What the shared checkpoint validation adds to a load: headers, config.json against the tensors, the value scan.

Times (median of ``--reps``, files in the page cache) on an EXL3 checkpoint directory:

- ``Exl3Checkpoint`` alone (every safetensors header: what listing always cost);
- ``validate_checkpoint(data=False)`` (plain ``exl3rt inspect``, ``exl3rt generate``'s pre-check);
- ``validate_checkpoint(data=True)`` (every loader): the difference is the value scan (NaN/inf, read in slices);
- ``from_pretrained`` of the checkpoint as stored (it runs the validation once), for scale.

    python benchmarks/bench_validate.py CKPT        # e.g. `exl3rt quantize SRC CKPT --bits 4 --from-cache`

Prints a table and writes ``benchmarks/results/validate_<name>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, median_ms, write_json  # noqa: E402


def median_s(fn, reps: int) -> float:
    return median_ms(fn, reps, warmup=1, cuda=False) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="an EXL3 checkpoint directory")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    import transformers

    import exl3rt.integrations.transformers  # noqa: F401  (registers quant_method "exl3")
    from exl3rt.format.checkpoint import Exl3Checkpoint
    from exl3rt.format.validate import validate_checkpoint
    from exl3rt.util.tensorfiles import FLOAT_DTYPES

    path = args.ckpt
    files = Exl3Checkpoint(path).files
    floats = [n for n in files.names() if files.info(n).dtype in FLOAT_DTYPES]
    float_bytes = sum(files.info(n).nbytes for n in floats)

    rows = {
        "headers (Exl3Checkpoint)": median_s(lambda: Exl3Checkpoint(path), args.reps),
        "validate, data=False": median_s(lambda: validate_checkpoint(path, data=False), args.reps),
        "validate, data=True": median_s(lambda: validate_checkpoint(path, data=True), args.reps),
        "from_pretrained (validation included)": median_s(
            lambda: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), max(1, args.reps // 2)),
    }
    scan = rows["validate, data=True"] - rows["validate, data=False"]
    print(f"\n{Path(path).name}: {len(floats)} floating tensors, {float_bytes / 2**20:.1f} MiB; "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print("| step | ms |")
    print("|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v * 1e3:.1f} |")
    print(f"value scan: {scan * 1e3:.1f} ms ({float_bytes / scan / 2**30:.2f} GiB/s); the whole validation "
          f"{rows['validate, data=True'] / rows['from_pretrained (validation included)']:.0%} of the load")
    write_json(args.json or f"benchmarks/results/validate_{Path(path).name}.json",
               {"date": dt.date.today().isoformat(), "commit": commit(), "machine": platform.processor()
                or platform.machine(), "threads": torch.get_num_threads(), "float_bytes": float_bytes,
                "seconds": rows, "scan_seconds": scan})


if __name__ == "__main__":
    main()
