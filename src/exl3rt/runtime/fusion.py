"""Sibling EXL3 linears that read one input, run as one fused layer (q/k/v, gate/up).

A decoder layer calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` on the same ``x``, and ``gate_proj(x)`` and
``up_proj(x)`` likewise. Run apart, each is a full set of kernel launches, and the small ones (k/v) leave most of
the GPU idle. :func:`fuse_linears` joins such siblings (same input width, K, codebook and device) into one
:class:`FusedLinears`: their trellises concatenated along the output tiles, their output scales concatenated,
their input scales stacked, so one ``torch.ops.exl3rt.fused_linear`` call computes every member's output.

The members stay in the model as they were (names, ``state_dict``, export): their buffers become views of the
fused tensors. The first member called on an input runs the fused call and keeps its output; the other members
called on the *same tensor object* (unchanged since) take their columns from it, and the last one drops it. A
member called on another input runs the fused call again (still correct, only slower). This is plain Python
state, which torch.compile traces (one fused op per group in the graph).

Moving a member (``.to``, ``.cuda`` …) or replacing its buffers dissolves the group: each member gets contiguous
buffers of its own again.

A gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a SiLU, as Llama, Mistral and Qwen write it)
whose gate/up are fused goes one step further (:func:`fuse_gated_mlps`): its forward becomes one
``torch.ops.exl3rt.gated_mlp`` call, which at the decode's row counts runs gate/up's output rotation, the
activation and down's input rotation as one kernel (five launches for the MLP instead of seven, and no torch
operations between them). Where its group ends, or a layer is replaced, the module's own forward runs again.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import types

import torch
from torch import nn

from ..kernels.ops import call_fused_linear, call_gated_mlp
from .linear import Exl3Linear

#: sibling names that a decoder layer calls on one input, in the order it calls them
FUSABLE_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinears:
    """The fused tensors of a group of :class:`Exl3Linear` (their buffers are views of these) and the output of
    the last fused call, kept until every member took its columns."""

    def __init__(self, members: list[Exl3Linear]):
        first = members[0]
        self.members = list(members)
        self.codebook = first.codebook
        widths = [m.out_padded for m in members]
        starts = [sum(widths[:i]) for i in range(len(widths))]
        self.bounds = tuple(starts[1:])
        self.columns = [(a, a + m.out_features) for a, m in zip(starts, members)]
        with torch.no_grad():
            self.trellis = torch.cat([m.trellis for m in members], dim=1)
            self.suh = torch.stack([m.suh for m in members])
            self.svh = torch.cat([m.svh for m in members])
        self.views = []
        for i, (m, a, w) in enumerate(zip(members, starts, widths)):
            views = (self.trellis[:, a // 16:(a + w) // 16], self.suh[i], self.svh[a:a + w])
            m._buffers["trellis"], m._buffers["suh"], m._buffers["svh"] = views
            m._fused, m._fused_index = self, i
            self.views.append(views)
        self._out: Optional[torch.Tensor] = None
        self._x: Optional[torch.Tensor] = None
        self._version = -1
        self._left = 0

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for ``x`` (its columns of the fused call's output; no bias)."""
        compiling = torch.compiler.is_compiling()
        if not compiling and not self._intact(index):
            member = self.members[index]
            self.dissolve()
            return member.product(x)
        out = self._out
        if out is None or self._x is not x or (not compiling and x._version != self._version):
            out = call_fused_linear(x, self.trellis, self.suh, self.svh, self.codebook, self.bounds)
            self._out, self._x, self._left = out, x, len(self.members)
            if not compiling:
                self._version = x._version
        self._left -= 1
        if self._left <= 0:       # every member served: hold nothing between forwards
            self._out = self._x = None
        a, b = self.columns[index]
        return out[..., a:b]

    def intact(self) -> bool:
        """Every member still holds its views (see :meth:`_intact`)."""
        return all(self._intact(i) for i in range(len(self.members)))

    def _intact(self, index: int) -> bool:
        """Member ``index`` still holds its views (no buffer replaced by a load or a move): its columns of the fused
        call are its own product."""
        m, (t, s, v) = self.members[index], self.views[index]
        b = m._buffers
        return b.get("trellis") is t and b.get("suh") is s and b.get("svh") is v

    def dissolve(self) -> None:
        """Give each member contiguous buffers of its own (copies of what it holds now) and end the group."""
        with torch.no_grad():
            for m in self.members:
                for name in ("trellis", "suh", "svh"):
                    t = m._buffers.get(name)
                    if t is not None:
                        m._buffers[name] = t.clone(memory_format=torch.contiguous_format)
                m._fused, m._fused_index = None, 0
        self.members, self.views = [], []
        self._out = self._x = None

    def shape(self) -> tuple:
        """``(in_p, out_p, K, codebook, bounds)``: what the kernels specialize on (:func:`exl3rt.kernels.prewarm`)."""
        first = self.members[0]
        return (first.in_padded, int(self.trellis.shape[1]) * 16, first.bits, self.codebook, self.bounds)


