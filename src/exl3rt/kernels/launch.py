"""Triton launches recorded once and replayed without the JIT's per-call work.

``fn[grid](*args, **kwargs)`` binds every argument, computes its specialization key and looks the kernel up on
each call: tens of µs of host time per launch, three launches per EXL3 linear. A :class:`Recording` notes the
launches one ordinary call makes (through :func:`launch`); :class:`Replay` then calls each compiled kernel's
launcher directly with the same arguments, where only the tensors named as *slots* (the input, the output,
the scratch buffers) change from call to call.

A replay is only valid where every other argument is the same: a plan is made per exact set of integer
arguments (the caller keys it so), and the slot tensors must keep the 16-byte alignment Triton specialized on
(the caller checks its input; buffers from the caching allocator or a workspace always have it). Under
``TRITON_INTERPRET=1`` a replay calls ``fn[grid]`` again with the slot tensors put in: the same bookkeeping,
checked on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable, Optional, Sequence

import torch

_local = threading.local()
_epoch = [0]

#: scratch buffers start on 256-byte boundaries in a workspace
ALIGN = 256


def plans_epoch() -> int:
    """The current plan generation: a plan made in an older one is stale (settings may have changed)."""
    return _epoch[0]


def new_plans_epoch() -> None:
    """Make every plan recorded so far stale (``exl3rt.kernels.reset_plans`` calls this)."""
    _epoch[0] += 1


def slot_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """A scratch buffer's room in a workspace (whole :data:`ALIGN`-byte blocks, so every buffer starts aligned)."""
    return -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN


def scratch_layout(specs: Sequence[tuple]) -> tuple[tuple, int]:
    """``((shape, dtype), ...)`` laid out one after the other: ``(((shape, dtype, byte offset), ...), bytes)``."""
    out, off = [], 0
    for shape, dtype in specs:
        out.append((tuple(shape), dtype, off))
        off += slot_bytes(shape, dtype)
    return tuple(out), off


def scratch_views(layout: Sequence[tuple], ws: torch.Tensor) -> tuple:
    """The buffers of a :func:`scratch_layout` as views of the uint8 workspace ``ws``."""
    return tuple(ws[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                 for shape, dtype, off in layout)


def current_stream(dev: int) -> int:
    """The current CUDA stream of device index ``dev`` as the launchers take it (0 off CUDA, ``dev < 0``)."""
    return torch._C._cuda_getCurrentRawStream(dev) if dev >= 0 else 0


def run_plan(plan: Any, stream: int, head: tuple, ws: Optional[torch.Tensor], device: torch.device) -> None:
    """Replay ``plan`` (``scratch`` layout, ``nbytes``, ``replay``, ``views``: a linear's or an MoE layer's) with
    the call's own tensors ``head`` (input, output, ...) then its scratch: views of the workspace ``ws`` where it
    is big enough (kept on the plan for the next call), else buffers allocated for this call."""
    if ws is None or ws.numel() < plan.nbytes:
        scratch = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype, _ in plan.scratch)
        plan.replay(stream, head + scratch, keep=False)
        return
    if plan.views[0] is not ws:
        plan.views = (ws, scratch_views(plan.scratch, ws))
    plan.replay(stream, head + plan.views[1])


def launch(fn, grid, *args, **kwargs):
    """``fn[grid](*args, **kwargs)``; while a :class:`Recording` is open on this thread it is also noted."""
    compiled = fn[grid](*args, **kwargs)
    rec = getattr(_local, "recording", None)
    if rec is not None:
        rec.calls.append((fn, tuple(grid), args, kwargs, compiled))
    return compiled


class Recording:
    """``with Recording() as rec:`` collects the launches made through :func:`launch` on this thread."""

    def __init__(self):
        self.calls: list = []

    def __enter__(self) -> "Recording":
        if getattr(_local, "recording", None) is not None:
            raise RuntimeError("launch recordings do not nest")
        _local.recording = self
        return self

    def __exit__(self, *exc) -> None:
        _local.recording = None


