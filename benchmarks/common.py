"""Helpers shared by the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


def commit() -> str:
    """Short hash of HEAD with ``-dirty`` when the working tree differs from it (a copy of a working
    tree, e.g. on the device machine, may carry a stale checkout's HEAD), or 'unknown' outside git."""
    try:
        return subprocess.check_output(["git", "describe", "--always", "--dirty", "--abbrev=7"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
