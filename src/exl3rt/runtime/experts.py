"""Exl3Experts: a fused MoE experts module (transformers 5.x) with one EXL3 linear per expert matrix.

transformers 5.x stores a layer's experts as 3-D parameters (``Qwen3MoeExperts``:
``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``). EXL3 codes 2-D matrices, so every expert's
gate, up and down projection becomes its own child module, named like a per-expert checkpoint::

    <experts>.{e}.gate_proj   [H -> I]     (absent when the experts have no gate)
    <experts>.{e}.up_proj     [H -> I]
    <experts>.{e}.down_proj   [I -> H]

A child is an :class:`~exl3rt.runtime.linear.Exl3Linear` (any K, so experts may differ in bitrate)
or a plain bias-free ``nn.Linear`` for a matrix the config keeps dense. Biases, if the experts have
them, stay fused in the HF layout (``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``).

Forward (same signature and math as the HF experts module's eager path)::

    out[t] = Σ_{k} w[t,k] · down_e( gate_fn( [gate_e(x_t) ; up_e(x_t)] + b_up[e] ) ) + b_down[e],  e = idx[t,k]

where ``[gate ; up]`` is rebuilt in the module's own layout (concatenated or interleaved) so the
module's own ``_apply_gate`` (copied from the HF class) applies unchanged. This module always runs
the per-expert loop; transformers' ``config._experts_implementation`` does not apply to it. Its subclass
:class:`~exl3rt.runtime.moe_module.Exl3MoE` runs the same experts through a planned MoE runtime.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..moe.op import call_moe, register as register_moe_layer
from .policy import ExpertLayout


def _default_apply_gate(self: nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` for concatenated ``[gate ; up]`` (transformers' default)."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    return self.act_fn(gate) * up


class Exl3Expert(nn.Module):
    """One expert's projections (children ``gate_proj``/``up_proj``/``down_proj``, set by :class:`Exl3Experts`)."""


class Exl3Experts(nn.Module):
    """Experts of one MoE layer as per-expert linears; see the module docstring.

    ``forward(hidden_states [T, H], top_k_index [T, k] (int), top_k_weights [T, k]) -> [T, H]``.
    """

    def __init__(self, layout: ExpertLayout, act_fn: nn.Module, *, apply_gate: Optional[Callable] = None,
                 attrs: Optional[dict[str, Any]] = None, name: str = ""):
        super().__init__()
        self.layout = layout
        self.num_experts = layout.num_experts
        self.hidden_dim = layout.hidden
        self.intermediate_dim = layout.intermediate
        self.act_fn = act_fn
        self.name = name
        self._gate_fn = apply_gate or _default_apply_gate
        self._moe_handle = register_moe_layer(self)   # what torch.ops.exl3rt.moe calls this layer by
        for key, value in (attrs or {}).items():  # plain attributes a custom _apply_gate may read (alpha, limit…)
            if not hasattr(self, key):
                setattr(self, key, value)
        for e in range(layout.num_experts):
            self.add_module(str(e), Exl3Expert())
        if layout.has_bias:
            shapes = layout.param_shapes()
            for p in (f"{layout.up_param}_bias", "down_proj_bias"):
                self.register_parameter(p, nn.Parameter(torch.zeros(shapes[p]), requires_grad=False))

    # ---- construction ------------------------------------------------------------------------------
    @staticmethod
    def gate_attrs(module: nn.Module) -> tuple[Callable, dict[str, Any]]:
        """The HF module's ``_apply_gate`` function and the plain attributes it may use."""
        fn = getattr(type(module), "_apply_gate", None) or _default_apply_gate
        attrs = {k: v for k, v in vars(module).items()
                 if not k.startswith("_") and isinstance(v, (int, float, bool, str)) and k != "training"}
        return fn, attrs

    def set_projection(self, expert: int, proj: str, module: nn.Module) -> None:
        """Install expert ``expert``'s ``proj`` (``gate_proj``/``up_proj``/``down_proj``) child."""
        if proj not in self.layout.projections():
            raise ValueError(f"{self.name}: projection {proj!r} is not one of {self.layout.projections()}")
        setattr(getattr(self, str(expert)), proj, module)

    def projection(self, expert: int, proj: str) -> nn.Module:
        return getattr(getattr(self, str(expert)), proj)

    def extra_repr(self) -> str:
        lay = self.layout
        return (f"num_experts={lay.num_experts}, hidden={lay.hidden}, intermediate={lay.intermediate}, "
                f"gated={lay.has_gate}, bias={lay.has_bias}")

    # ---- forward -------------------------------------------------------------------------------------
    def _up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """The HF ``gate_up_proj`` (or ``up_proj``) output of one expert, in the HF layout, + its bias."""
        lay = self.layout
        if lay.has_gate:
            gate = self.projection(expert, "gate_proj")(x)
            up = self.projection(expert, "up_proj")(x)
            out = torch.cat([gate, up], -1) if lay.is_concatenated else torch.stack([gate, up], -1).flatten(-2)
        else:
            out = self.projection(expert, "up_proj")(x)
        if lay.has_bias:
            out = out + getattr(self, f"{lay.up_param}_bias")[expert].to(out.dtype)
        return out

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert, unweighted, ``[n, H] -> [n, H]``.

        ``down_e(gate_fn([gate_e(x) ; up_e(x)] + b_up[e])) + b_down[e]`` (``act(up_e(x) + b_up[e])`` ungated).
        """
        h = self._up(expert, x)
        h = self._gate_fn(self, h) if self.layout.has_gate else self.act_fn(h)
        y = self.projection(expert, "down_proj")(h)
        if self.layout.has_bias:
            y = y + self.down_proj_bias[expert].to(y.dtype)
        return y

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``[tokens, H]`` (any leading shape) -> the same: one ``torch.ops.exl3rt.moe`` call running
        :meth:`moe_forward` (the loop over the routed experts is data-dependent: a compiler must not trace it;
        plain eager calls skip the op's dispatch, :func:`exl3rt.moe.op.call_moe`)."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        y = call_moe(x, top_k_index.reshape(x.shape[0], -1), top_k_weights.reshape(x.shape[0], -1), self._moe_handle)
        return y.reshape(hidden_states.shape)

    def moe_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
        """The loop: each routed expert on its tokens, weighted, added up (``[tokens, H]``, ``[tokens, k]``)."""
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:  # expert-parallel sentinel
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            y = self.expert_forward(e, hidden_states[token_idx])
            y = y * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        return final


__all__ = ["Exl3Expert", "Exl3Experts"]