def _is_desc(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and hasattr(value, "base") and isinstance(value.base, torch.Tensor)


@dataclasses.dataclass
class _Step:
    fn: Any
    grid: tuple                     # (x, y, z)
    args: list                      # every kernel parameter in order (direct) / the positional arguments
    kwargs: dict                    # interpreted only: the keyword arguments
    slots: tuple                    # (position or keyword, slot index)
    descs: tuple                    # (position or keyword, slot index, (descriptor type, fields but base))
    run: Optional[Callable] = None  # the compiled kernel's launcher (direct replays)
    function: Any = None
    metadata: Any = None


class Replay:
    """The recorded launches, callable with new slot tensors: ``replay(stream, slots)``."""

    def __init__(self, rec: Recording, slot_tensors: Sequence[torch.Tensor], direct: bool):
        """``slot_tensors``: the tensors of the recorded call that change per call, by slot; an argument is put
        in a slot when it is one of them or a view starting at the same address (the kernels see an address);
        an argument pointing elsewhere inside one cannot be replayed (ValueError, as for a tensor descriptor
        over anything but a slot).
        ``direct``: replay through the compiled launchers (CUDA); else through ``fn[grid]`` (the interpreter)."""
        self.direct = direct
        self._last_desc: dict = {}
        by_ptr = {}
        for i, t in enumerate(slot_tensors):
            by_ptr.setdefault(t.data_ptr(), i)
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in slot_tensors]
        self.steps: list[_Step] = []
        for fn, grid, args, kwargs, compiled in rec.calls:
            if direct:
                full = []
                for i, p in enumerate(fn.params):
                    if i < len(args):
                        full.append(args[i])
                    elif p.name in kwargs:
                        full.append(kwargs[p.name])
                    elif p.has_default:
                        full.append(p.default)
                    else:  # pragma: no cover - the recorded call ran, so every parameter had a value
                        raise TypeError(f"{fn}: no value for {p.name}")
                items = list(enumerate(full))
                args_out, kwargs_out = full, {}
            else:
                items = list(enumerate(args)) + list(kwargs.items())
                args_out, kwargs_out = list(args), dict(kwargs)
            slots, descs = [], []
            for where, value in items:
                if isinstance(value, torch.Tensor):
                    slot = by_ptr.get(value.data_ptr()) if value.numel() else None
                    if slot is None and value.numel() and any(a <= value.data_ptr() < b for a, b in spans):
                        # a replay would keep this address fixed while the slot's buffer moves
                        raise ValueError("a launch argument points inside a slot tensor, not at its start")
                    if slot is not None:
                        slots.append((where, slot))
                        # hold no slot tensor: the recorded call's buffers may be a CUDA graph pool's
                        self._put(args_out, kwargs_out, where, None)
                    elif direct:      # a fixed tensor: its address (the plan's key keeps it the same)
                        self._put(args_out, kwargs_out, where, value.data_ptr())
                elif _is_desc(value):
                    slot = by_ptr.get(value.base.data_ptr())
                    if slot is None:
                        raise ValueError("a tensor descriptor must describe a slot tensor")
                    # its fields without the recorded base: holding that buffer would keep it (maybe a CUDA
                    # graph pool's) alive
                    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name != "base"}
                    descs.append((where, slot, (type(value), fields)))
                    self._put(args_out, kwargs_out, where, None)
            step = _Step(fn, (tuple(grid) + (1, 1))[:3] if direct else grid, args_out, kwargs_out, tuple(slots), tuple(descs))
            if direct:
                step.run, step.function, step.metadata = compiled.run, compiled.function, compiled.packed_metadata
            self.steps.append(step)

    def _desc(self, desc, base: torch.Tensor, keep: bool):
        """The recorded descriptor ``(type, fields)`` over ``base``; ``keep``: remember it for the next call (a
        workspace base stays the same)."""
        if not keep:
            return desc[0](base=base, **desc[1])
        last = self._last_desc.get(id(desc))
        if last is not None and last[0] is base:
            return last[1]
        made = desc[0](base=base, **desc[1])
        self._last_desc[id(desc)] = (base, made)
        return made

    @staticmethod
    def _put(args: list, kwargs: dict, where, value) -> None:
        if isinstance(where, int):
            args[where] = value
        else:
            kwargs[where] = value

    def __call__(self, stream: int, slots: Sequence[torch.Tensor], keep: bool = True) -> None:
        """Launch every step on ``stream`` with ``slots`` in place of the recorded slot tensors. ``keep``: the
        slot tensors are long-lived (a workspace), so a tensor descriptor made over one may be kept."""
        direct = self.direct
        for s in self.steps:
            args = s.args.copy()
            if direct:
                for where, i in s.slots:
                    args[where] = slots[i].data_ptr()
                for where, i, desc in s.descs:
                    args[where] = self._desc(desc, slots[i], keep)
                gx, gy, gz = s.grid
                s.run(gx, gy, gz, stream, s.function, s.metadata, None, None, None, *args)
            else:
                kwargs = dict(s.kwargs)
                for where, i in s.slots:
                    self._put(args, kwargs, where, slots[i])
                for where, i, desc in s.descs:
                    self._put(args, kwargs, where, self._desc(desc, slots[i], False))
                s.fn[s.grid](*args, **kwargs)


def direct_launch_ok() -> bool:
    """Replays may bypass the JIT: no launch hook (a profiler such as Proton) is installed."""
    try:
        from triton import knobs
        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):  # pragma: no cover - older Triton: no knobs, no hooks to honour
        return True
    # a hook is None or (newer Triton) a chain of calls, empty when nothing is installed
    return all(h is None or (hasattr(h, "calls") and not h.calls) for h in hooks)


__all__ = ["ALIGN", "launch", "Recording", "Replay", "current_stream", "direct_launch_ok", "new_plans_epoch",
           "plans_epoch", "run_plan", "scratch_layout", "scratch_views", "slot_bytes"]