def _fusable(members: list, devices: tuple) -> bool:
    if not all(type(m) is Exl3Linear and m._fused is None for m in members):
        return False
    first = members[0]
    return all(m.in_features == first.in_features and m.bits == first.bits and m.codebook == first.codebook
               and m.trellis.device == first.trellis.device and m.trellis.device.type in devices
               and m.suh.dtype == first.suh.dtype and m.svh.dtype == first.svh.dtype
               and not m.dequant_cache and m.trellis.is_contiguous() for m in members)


def fuse_group(members: list, devices: tuple[str, ...] = ("cuda",)) -> Optional[FusedLinears]:
    """Fuse ``members`` (sibling :class:`Exl3Linear` of one input) into one :class:`FusedLinears`, or None where they
    cannot be (another K, codebook, input width or device; a device type not in ``devices``; fewer than two)."""
    if len(members) < 2 or not _fusable(list(members), tuple(devices)):
        return None
    return FusedLinears(list(members))


def fuse_linears(model: nn.Module, groups: Iterable[tuple[str, ...]] = FUSABLE_GROUPS,
                 devices: tuple[str, ...] = ("cuda",), mlps: bool = True) -> int:
    """Fuse every group of sibling :class:`Exl3Linear` named in ``groups`` (default :data:`FUSABLE_GROUPS`) that
    read one input, with one K and codebook, on one device of a type in ``devices`` (CUDA: elsewhere a layer
    multiplies by its kept dense weight, which fusing would not speed up); returns how many groups were fused.
    Siblings that differ (in K, say) stay as they are. Memory: one group's codes are copied once, then the
    originals are freed. ``mlps``: then run each gated MLP whose gate/up were fused as one call
    (:func:`fuse_gated_mlps`)."""
    n = 0
    for parent in list(model.modules()):
        children = parent._modules
        for names in groups:
            members = [children.get(name) for name in names]
            if all(m is not None for m in members) and _fusable(members, tuple(devices)):
                FusedLinears(members)
                n += 1
    if mlps:
        fuse_gated_mlps(model)
    return n


def unfuse_linears(model: nn.Module) -> int:
    """Dissolve every fused group in ``model`` (and give every gated MLP its own forward back); returns how many
    groups."""
    for module in model.modules():
        if is_gated(module):
            del module.forward
    groups = {id(m._fused): m._fused for m in model.modules() if isinstance(m, Exl3Linear) and m._fused is not None}
    for g in groups.values():
        g.dissolve()
    return len(groups)


# ---- gated MLPs -----------------------------------------------------------------------------------------

