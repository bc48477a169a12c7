"""Exl3MoE: quantized fused experts run through a planned mixed-bitrate MoE runtime (docs/moe.md).

After :func:`~exl3rt.runtime.quantize_model.quantize_model` (or the transformers loader) has turned a
fused experts module into an :class:`~exl3rt.runtime.experts.Exl3Experts` (one Exl3Linear per expert
matrix, any K per expert), :func:`install_moe_runtimes` decides per module:

- **runtime** (``Exl3MoE``): every matrix is EXL3-coded and each expert has one K across its
  projections, so the experts can be tiered. The module becomes an :class:`Exl3MoE` holding the same
  children, plus an :class:`~exl3rt.moe.MoELayerRuntime` (tiers from the codes via
  ``tiers_from_experts``, rotations via ``tier_rotations``, ``MoESettings.from_env(moe_max_batched)``)
  attached with :func:`exl3rt.moe.attach`, so :func:`exl3rt.moe.prewarm` finds it. Forward::

      out[t] = Σ_k w[t,k] · expert_{idx[t,k]}(x_t)      via layer runtime (route packing, plans, launch)

  where ``expert_e`` is :meth:`Exl3Experts.expert_forward` (the HF gate function and biases included).
  Launches come from the model's one :class:`~exl3rt.moe.MoERuntimeCache`: by default
  :func:`exl3rt.moe.auto_launch_factory` (the tiered Triton kernels on CUDA for layers they compute
  exactly — :func:`fused_reason` — the torch reference launch otherwise).
- **loop** (``Exl3Experts`` kept): a matrix is kept dense, an expert mixes K across projections, or
  ``top_k`` is unknown. With ``Exl3Config.moe_runtime=None`` this is logged at INFO with the reason;
  with ``moe_runtime=True`` it is a :class:`~exl3rt.runtime.policy.PolicyError`; ``moe_runtime=False``
  always keeps the loop.

Rows above ``moe_max_batched`` run in chunks of that many rows (the runtime's arenas are sized for
it). A later call with another device or dtype re-plans the layer (logged at INFO).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from ..moe import (MOE_ATTR, MoELayerRuntime, MoERuntimeCache, MoESettings, Owner, TierError,
                   TierLayout, attach, auto_launch_factory, tier_rotations, tiers_from_experts)
from ..moe.launches import LaunchFactory
from .config import Exl3Config
from .experts import Exl3Experts
from .linear import Exl3Linear
from .policy import PolicyError

log = logging.getLogger("exl3rt.runtime")

_CACHE_ATTR = "_exl3rt_moe_cache"


class ExpertFn(dict):
    """Expert ``expert`` of an :class:`Exl3Experts`: ``{proj: Exl3Linear}`` that is also callable ``[n, H] -> [n, H]``.

    Calling it runs :meth:`Exl3Experts.expert_forward` (unweighted; the module's gate function and
    biases included): what the torch reference launch binds. As a dict of the expert's EXL3 linears it
    is also what a fused launch binds (e.g. :mod:`exl3rt.moe.triton_launch`).
    """

    def __init__(self, module: Exl3Experts, expert: int):
        super().__init__({p: module.projection(expert, p) for p in module.layout.projections()})
        self.module = module
        self.expert = int(expert)
        #: the fused (Triton) launch computes exactly this expert: see :func:`fused_reason`
        self.fused_ok = fused_reason(module) is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.expert_forward(self.expert, x)

    def __repr__(self) -> str:
        return f"ExpertFn({self.module.name}, expert={self.expert})"


def tier_reason(module: Exl3Experts) -> Optional[str]:
    """Why ``module`` cannot be tiered (None: it can): a dense matrix or an expert mixing K."""
    for e in range(module.num_experts):
        ks = {}
        for p in module.layout.projections():
            child = module.projection(e, p)
            if not isinstance(child, Exl3Linear):
                return f"expert {e} {p} is kept dense (an ignore pattern matches it)"
            ks[p] = child.bits
        if len(set(ks.values())) > 1:
            return f"expert {e} mixes bitrates across projections ({ks}); the MoE runtime tiers whole experts"
    return None


def fused_reason(module: Exl3Experts) -> Optional[str]:
    """Why the fused MoE launch (``exl3rt.moe.triton_launch``: ``down(silu(gate x) · up x)``, widths
    multiples of 128, no bias) cannot compute ``module``'s experts exactly (None: it can); such layers
    bind the torch reference launch instead."""
    fn = module._gate_fn
    default_gate = (getattr(fn, "__name__", "") == "_default_apply_gate"  # ours or transformers': act(gate) * up
                    and getattr(fn, "__module__", "").split(".")[0] in ("exl3rt", "transformers"))
    if module.layout.has_bias:
        return "the experts have biases"
    if module.layout.has_gate and not (default_gate and module.layout.is_concatenated
                                       and "silu" in type(module.act_fn).__name__.lower()):
        return (f"gate function {getattr(fn, '__module__', '')}.{getattr(fn, '__name__', fn)} with "
                f"{type(module.act_fn).__name__} (the fused launch computes silu(gate)·up)")
    if not module.layout.has_gate:
        return "ungated experts (the module's activation is not known to the fused launch)"
    for e in range(module.num_experts):
        for p in module.layout.projections():
            child = module.projection(e, p)
            if not isinstance(child, Exl3Linear) or child.in_features % 128 or child.out_features % 128:
                return f"expert {e} {p} is not an unpadded EXL3 linear (widths must be multiples of 128)"
    return None


def find_top_k(model: nn.Module, name: str) -> Optional[int]:
    """Experts per token of experts module ``name``: a sibling router's ``top_k``, the block's, or the model
    config's ``num_experts_per_tok`` (None when none is found)."""
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    child_name = name.rpartition(".")[2]
    candidates = [m for n, m in parent.named_children() if n != child_name] + [parent]
    cfg = getattr(model, "config", None)
    if cfg is not None:
        candidates.append(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)
    for obj in candidates:
        for attr in ("top_k", "num_experts_per_tok"):
            value = getattr(obj, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def model_moe_cache(model: nn.Module, launch_factory: Optional[LaunchFactory] = None) -> MoERuntimeCache:
    """The model's one :class:`MoERuntimeCache` (created on first use, kept on the model)."""
    cache = getattr(model, _CACHE_ATTR, None)
    if cache is None or (launch_factory is not None and cache.launch_factory is not launch_factory):
        cache = MoERuntimeCache(launch_factory or auto_launch_factory)
        object.__setattr__(model, _CACHE_ATTR, cache)
    return cache


class Exl3MoE(Exl3Experts):
    """:class:`Exl3Experts` whose forward runs through its attached :class:`~exl3rt.moe.MoELayerRuntime`.

    Build with :meth:`from_experts`. ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H]``, the same contract (and math) as the per-expert loop.
    """

    @classmethod
    def from_experts(cls, experts: Exl3Experts, *, top_k: int, settings: MoESettings, cache: MoERuntimeCache,
                     owner: Owner) -> "Exl3MoE":
        """A new module holding ``experts``' children and biases, with its layer runtime planned for them.

        Raises :class:`~exl3rt.moe.TierError` when the experts cannot be tiered (see :func:`tier_reason`).
        """
        reason = tier_reason(experts)
        if reason is not None:
            raise TierError(f"{experts.name}: {reason}")
        _, attrs = Exl3Experts.gate_attrs(experts)
        new = cls(experts.layout, experts.act_fn, apply_gate=experts._gate_fn, attrs=attrs, name=experts.name)
        for e in range(experts.num_experts):
            for p in experts.layout.projections():
                new.set_projection(e, p, experts.projection(e, p))
        if experts.layout.has_bias:
            for p in (f"{experts.layout.up_param}_bias", "down_proj_bias"):
                setattr(new, p, getattr(experts, p))
        new._top_k, new._settings, new._cache, new._owner = int(top_k), settings, cache, owner
        new._build_runtime()
        return new

    # ---- the layer runtime ---------------------------------------------------------------------------
    @property
    def moe(self) -> MoELayerRuntime:
        return getattr(self, MOE_ATTR)

    @property
    def tier_layout(self) -> TierLayout:
        return self.moe.layout

    def _build_runtime(self) -> MoELayerRuntime:
        lay = self.layout
        projs = [{p: self.projection(e, p) for p in lay.projections()} for e in range(lay.num_experts)]
        layout = tiers_from_experts(projs, layer=self.name)

        def table(proj: str, side: str) -> torch.Tensor:
            return torch.stack([getattr(projs[e][proj], side) for e in range(lay.num_experts)])

        rotations = tier_rotations(layout, up_suh=table("up_proj", "suh"), up_svh=table("up_proj", "svh"),
                                   down_suh=table("down_proj", "suh"), down_svh=table("down_proj", "svh"),
                                   gate_suh=table("gate_proj", "suh") if lay.has_gate else None,
                                   gate_svh=table("gate_proj", "svh") if lay.has_gate else None)
        layer = MoELayerRuntime(self.name, layout, [ExpertFn(self, e) for e in range(lay.num_experts)],
                                hidden=lay.hidden, intermediate=lay.intermediate, top_k=self._top_k,
                                settings=self._settings, cache=self._cache, owner=self._owner, rotations=rotations)
        return attach(self, layer)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        layer = self.moe
        if layer.device is not None and (layer.device != hidden_states.device or layer.x_dtype != hidden_states.dtype):
            log.info("%s: MoE runtime re-planned for %s/%s (was %s/%s)", self.name, hidden_states.device,
                     hidden_states.dtype, layer.device, layer.x_dtype)
            layer = self._build_runtime()
        x = hidden_states.reshape(-1, self.hidden_dim)
        ids = top_k_index.reshape(x.shape[0], -1)
        w = top_k_weights.reshape(x.shape[0], -1)
        step = self._settings.max_batched
        if x.shape[0] <= step:
            out = layer(x, ids, w)
        else:
            out = torch.cat([layer(x[s:s + step], ids[s:s + step], w[s:s + step]) for s in range(0, x.shape[0], step)])
        return out.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tiers={self.moe.layout.signature}, top_k={self._top_k}"


def install_moe_runtimes(model: nn.Module, config: Exl3Config, *,
                         launch_factory: Optional[LaunchFactory] = None) -> dict[str, str]:
    """Turn each :class:`Exl3Experts` of ``model`` into an :class:`Exl3MoE` where ``config`` allows (see top).

    Returns ``{module name: "runtime <tier signature>" | "loop: <reason>"}``.
    """
    from .surgery import replace_module

    done: dict[str, str] = {}
    found = [(n, m) for n, m in model.named_modules() if type(m) is Exl3Experts]
    if not found:
        return done
    settings: Optional[MoESettings] = None
    for name, module in found:
        if config.moe_runtime is False:
            done[name] = "loop: Exl3Config.moe_runtime=False"
            continue
        reason = tier_reason(module)
        top_k = find_top_k(model, name) if reason is None else None
        if reason is None and (top_k is None or top_k > module.num_experts):
            reason = (f"experts per token unknown (found {top_k}); the router, its block or the model config "
                      f"must say top_k / num_experts_per_tok")
        if reason is not None:
            if config.moe_runtime:
                raise PolicyError(f"{name}: cannot run through the EXL3 MoE runtime: {reason}; encode every "
                                  f"matrix of an expert at one K, or set Exl3Config(moe_runtime=None) to fall back "
                                  f"to the per-expert loop where needed")
            log.info("%s: per-expert loop instead of the MoE runtime: %s", name, reason)
            done[name] = f"loop: {reason}"
            continue
        if settings is None:
            settings = MoESettings.from_env(max_batched=config.moe_max_batched)
        new = Exl3MoE.from_experts(module, top_k=top_k, settings=settings,
                                   cache=model_moe_cache(model, launch_factory), owner=Owner.of(model, name))
        replace_module(model, name, new)
        done[name] = f"runtime {new.tier_layout.signature}"
    return done


def moe_paths(model: nn.Module) -> dict[str, str]:
    """``{experts module name: "runtime" | "loop"}`` for every EXL3 experts module of ``model``."""
    return {n: "runtime" if isinstance(m, Exl3MoE) else "loop"
            for n, m in model.named_modules() if isinstance(m, Exl3Experts)}


__all__ = ["ExpertFn", "Exl3MoE", "find_top_k", "fused_reason", "install_moe_runtimes", "model_moe_cache", "moe_paths",
           "tier_reason"]
