"""SIGKILL an ``exl3rt quantize`` run at each of its write points, then check that a rerun recovers.

A child process runs :func:`exl3rt.convert.convert_checkpoint` with every write primitive wrapped; each
call is a numbered *event*:

- ``mid-write FILE``: a safetensors file half written (the child truncates it to half and dies);
- ``written FILE``: a temporary complete and not yet renamed (inside ``atomic_path``, before fsync);
- ``renamed FILE``: just after an ``os.replace`` (a publish, or a shard getting its final name);
- ``cleanup``: the work folder's layers removed, its job record not yet.

With ``kill_at=None`` the child runs to the end and lists the events; otherwise it SIGKILLs itself at that
event. :func:`check_recovery` then reruns the same conversion in this process and compares the result with
an uninterrupted run, file by file and tensor by tensor. Used by ``tests/test_quantize_hostile.py`` (one
kill point of each kind) and ``benchmarks/fault_campaign.py`` (every kill point).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import stat
from pathlib import Path
from typing import Callable, Optional

def numbered_write_points(kill_at: int, writers: list) -> tuple[list[str], Callable[..., None]]:
    """Wrap the write primitives (``write_safetensors`` in each module of ``writers``, ``fs.fsync_file``,
    ``os.replace``) so that each call is a numbered event (module docstring), SIGKILLing this process at event
    ``kill_at``; returns the event list and the function that records one more."""
    import exl3rt.util.fs as fs
    import exl3rt.util.safetensors_io as sio

    events: list[str] = []

    def event(kind: str, path: Optional[str] = None) -> None:
        events.append(f"{kind} {Path(path).name if path is not None else ''}".strip())
        if len(events) - 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    real_write, real_fsync, real_replace = sio.write_safetensors, fs.fsync_file, os.replace

    def write(path, tensors, metadata=None):
        size = real_write(path, tensors, metadata)
        if len(events) == kill_at:
            with open(path, "r+b") as f:      # a torn file, as a kill in the middle of the write leaves it
                f.truncate(size // 2)
        event("mid-write", path)
        return size

    def fsync(path):
        event("written", path)
        return real_fsync(path)

    def replace(a, b):
        real_replace(a, b)
        event("renamed", b)

    for module in writers:
        module.write_safetensors = write
    fs.fsync_file, os.replace = fsync, replace
    return events, event


def child_main(src: str, out: str, bits: int, kill_at: int, scratch: str, fake: bool) -> None:
    """The child process: the conversion with its write points numbered (see the module docstring)."""
    import shutil
    import zlib

    import exl3rt.convert.run as run_mod
    import exl3rt.format.checkpoint_write as cw

    events, event = numbered_write_points(kill_at, [run_mod, cw])
    real_rmtree = shutil.rmtree

    def rmtree(path, *a, **k):
        real_rmtree(path, *a, **k)
        if Path(path).name == "layers":
            event("cleanup")

    if fake:   # the write points do not depend on the codes: a seeded random encoding per layer is quicker
        from exl3rt.format.random import random_linear

        def quantize_weight(w, bits, codebook, *, name, **kwargs):
            lin = random_linear(w.shape[0], w.shape[1], bits, codebook, seed=zlib.crc32(name.encode()))
            lin.info = {"proxy_err": 0.01}
            return lin
        run_mod.quantize_weight = quantize_weight

    run_mod.shutil.rmtree = rmtree
    summary = run_mod.convert_checkpoint(src, out, bits=bits, progress=False)
    Path(scratch, "events.json").write_text(json.dumps(events))
    Path(scratch, "summary.json").write_text(json.dumps(summary))


_CONTEXT = None


def _context():
    """Children fork from a server that imported exl3rt once (fast, and it never ran a torch thread)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["crash_points", "exl3rt.convert.run", "exl3rt.format.random"])
    return _CONTEXT


def run_child(src: Path, out: Path, bits: int, kill_at: Optional[int], scratch: Path, *,
              fake: bool = True) -> tuple[int, list[str]]:
    """Run the child (``fake``: random codes instead of the encoder); returns (exit status, events it listed
    when it finished)."""
    events_file = scratch / "events.json"
    events_file.unlink(missing_ok=True)
    proc = _context().Process(target=child_main, args=(str(src), str(out), bits, -1 if kill_at is None else kill_at,
                                                       str(scratch), fake))
    proc.start()
    proc.join(600)
    if kill_at is None and proc.exitcode != 0:
        raise RuntimeError(f"the uninterrupted child failed with status {proc.exitcode}")
    return proc.exitcode, (json.loads(events_file.read_text()) if events_file.exists() else [])


def one_of_each_kind(events: list[str]) -> list[int]:
    """The first event of each kind and file type (layer, shard, job record, side file, index, configs)."""
    seen, picked = set(), []
    for i, e in enumerate(events):
        kind, _, name = e.partition(" ")
        if name.startswith("model.") or name.startswith("lm_head"):
            what = "layer"
        elif name.startswith("part-") or name.startswith("model-"):
            what = "shard"
        else:
            what = name
        if (kind, what) not in seen:
            seen.add((kind, what))
            picked.append(i)
    return picked


def tree(path: Path) -> dict[str, tuple[int, bytes]]:
    """Every file below ``path``: relative name -> (permission bits, bytes)."""
    return {str(p.relative_to(path)): (stat.S_IMODE(p.stat().st_mode), p.read_bytes())
            for p in sorted(path.rglob("*")) if p.is_file()}


def check_recovery(src: Path, out: Path, bits: int, reference: dict[str, tuple[int, bytes]], scratch: Path, *,
                   fake: bool = True) -> dict:
    """Rerun the conversion into ``out`` (as a user would after the kill, in a child) and compare with
    ``reference``. Returns the summary the rerun printed. Raises AssertionError naming the first difference."""
    status, _ = run_child(src, out, bits, None, scratch, fake=fake)
    assert status == 0
    summary = json.loads((scratch / "summary.json").read_text())
    got = tree(out)
    assert sorted(got) == sorted(reference), f"files differ: {sorted(set(got) ^ set(reference))}"
    for name, (mode, data) in reference.items():
        assert got[name][0] == mode, f"{name}: mode {oct(got[name][0])}, expected {oct(mode)}"
        if name == "config.json" or name == "quantization_config.json":
            assert json.loads(got[name][1]) == json.loads(data), name
        else:
            assert got[name][1] == data, f"{name}: bytes differ from the uninterrupted run"
    return summary


def killed(status: int) -> bool:
    return status == -signal.SIGKILL
