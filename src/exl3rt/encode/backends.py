"""Viterbi backends: the same tail-biting search on different machines.

| name     | where            | module                     |
|----------|------------------|----------------------------|
| `torch`  | any device, slow | ``viterbi_ref``  (readable reference, tiny inputs and tests) |
| `numba`  | CPU              | ``viterbi_numba`` (fast CPU backend) |
| `triton` | CUDA             | ``viterbi_triton`` (GPU backend) |

``auto`` picks triton for CUDA tensors and numba for CPU tensors; if the fast backend for the
device cannot be imported it says so once (INFO) and uses the torch reference.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from .errors import EncodeError
from .regularize import TileEncoder

log = logging.getLogger("exl3rt.encode")

BACKENDS = ("auto", "torch", "numba", "triton")


def _load(name: str) -> TileEncoder:
    if name == "torch":
        from .viterbi_ref import encode_tiles_ref
        return encode_tiles_ref
    if name == "numba":
        from .viterbi_numba import encode_tiles
        return encode_tiles
    if name == "triton":
        from .viterbi_triton import encode_tiles
        return encode_tiles
    raise EncodeError(f"unknown encoder backend {name!r}: expected one of {', '.join(BACKENDS)}")


@functools.lru_cache(maxsize=None)
def _fallback_notice(wanted: str, reason: str) -> None:
    log.info("encoder backend %s unavailable (%s); using the slow torch reference", wanted, reason)


def resolve_backend(backend: str = "auto", device: Optional[torch.device] = None) -> str:
    """The concrete backend name for ``backend`` on ``device``."""
    if backend not in BACKENDS:
        raise EncodeError(f"unknown encoder backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    wanted = "triton" if device is not None and torch.device(device).type == "cuda" else "numba"
    try:
        _load(wanted)
    except ImportError as exc:
        _fallback_notice(wanted, str(exc))
        return "torch"
    return wanted


@functools.lru_cache(maxsize=None)
def _half_notice() -> None:
    log.info("the triton backend has no half-integer bitrates; encoding them with numba on the CPU")


def get_tile_encoder(backend: str = "auto", device: Optional[torch.device] = None, bits=None) -> TileEncoder:
    """A function ``encode(targets [T, 256], bits, codebook) -> (states, values)`` on ``device``'s tensors.

    Where the backend has one, ``encode.open_cost(targets, bits, codebook) -> [T]`` is the
    open-path (pass-1) squared error per tile, the global-scale search's cheap error estimate.

    Half-integer ``bits`` with the triton backend run on the numba backend (data moved to the CPU
    and back), since the GPU kernel covers integer K only.
    """
    name = resolve_backend(backend, device)
    if name == "triton" and bits is not None and not float(bits).is_integer():
        _half_notice()
        name = "numba"
    try:
        fn = _load(name)
    except ImportError as exc:
        raise EncodeError(f"encoder backend {name!r} cannot be imported: {exc}") from None

    def encode(targets: torch.Tensor, bits, codebook: str) -> tuple[torch.Tensor, torch.Tensor]:
        src = targets if name != "numba" else targets.cpu()
        states, values = fn(src.contiguous(), bits, codebook)
        return torch.as_tensor(states).to(targets.device), torch.as_tensor(values).to(targets.device)

    encode.backend = name  # type: ignore[attr-defined]
    cost_fn = _load_open_cost(name)
    if cost_fn is not None:
        def open_cost(targets: torch.Tensor, bits, codebook: str) -> torch.Tensor:
            src = targets if name != "numba" else targets.cpu()
            return torch.as_tensor(cost_fn(src.contiguous(), bits, codebook)).to(targets.device)

        encode.open_cost = open_cost  # type: ignore[attr-defined]
    return encode


def _open_costs_ref(targets: torch.Tensor, bits, codebook: str) -> torch.Tensor:
    """The torch reference's pass 1 alone (same positions and fp32 arithmetic as the numba
    backend's ``open_costs``): per tile, the smallest open-path squared error."""
    from ..format.codebooks import codebook_values
    from .viterbi_ref import check_bits, viterbi_open

    shifts = check_bits(bits, codebook)
    n = len(shifts)
    order = [(n // 2 + j) % n for j in range(n)]
    table = codebook_values(codebook)
    parts = [viterbi_open(targets[c:c + 16], shifts, table, 16, order=order)[0]
             for c in range(0, targets.shape[0], 16)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=targets.device)


def _load_open_cost(name: str):
    """``open_costs(targets [T, 256], bits, codebook) -> [T]`` of a backend, or None (triton: the
    g search then measures the full encode's error)."""
    if name == "numba":
        from .viterbi_numba import open_costs
        return open_costs
    if name == "torch":
        return _open_costs_ref
    return None
