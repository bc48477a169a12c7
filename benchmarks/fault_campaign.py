"""The crash and corruption campaign at full scale: prints the table docs/cache.md records, writes JSON.

    .venv/bin/python benchmarks/fault_campaign.py                 # ~2-4 min on 2 cores
    .venv/bin/python benchmarks/fault_campaign.py --corruptions 500 --writer-runs 5   # quicker

Parts (the logic and the invariants live in tests/cache_faults.py and tests/crash_points.py, which the test
suite runs at a small scale):

- ``exl3rt quantize`` SIGKILLed at every write point of a 1-layer model, then rerun: same files as an
  uninterrupted run (bytes and permission bits), no temporaries, no work folder;
- concurrent cache writers on shared keys, a share of them SIGKILLed at random moments;
- cache writers killed with a half-written temporary (cleaned by the next writer or by ``prune``);
- random corruptions of a cache entry (bytes, bits, header, truncation, metadata edits and deep nesting),
  each read back, a share of them through a readonly cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cache_faults  # noqa: E402
import crash_points  # noqa: E402
from common import commit, write_json  # noqa: E402


def quantize_kills(scratch: Path, real: bool) -> dict:
    from tiny_models import tiny_llama

    src = tiny_llama(scratch / "src", layers=1)
    status, events = crash_points.run_child(src, scratch / "reference", 2, None, scratch, fake=not real)
    reference = crash_points.tree(scratch / "reference")
    recovered = completed_before = 0
    failures = []
    for i, ev in enumerate(events):
        out = scratch / f"out-{i}"
        status, _ = crash_points.run_child(src, out, 2, i, scratch, fake=not real)
        try:
            assert crash_points.killed(status), f"not killed ({status})"
            summary = crash_points.check_recovery(src, out, 2, reference, scratch, fake=not real)
            recovered += 1
            completed_before += bool(summary.get("completed_before"))
        except AssertionError as exc:
            failures.append(f"{i} {ev}: {exc}")
    return {"kill_points": len(events), "recovered_identical": recovered, "rerun_only_cleaned_up": completed_before,
            "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corruptions", type=int, default=5000)
    ap.add_argument("--writer-runs", type=int, default=20, help="rounds of concurrent writers")
    ap.add_argument("--writers", type=int, default=6, help="writer processes per round")
    ap.add_argument("--publish-kills", type=int, default=20)
    ap.add_argument("--real-encoder", action="store_true", help="quantize kill points with the real encoder")
    ap.add_argument("--json", default="benchmarks/results/fault_campaign.json")
    args = ap.parse_args()
    logging.getLogger("exl3rt").setLevel(logging.ERROR)   # every corrupted entry is one expected warning

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "q").mkdir()
        quant = quantize_kills(d / "q", args.real_encoder)
        writers = cache_faults.concurrent_writers(d / "w", runs=args.writer_runs, writers=args.writers, keys=4,
                                                  kill_fraction=0.4, seed=7)
        publish = cache_faults.kills_during_publish(d / "p", kills=args.publish_kills)
        corrupt = cache_faults.corruptions(d / "c", count=args.corruptions, seed=11, readonly_every=10)

    rows = [
        ("quantize: SIGKILL at each write point, rerun", quant["kill_points"],
         f"{quant['recovered_identical']} identical to an uninterrupted run "
         f"({quant['rerun_only_cleaned_up']} only finished the cleanup); {len(quant['failures'])} failed"),
        ("cache: concurrent writers (random kills)", writers.writers,
         f"{writers.killed} killed; {writers.entries} entries, {writers.invalid_entries} invalid, "
         f"{writers.wrong_entries} wrong, {writers.missing} missing, {writers.failed_writers} writer errors, "
         f"{writers.leftovers_after_prune} leftovers after prune"),
        ("cache: SIGKILL mid-publish", publish.kills,
         f"{publish.entries_after_kill} entries after the kill, {publish.temporaries_counted} temporaries counted, "
         f"cleaned by next writer {publish.cleaned_by_next_writer} / by prune {publish.cleaned_by_prune}"),
        ("cache: corruptions of an entry", corrupt.tried,
         f"{corrupt.detected} refused, {corrupt.accepted_same_tensors} accepted with the same tensors, "
         f"{corrupt.unchanged} no-ops, {corrupt.wrong_weights} wrong weights, {corrupt.crashes} crashes, "
         f"{corrupt.readonly_changed_disk} readonly loads that changed the disk"),
    ]
    print(f"{'part':<46} {'tried':>6}  result")
    for part, n, result in rows:
        print(f"{part:<46} {n:>6}  {result}")
    print("corruptions by kind: " + ", ".join(f"{k} {v['detected']}/{v['tried']} refused"
                                              for k, v in sorted(corrupt.by_kind.items())))
    for f in quant["failures"] + corrupt.crash_examples:
        print("  FAILURE:", f)
    write_json(ROOT / args.json, {
        "date": datetime.date.today().isoformat(), "commit": commit(), "seconds": time.perf_counter() - t0,
        "quantize": quant, "writers": dataclasses.asdict(writers), "publish_kills": dataclasses.asdict(publish),
        "corruptions": dataclasses.asdict(corrupt),
    })
    bad = (quant["failures"] or writers.invalid_entries or writers.wrong_entries or writers.failed_writers
           or corrupt.wrong_weights or corrupt.crashes or corrupt.readonly_changed_disk or publish.entries_after_kill)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
