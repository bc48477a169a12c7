"""Shared fixtures: the golden reference data made by exllamav3 1.6.5 (../shared/golden)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _workers > 1:
    # `make test` runs pytest-xdist workers, one per core (up to 4): give each worker its share of the cores
    # instead of letting every worker's torch start one thread per core
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when @triton.jit decorates, i.e. when exl3rt.encode.viterbi_triton
    # is first imported: set it before any test module can import it, so the GPU kernels run in
    # Triton's CPU interpreter here and in CI.
    os.environ.setdefault("TRITON_INTERPRET", "1")
import sys

from safetensors import safe_open


def _quiet_triton_leak_report() -> None:
    """Triton's MLIR bindings (nanobind) report objects still alive when an interpreter exits, ~50 lines per
    pytest worker that ran the Triton interpreter: harmless at exit and nothing a test can act on. Turn that report
    off through nanobind's own switch, which libtriton exports."""
    try:
        import ctypes

        import triton._C.libtriton as libtriton
        ctypes.CDLL(libtriton.__file__)["_ZN8nanobind6detail17set_leak_warningsEb"](False)
    except (ImportError, OSError, AttributeError, TypeError):    # no Triton, or a build without the symbol
        pass


_quiet_triton_leak_report()


REPO = Path(__file__).resolve().parents[1]
# a test-only setting: read here, not by the package
GOLDEN = Path(os.path.expanduser(os.environ.get("EXL3RT_GOLDEN_DIR", "")) or REPO.parent / "shared" / "golden")

if not (GOLDEN / "codebooks.safetensors").is_file():
    raise RuntimeError(
        f"golden reference data not found at {GOLDEN}: the tests check every golden file and must not "
        f"skip them. The data (26 MB, made by exllamav3 1.6.5 itself on an H200: its quantizer's codes, its "
        f"kernels' outputs; described in its README.md) is not in the repository: it comes with the project's "
        f"workspace as shared/golden beside the checkout. Put that shared/ folder beside the repository, or set "
        f"EXL3RT_GOLDEN_DIR to a copy of golden/"
    )

LAYER_FILES = sorted(p.name for p in GOLDEN.glob("[0-9]*.safetensors"))
assert LAYER_FILES, f"no golden layer files in {GOLDEN}"


def load_golden(name: str) -> tuple[dict, dict]:
    """(tensors, metadata) of one golden file."""
    with safe_open(str(GOLDEN / name), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def golden_codebook(tensors: dict) -> str:
    return "mcg" if "mcg" in tensors else "mul1" if "mul1" in tensors else "3inst"


@pytest.fixture(params=LAYER_FILES)
def golden_layer(request):
    tensors, meta = load_golden(request.param)
    return request.param, tensors, meta


@pytest.fixture(autouse=True)
def _fresh_kernel_plans():
    """Kernel settings (``EXL3RT_KERNEL_*``) are read when a linear's launch plan is made: a test that changes
    them must not meet a plan an earlier test made."""
    yield
    linear = sys.modules.get("exl3rt.kernels.linear")
    if linear is not None:
        linear.reset_plans()


@pytest.fixture(scope="session", autouse=True)
def _private_encoding_cache(tmp_path_factory):
    """Encoding caches of the tests live under the session's temporary folder, never in the user's
    ~/.cache/exl3rt (tests that care about the cache's place set their own root)."""
    if os.environ.get("EXL3RT_CACHE_DIR"):
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("EXL3RT_CACHE_DIR", str(tmp_path_factory.mktemp("exl3rt-cache")))
    yield
    mp.undo()