def _gated_form(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _gated_form_inline(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# the bytecode of the forwards this fusion replaces (the Python running us compiles both sides alike)
_GATED_CODES = tuple((f.__code__.co_code, f.__code__.co_names) for f in (_gated_form, _gated_form_inline))


def _is_silu(act: Any) -> bool:
    """``act`` is torch's SiLU or transformers' ``SiLUActivation``, and computes it (no kernel swapped in)."""
    if not isinstance(act, nn.Module) or act._forward_hooks or act._forward_pre_hooks:
        return False
    if type(act) is not nn.SiLU and type(act).__name__ != "SiLUActivation":
        return False
    with torch.no_grad():
        probe = torch.linspace(-9.0, 9.0, 37)
        return bool(torch.equal(act(probe), nn.functional.silu(probe)))


def _gated_members(module: nn.Module) -> Optional[tuple]:
    """(gate, up, down) where ``module`` is a gated MLP this fusion can run as one call, else None."""
    if "forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks:
        return None
    code = getattr(type(module).forward, "__code__", None)
    if code is None or (code.co_code, code.co_names) not in _GATED_CODES:
        return None
    children = module._modules
    g, u, d = children.get("gate_proj"), children.get("up_proj"), children.get("down_proj")
    if not all(type(m) is Exl3Linear for m in (g, u, d)) or not _is_silu(children.get("act_fn")):
        return None
    grp = g._fused
    if grp is None or grp.members != [g, u] or d._fused is not None or d.trellis.device != grp.trellis.device:
        return None
    if any(m.bias is not None or m._forward_hooks or m._forward_pre_hooks for m in (g, u, d)):
        return None
    if g.out_padded != u.out_padded or g.out_features != u.out_features or d.in_padded != g.out_padded or \
            d.in_features != g.out_features or d.dequant_cache or not d.trellis.is_contiguous():
        return None
    return g, u, d


def _gated_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A fused gated MLP's forward: one ``exl3rt::gated_mlp`` call while gate/up stay fused, else the module's own."""
    g, u, d = self.gate_proj, self.up_proj, self.down_proj
    # any of the three replaced (by a plain nn.Linear, say) or the group ended: the module's own forward
    grp = g._fused if type(g) is Exl3Linear else None
    if grp is None or type(u) is not Exl3Linear or grp is not u._fused or type(d) is not Exl3Linear or \
            d._fused is not None or (not torch.compiler.is_compiling() and not grp.intact()):
        return type(self).forward(self, x)
    g._check_input(x)
    return call_gated_mlp(x, grp.trellis, grp.suh, grp.svh, d.trellis, d.suh, d.svh, grp.codebook, d.codebook,
                          g.out_features, d.out_features)


def is_gated(module: nn.Module) -> bool:
    """``module``'s forward is the fused gated MLP's (:func:`fuse_gated_mlps`)."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _gated_forward


def fuse_gated_mlps(model: nn.Module) -> int:
    """Run every gated MLP of ``model`` whose gate/up are a fused group (:func:`fuse_linears`) and whose down
    layer is an :class:`Exl3Linear` of the same device, without biases or hooks, as one ``exl3rt::gated_mlp`` call;
    returns how many. The module keeps its type, children and state_dict; only its forward is replaced
    (:func:`unfuse_linears` restores it)."""
    n = 0
    for module in model.modules():
        if _gated_members(module) is not None:
            module.forward = types.MethodType(_gated_forward, module)
            n += 1
    return n


def gated_shapes(model: nn.Module) -> list[tuple]:
    """The kernel shapes of ``model``'s fused gated MLPs, as :func:`exl3rt.kernels.linear.prewarm_gated` takes
    them, and their device (``[(shape, device), ...]``, each distinct once)."""
    out = []
    for module in model.modules():
        g, d = getattr(module, "gate_proj", None), getattr(module, "down_proj", None)
        if is_gated(module) and type(g) is Exl3Linear and type(d) is Exl3Linear:
            item = ((g.in_padded, g.out_padded, d.out_padded, g.bits, g.codebook, d.bits, d.codebook),
                    d.trellis.device)
            if item not in out:
                out.append(item)
    return out


__all__ = ["FUSABLE_GROUPS", "FusedLinears", "fuse_linears", "unfuse_linears", "fuse_gated_mlps", "is_gated",
           "gated_shapes"]
