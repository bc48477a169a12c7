"""Recorders of Triton's specialization keys, for tests that a prewarm compiles everything real calls need.

A :class:`SpecRecorder` stands in for a Triton kernel object (``kernel[grid](*args, **kwargs)``): it records
what Triton compiles a separate binary for — the kernel, its constexpr and launch keyword arguments, each
tensor's dtype and 16-byte alignment, each int by ``== 1`` and ``% 16 == 0`` (except the kernel's
``do_not_specialize`` arguments) — and runs nothing, so the code around the launches must not read their
outputs on the host (none of exl3rt's launch paths do: they are CUDA-graph capturable).
"""

from __future__ import annotations

import inspect

import torch


class SpecRecorder:
    def __init__(self, kernel, keys: set):
        self.kernel, self.keys = kernel, keys
        dns = getattr(kernel, "kwargs", {}).get("do_not_specialize") or getattr(kernel, "do_not_specialize", ())
        names = list(kernel.arg_names)
        self.skip = {names[d] if isinstance(d, int) else d for d in dns}
        params = inspect.signature(kernel.fn).parameters
        self.constexpr = {n for n, p in params.items() if "constexpr" in str(p.annotation)}

    def _arg(self, name, a):
        if isinstance(a, torch.Tensor):
            return (name, str(a.dtype), a.data_ptr() % 16 == 0)
        if hasattr(a, "block_shape") and hasattr(a, "base"):     # a TMA descriptor: its dtype, box and layout
            return (name, str(a.base.dtype), tuple(a.block_shape), repr(a.layout))
        if name in self.constexpr or isinstance(a, bool) or not isinstance(a, int):
            return (name, repr(a))
        return (name, a == 1, a % 16 == 0)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            key = [self.kernel.fn.__name__]
            key += [self._arg(n, a) for n, a in zip(self.kernel.arg_names, args) if n not in self.skip]
            key += sorted(self._arg(n, a) for n, a in kwargs.items() if n not in self.skip)
            self.keys.add(tuple(key))
        return launch


def record(monkeypatch, targets, keys: set) -> None:
    """Replace each ``(module, attribute)`` kernel in ``targets`` by a recorder into ``keys``."""
    for mod, name in targets:
        kernel = getattr(mod, name)
        if isinstance(kernel, SpecRecorder):                 # already a recorder: wrap the real kernel
            kernel = kernel.kernel
        monkeypatch.setattr(mod, name, SpecRecorder(kernel, keys))
