"""``exl3rt cache ls | stats | verify | prune``: look after the persistent encoding cache."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from typing import Any, Optional

from ..cache import CacheError, CacheMode, EncodingCache
from ..cache.modes import resolve_root
from ..util.units import fmt_bytes

HELP = "list, check and prune the persistent encoding cache"

DESCRIPTION = """\
Look after the persistent encoding cache, where layers encoded at load time are kept so that each
weight is encoded once. Entries live under <root>/v1/<xx>/<digest>.safetensors; the root is --root,
else EXL3RT_CACHE_DIR, else $XDG_CACHE_HOME/exl3rt (~/.cache/exl3rt).

examples:
  exl3rt cache ls                         one line per entry: digest, size, age, shape, K, codebook
  exl3rt cache stats --json               totals as JSON
  exl3rt cache verify                     re-validate every entry; exit status 1 if any is invalid
  exl3rt cache verify --delete-invalid    ... and delete the invalid ones
  exl3rt cache prune --older-than 30d     drop entries not used for 30 days
  exl3rt cache prune --max-size 20G       drop least recently used entries until <= 20 GB
  exl3rt cache prune --max-size 0 --dry-run    show what clearing the cache would remove

prune and verify --delete-invalid never remove an entry that another process is writing, and never
remove (or follow) anything below the root that is not a regular file: a directory, link or FIFO named
like an entry is reported and left for you to remove.
"""

_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``20G`` / ``500M`` / ``1.5GiB`` / ``1024`` -> bytes (K/M/G/T decimal, Ki/Mi/Gi/Ti binary)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT][iI]?)?[bB]?\s*", text or "")
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 500M, 20G, 1.5GiB or a byte count")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    if not math.isfinite(value) or value > 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} is too large a size")
    return int(value)


def parse_age(text: str) -> float:
    """``7d`` / ``12h`` / ``30m`` / ``90s`` / ``2w`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw])\s*", text or "")
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age; use e.g. 7d, 12h, 30m, 90s or 2w")
    return float(m.group(1)) * _AGES[m.group(2)]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cache", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])
    verbs = p.add_subparsers(dest="cache_command", metavar="ACTION")

    def verb(name: str, help_: str) -> argparse.ArgumentParser:
        v = verbs.add_parser(name, help=help_, description=help_)
        v.add_argument("--root", help="cache root (default: EXL3RT_CACHE_DIR or $XDG_CACHE_HOME/exl3rt)")
        return v

    ls = verb("ls", "list the entries (reads headers only)")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.set_defaults(run=_run_ls)
    st = verb("stats", "totals: entries, bytes, stray temporary and lock files")
    st.add_argument("--json", action="store_true", help="print JSON instead of text")
    st.set_defaults(run=_run_stats)
    ve = verb("verify", "re-validate every entry (names, dtypes, shapes, finiteness, key, payload digest); "
                        "exit status 1 if any is invalid")
    ve.add_argument("--delete-invalid", action="store_true", help="delete invalid entries (unless being written)")
    ve.set_defaults(run=_run_verify)
    pr = verb("prune", "remove old entries and leftovers of dead writers")
    pr.add_argument("--older-than", type=parse_age, metavar="AGE",
                    help="remove entries not used (read or written) for AGE, e.g. 7d, 12h, 30m")
    pr.add_argument("--max-size", type=parse_size, metavar="SIZE",
                    help="then remove least recently used entries until the total is at most SIZE, e.g. 20G, 500M")
    pr.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    pr.set_defaults(run=_run_prune)


def _cache(args: argparse.Namespace) -> EncodingCache:
    # The CLI administers the directory explicitly; EXL3RT_CACHE_MODE governs model loading, not this.
    root = resolve_root(getattr(args, "root", None))
    if root.exists() and not root.is_dir():
        raise CacheError(f"{root}: not a directory; --root (or EXL3RT_CACHE_DIR) names the cache's folder")
    return EncodingCache(root, CacheMode.READWRITE)


def _fmt_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def _describe_key(key: Optional[dict]) -> str:
    if not isinstance(key, dict):
        return "?"
    tp = f" tp{key.get('tp_rank')}/{key.get('tp_size')}" if key.get("tp_size", 1) != 1 else ""
    cal = " cal" if key.get("hessian_digest") else ""
    return (f"{key.get('in_features')}x{key.get('out_features')} K={key.get('bits')} "
            f"{key.get('codebook')} seed={key.get('seed')}{cal}{tp} {key.get('source_dtype', '').replace('torch.', '')}")


def _guard(fn: Any) -> Any:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except CacheError as exc:
            print(f"exl3rt: error: {exc}", file=sys.stderr)
            return 1
    return wrapped


@_guard
def _run_ls(args: argparse.Namespace) -> int:
    cache = _cache(args)
    entries = list(cache.entries())
    if args.json:
        print(json.dumps([e.as_dict() for e in entries], indent=2))
        return 0
    if not entries:
        print(f"{cache.entries_dir}: no cache entries")
        return 0
    now = datetime.datetime.now().timestamp()
    print(f"{'digest':<16}  {'size':>10}  {'unused':>7}  {'proxy_err':>9}  key")
    for e in entries:
        err = f"{e.proxy_err:.3g}" if e.proxy_err is not None else "-"
        what = f"BAD: {e.error}" if e.error else _describe_key(e.key)
        print(f"{e.digest[:16]:<16}  {fmt_bytes(e.size, 1):>10}  {_fmt_age(now - e.mtime):>7}  {err:>9}  {what}")
    print(f"{len(entries)} entries, {fmt_bytes(sum(e.size for e in entries), 1)} in {cache.root}")
    return 0


@_guard
def _run_stats(args: argparse.Namespace) -> int:
    s = _cache(args).summary()
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print(f"root             {s['root']} (layout {s['layout']})")
    print(f"entries          {s['entries']}")
    print(f"size             {fmt_bytes(s['bytes'], 1)} ({s['bytes']:,} bytes)")
    print(f"bad headers      {s['unreadable_headers']}  (run `exl3rt cache verify`)")
    if s["not_regular_files"]:
        print(f"not files        {s['not_regular_files']}  (directories, links … named like entries: remove by hand)")
    print(f"temporary files  {s['temporary_files']}  (in-flight or left by killed writers: `exl3rt cache prune`)")
    print(f"lock files       {s['lock_files']}")
    if s["links_not_followed"]:
        print(f"links skipped    {s['links_not_followed']}  (links or files where cache directories belong: "
              f"not followed; remove them)")
    return 0


@_guard
def _run_verify(args: argparse.Namespace) -> int:
    results = _cache(args).verify(delete_invalid=args.delete_invalid)
    bad = [r for r in results if not r.ok]
    for r in bad:
        action = " (deleted)" if r.deleted else f" (kept: {r.kept})" if args.delete_invalid else ""
        print(f"INVALID {r.info.path}: {r.reason}{action}")
    print(f"{len(results) - len(bad)} of {len(results)} entries valid")
    if bad and not args.delete_invalid:
        print("fix: `exl3rt cache verify --delete-invalid` removes them (they are re-encoded when next needed)")
    return 1 if bad else 0


@_guard
def _run_prune(args: argparse.Namespace) -> int:
    rep = _cache(args).prune(args.older_than, args.max_size, dry_run=args.dry_run)
    verb = "would remove" if rep.dry_run else "removed"
    for e in rep.removed:
        print(f"{verb} {e.path} ({fmt_bytes(e.size, 1)})")
    for e in rep.skipped_in_use:
        print(f"kept {e.path}: being written by another process")
    for e, why in rep.skipped:
        print(f"kept {e.path}: {why}")
    print(f"{verb} {len(rep.removed)} entries ({fmt_bytes(rep.freed_bytes, 1)}); {rep.remaining_entries} remain "
          f"({fmt_bytes(rep.remaining_bytes, 1)})"
          + (f"; removed {rep.stale_files_removed} stale temporary/lock files" if rep.stale_files_removed else ""))
    return 0
