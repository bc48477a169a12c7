"""exl3rt.moe plans, runtime cache, ownership, reference launch and prewarm (CPU, fakes where needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from exl3rt import env
from exl3rt.format.bits import words16_per_tile
from exl3rt.moe import (DenseExpert, DeviceFacts, LayerGeometry, MoELayerRuntime, MoERuntimeCache, MoESettings,
                        Owner, PlanError, ReferenceLaunch, attach, auto_prefill_block_m, expert_from_linears,
                        is_draft_name, prewarm, resolve_policy, tiers_from_bitrates, tiers_from_experts)
from exl3rt.runtime import Exl3Linear

H, I, E, TOPK = 16, 8, 8, 4
CPU = DeviceFacts(type="cpu")


# ---- independent truth -------------------------------------------------------------------------------
def loop_moe(x, ids, w, experts):
    """Direct per-token, per-slot loop."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            out[t] += float(w[t, s]) * experts[int(ids[t, s])](x[t:t + 1]).float()[0]
    return out.to(x.dtype)


def dense_experts(seed, n=E, h=H, i=I):
    g = torch.Generator().manual_seed(seed)
    return [DenseExpert(up=torch.randn(h, i, generator=g) / 4, down=torch.randn(i, h, generator=g) / 4,
                        gate=torch.randn(h, i, generator=g) / 4) for _ in range(n)]


def inputs(m, seed=0, n=E, k=TOPK, ids_dtype=torch.int64, h=H):
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(m, h, generator=g)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(m)]) if m else torch.zeros(0, k)
    w = torch.rand(m, k, generator=g)
    return x, ids.to(ids_dtype), w


# ---- fakes --------------------------------------------------------------------------------------------
class Recorder:
    """A launch factory wrapping ReferenceLaunch that records every hook call."""

    def __init__(self):
        self.made, self.binds, self.runs, self.warm = [], [], [], []

    def __call__(self, key, plan, arena):
        rec = self

        class Recorded(ReferenceLaunch):
            def bind(self, layer):
                rec.binds.append((layer.name, plan.kind))
                return super().bind(layer)

            def run(self, binding, x, ids, w, out):
                rec.runs.append((binding.layer, plan.kind, x.shape[0]))
                return super().run(binding, x, ids, w, out)

            def warmup(self, rows, ids_dtype):
                rec.warm.append((id(self), plan.kind, rows, ids_dtype))
                return super().warmup(rows, ids_dtype)

        launch = Recorded(key, plan, arena)
        self.made.append((key, plan))
        return launch


class Facts:
    """Counting device-facts query."""

    def __init__(self, facts=CPU):
        self.calls, self.facts = 0, facts

    def __call__(self, device):
        self.calls += 1
        return self.facts


class Capture:
    def __init__(self):
        self.on = False

    def __call__(self):
        return self.on


def make_cache(rec=None, facts=None, capture=None):
    return MoERuntimeCache(rec or Recorder(), capturing=capture or Capture(), device_facts=facts or Facts())


class Scope:
    """Stands for a model / quantization config that owns runtimes."""


def make_layer(cache, *, name="model.layers.0.mlp.experts", bits=(3, 4, 3, 3, 4, 3, 4, 3), seed=0, scope=None,
               is_draft=None, settings=None, block_policy=auto_prefill_block_m, top_k=TOPK):
    scope = scope if scope is not None else SCOPE
    return MoELayerRuntime(name, tiers_from_bitrates(list(bits), layer=name), dense_experts(seed, n=len(bits)),
                           hidden=H, intermediate=I, top_k=top_k,
                           settings=settings or MoESettings(max_batched=256, prefill_capacity=128),
                           cache=cache, owner=Owner.of(scope, name, is_draft), block_policy=block_policy)


SCOPE = Scope()


# ---- settings -----------------------------------------------------------------------------------------
def test_settings_defaults_env_and_explicit_values():
    s = MoESettings.from_env(512, environ={})
    assert (s.max_decode_m, s.prefill_capacity, s.prefill_block_m, s.decode_block_m) == (32, None, None, 8)
    environ = {"EXL3RT_MOE_MAX_DECODE_M": "16", "EXL3RT_MOE_PREFILL_BLOCK_M": "48",
               "EXL3RT_MOE_PREFILL_CAPACITY": " 128 "}
    s = MoESettings.from_env(512, environ=environ)
    assert (s.max_decode_m, s.prefill_capacity, s.prefill_block_m) == (16, 128, 48)
    s = MoESettings.from_env(512, environ=environ, prefill_block_m=64, max_decode_m=8)
    assert (s.max_decode_m, s.prefill_block_m) == (8, 64)
    assert MoESettings.from_env(512, environ={"EXL3RT_MOE_PREFILL_BLOCK_M": "  "}).prefill_block_m is None
    with pytest.raises(env.EnvError, match=r"EXL3RT_MOE_PREFILL_BLOCK_M='0'.*positive"):
        MoESettings.from_env(512, environ={"EXL3RT_MOE_PREFILL_BLOCK_M": "0"})
    with pytest.raises(env.EnvError, match=r"EXL3RT_MOE_MAX_DECODE_M='x'.*positive integer"):
        MoESettings.from_env(512, environ={"EXL3RT_MOE_MAX_DECODE_M": "x"})
    with pytest.raises(PlanError, match=r"capacity=600, max_batched=512"):
        MoESettings.from_env(512, environ={"EXL3RT_MOE_PREFILL_CAPACITY": "600"})
    assert "EXL3RT_MOE_PREFILL_CAPACITY" in env.describe()


# ---- policy --------------------------------------------------------------------------------------------
GEOM = LayerGeometry(hidden=H, intermediate=I, num_experts=E, top_k=TOPK, tier_signature=((3, 5), (4, 3)))


def test_policy_plans_and_slices():
    pol = resolve_policy(GEOM, MoESettings(max_batched=256, prefill_capacity=128), CPU)
    assert (pol.decode.max_rows, pol.decode.block_m) == (32, 8)
    assert (pol.prefill.max_rows, pol.prefill.block_m) == (128, 64)
    rows = lambda m: [(s.start, s.rows, s.plan.kind) for s in pol.slices(m)]  # noqa: E731
    assert rows(1) == [(0, 1, "decode")] and rows(32) == [(0, 32, "decode")]
    assert rows(33) == [(0, 33, "prefill")]
    assert rows(200) == [(0, 128, "prefill"), (128, 72, "prefill")]
    assert rows(127) == [(0, 127, "prefill")] and rows(128) == [(0, 128, "prefill")]
    assert rows(129) == [(0, 128, "prefill"), (128, 1, "prefill")]
    assert rows(256) == [(0, 128, "prefill"), (128, 128, "prefill")]
    assert rows(0) == []
    with pytest.raises(PlanError, match=r"m=257, capacity=256"):
        pol.slices(257)
    # default capacity = max_batched: one slice
    pol = resolve_policy(GEOM, MoESettings(max_batched=256), CPU)
    assert [(s.rows, s.plan.max_rows) for s in pol.slices(200)] == [(200, 256)]
    # every allowed batch fits the decode plan: no prefill plan
    pol = resolve_policy(GEOM, MoESettings(max_batched=16), CPU)
    assert pol.prefill is None and pol.decode.max_rows == 16 and pol.plans == (pol.decode,)


def test_row_buckets_cover_every_reachable_row_count():
    pol = resolve_policy(GEOM, MoESettings(max_batched=256, prefill_capacity=200), CPU)
    for plan, lo in ((pol.decode, 1), (pol.prefill, 1)):  # capacity < max_batched: tails of any size
        assert plan.min_rows == lo
        assert set(plan.row_buckets()) == {plan.bucket(m) for m in range(lo, plan.max_rows + 1)}
    assert pol.decode.row_buckets() == (1, 2, 4, 8, 16, 32)
    assert pol.prefill.row_buckets() == (1, 2, 4, 8, 16, 32, 64, 128, 200)
    pol = resolve_policy(GEOM, MoESettings(max_batched=256), CPU)  # no slicing: prefill starts above decode
    assert pol.prefill.min_rows == 33 and pol.prefill.row_buckets() == (64, 128, 256)


def test_prefill_block_policy_hook_and_explicit_override():
    calls = []

    def hook(geom, facts, capacity):
        calls.append((geom, facts, capacity))
        return 32

    pol = resolve_policy(GEOM, MoESettings(max_batched=256), CPU, block_policy=hook)
    # once for the arena (256 rows), once for the plan's smallest call and each other row bucket (33-64, 65-128)
    assert pol.prefill.block_m == 32 and not pol.prefill_block_explicit
    assert calls == [(GEOM, CPU, 256), (GEOM, CPU, 33), (GEOM, CPU, 64), (GEOM, CPU, 128)]
    assert [pol.prefill.block_for(m) for m in (33, 64, 65, 200, 256)] == [32] * 5
    assert pol.prefill.block_steps == ((33, 32),) and pol.prefill.warm_rows() == (33, 64, 65, 128, 129, 256)
    calls.clear()
    pol = resolve_policy(GEOM, MoESettings(max_batched=256, prefill_block_m=64), CPU, block_policy=hook)
    assert pol.prefill.block_m == 64 and pol.prefill_block_explicit and calls == []
    assert pol.prefill.block_steps == () and pol.prefill.block_for(40) == 64      # explicit: every call
    pol = resolve_policy(GEOM, MoESettings.from_env(256, environ={"EXL3RT_MOE_PREFILL_BLOCK_M": "48"}), CPU,
                         block_policy=hook)
    assert pol.prefill.block_m == 48 and calls == []
    # the default hook, by the routes an average expert gets (rows·8/256): 16 below 16, 32 below 32, 64 below 64,
    # else 128 where the wgmma launch runs and 64 elsewhere
    many = LayerGeometry(hidden=H, intermediate=I, num_experts=256, top_k=8, tier_signature=((3, 192), (4, 64)))
    hopper = DeviceFacts(type="cuda", index=0, capability=(9, 0), sms=132, wgmma=True)
    rows = (33, 511, 512, 1023, 1024, 2047, 2048, 8192)
    assert [auto_prefill_block_m(many, CPU, c) for c in rows] == [16, 16, 32, 32, 64, 64, 64, 64]
    assert [auto_prefill_block_m(many, hopper, c) for c in rows] == [16, 16, 32, 32, 64, 64, 128, 128]
    # a large arena: each call gets the block for its own row count (the arena's block sizes the route capacity)
    pre = resolve_policy(many, MoESettings(max_batched=8192), CPU).prefill
    assert pre.block_m == 64 and pre.route_capacity == 8192 * 8 + 256 * 63
    assert pre.block_steps == ((33, 16), (512, 32), (1024, 64))
    assert [pre.block_for(m) for m in (33, 100, 511, 512, 600, 1023, 1024, 1500, 2048, 5000, 8192)] == \
        [16, 16, 16, 32, 32, 32, 64, 64, 64, 64, 64]
    pre = resolve_policy(many, MoESettings(max_batched=8192), hopper).prefill
    assert pre.block_m == 128 and pre.route_capacity == 8192 * 8 + 256 * 127
    assert pre.block_steps == ((33, 16), (512, 32), (1024, 64), (2048, 128))
    assert [pre.block_for(m) for m in (1023, 1024, 1500, 2047, 2048, 5000)] == [32, 64, 64, 64, 128, 128]
    # prewarm rows: the first and last row count of each block's range inside each row bucket
    assert pre.warm_rows() == (33, 64, 65, 128, 129, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 4096,
                               4097, 8192)
    # steps inside one bucket (a hook that switches at 40 and 50 rows): both ends of each block's range
    pol = resolve_policy(GEOM, MoESettings(max_batched=256), CPU,
                         block_policy=lambda g, f, c: 16 if c < 40 else 32 if c < 50 else 64)
    assert pol.prefill.block_steps == ((33, 16), (40, 32), (50, 64))
    assert pol.prefill.warm_rows() == (33, 39, 40, 49, 50, 64, 65, 128, 129, 256)
    with pytest.raises(PlanError, match="at most the arena's block"):
        resolve_policy(many, MoESettings(max_batched=8192), CPU, block_policy=lambda g, f, c: 64 if c < 8192 else 32)
    with pytest.raises(PlanError, match="not non-decreasing"):
        resolve_policy(many, MoESettings(max_batched=8192), CPU,
                       block_policy=lambda g, f, c: 64 if c >= 4096 else 32 if 256 <= c < 512 else 16)
    assert resolve_policy(GEOM, MoESettings(max_batched=256), CPU).prefill.block_m == 64


# ---- end to end through the reference launch ---------------------------------------------------------------
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_forward_matches_direct_loop_across_decode_prefill_and_slices(ids_dtype):
    rec = Recorder()
    layer = make_layer(make_cache(rec))
    experts = layer.weights
    for m, runs in ((1, [("decode", 1)]), (5, [("decode", 5)]), (32, [("decode", 32)]), (33, [("prefill", 33)]),
                    (200, [("prefill", 128), ("prefill", 72)]), (0, [])):
        rec.runs.clear()
        x, ids, w = inputs(m, seed=m, ids_dtype=ids_dtype)
        y = layer(x, ids, w)
        assert [(k, r) for _, k, r in rec.runs] == runs
        torch.testing.assert_close(y, loop_moe(x, ids, w, experts), rtol=1e-5, atol=1e-5)
    # routes to no expert in this layer's range are dropped (expert-parallel sentinel E), like Exl3Experts
    x, ids, w = inputs(6, seed=9, ids_dtype=ids_dtype)
    ids[:, 0] = E
    want = loop_moe(x, ids[:, 1:], w[:, 1:], experts)
    torch.testing.assert_close(layer(x, ids, w), want, rtol=1e-5, atol=1e-5)


def test_rows_above_declared_maximum_fail_before_planning():
    cache = make_cache()
    layer = make_layer(cache)
    with pytest.raises(PlanError, match=r"m=257, capacity=256"):
        layer(*inputs(257))
    assert len(cache) == 0 and not layer.planned


def test_layers_with_the_same_key_share_launches_but_bind_their_own_weights():
    rec = Recorder()
    cache = make_cache(rec)
    a = make_layer(cache, name="model.layers.1.mlp.experts", seed=1)
    b = make_layer(cache, name="model.layers.2.mlp.experts", seed=2)
    for layer in (a, b, a, b):
        for m in (4, 100):
            x, ids, w = inputs(m, seed=m)
            torch.testing.assert_close(layer(x, ids, w), loop_moe(x, ids, w, layer.weights), rtol=1e-5, atol=1e-5)
    assert len(cache) == 1 and a.runtimes()[0] is b.runtimes()[0]
    assert len(rec.made) == 2  # one decode and one prefill launch, compiled once
    assert sorted(rec.binds) == sorted([(n, k) for n in (a.name, b.name) for k in ("decode", "prefill")])


def test_tier_counts_are_part_of_the_key():
    # equal shapes, E, top_k and tier bitrates, different counts (known bug: 206/50 vs 160/96 collided)
    cache = make_cache()
    a = make_layer(cache, name="l3", bits=(3, 3, 3, 3, 3, 3, 4, 4), seed=3)
    b = make_layer(cache, name="l4", bits=(3, 3, 3, 3, 3, 4, 4, 4), seed=4)
    for layer in (a, b):
        x, ids, w = inputs(40, seed=7)
        torch.testing.assert_close(layer(x, ids, w), loop_moe(x, ids, w, layer.weights), rtol=1e-5, atol=1e-5)
    assert len(cache) == 2 and a.runtimes()[0] is not b.runtimes()[0]
    assert a.runtimes()[0].key.tier_signature == ((3, 6), (4, 2))


def test_owners_never_share_runtimes():
    cache = make_cache()
    target = make_layer(cache, name="model.layers.3.mlp.experts")
    draft = make_layer(cache, name="model.mtp.layers.0.mlp.experts")
    stamped = make_layer(cache, name="model.layers.78.mlp.experts", is_draft=True)   # stamp wins over a target name
    named = make_layer(cache, name="model.mtp.0.experts", is_draft=False)            # ... and over a draft name
    other_model = make_layer(cache, name="model.layers.3.mlp.experts", scope=Scope())
    for layer in (target, draft, stamped, named, other_model):
        layer.plan("cpu", torch.float32, torch.int64)
    rt = lambda layer: layer.runtimes()[0]  # noqa: E731
    assert rt(draft) is not rt(target) and rt(stamped) is rt(draft)
    assert rt(named) is rt(target) and rt(other_model) is not rt(target)
    assert len(cache) == 3
    assert all(is_draft_name(n) for n in ("m.mtp.0", "nextn.x", "eagle_head", "draft.layers", "speculator.0"))
    assert not is_draft_name("model.layers.78.mlp.experts")


def test_policy_is_resolved_once_per_layer():
    facts = Facts()
    cache = make_cache(facts=facts)
    a = make_layer(cache, name="a")
    for m, dtype in ((3, torch.int64), (50, torch.int64), (7, torch.int32), (200, torch.int32)):
        a(*inputs(m, ids_dtype=dtype))
    assert facts.calls == 1
    b = make_layer(cache, name="b")
    b(*inputs(3))
    assert facts.calls == 2 and a.policy is not None and len(a.runtimes()) == 2


def test_planning_during_graph_capture_is_an_error():
    capture = Capture()
    cache = make_cache(capture=capture)
    layer = make_layer(cache)
    capture.on = True
    with pytest.raises(RuntimeError, match="CUDA graph is being captured"):
        layer(*inputs(4))
    assert len(cache) == 0
    capture.on = False
    layer(*inputs(4))
    capture.on = True
    x, ids, w = inputs(60, seed=2)
    torch.testing.assert_close(layer(x, ids, w), loop_moe(x, ids, w, layer.weights), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="capture"):  # a new route-id dtype would plan a new runtime
        layer(*inputs(4, ids_dtype=torch.int32))


def test_inputs_and_geometry_changes_are_rejected():
    layer = make_layer(make_cache())
    x, ids, w = inputs(4)
    with pytest.raises(TypeError, match="int32 or int64"):
        layer(x, ids.float(), w)
    with pytest.raises(ValueError, match=r"topk_ids must be \[4, 4\]"):
        layer(x, ids[:, :2], w)
    layer(x, ids, w)
    with pytest.raises(RuntimeError, match="geometry changed after planning"):
        layer(x.double(), ids, w)
    with pytest.raises(PlanError, match="top_k=9"):
        make_layer(make_cache(), top_k=9)


def test_exl3_linear_experts_end_to_end():
    """Experts as real EXL3 codes (K 2/3/4, random trellis): tiers from the codes, forward vs direct loop."""
    h, i, n, k = 128, 128, 4, 2
    g = torch.Generator().manual_seed(5)

    def lin(fi, fo, bits):
        m = Exl3Linear(fi, fo, bits, "mcg")
        m.trellis.copy_(torch.randint(-32768, 32767, m.trellis.shape, generator=g, dtype=torch.int16))
        m.suh.copy_((torch.randn(fi, generator=g).sign() * 0.1).half())
        m.svh.copy_((torch.randn(fo, generator=g).sign() * 0.1).half())
        return m

    mods = [{"gate_proj": lin(h, i, kk), "up_proj": lin(h, i, kk), "down_proj": lin(i, h, kk)} for kk in (4, 2, 3, 2)]
    layout = tiers_from_experts(mods, layer="blk.1.experts")
    assert layout.signature == ((2, 2), (3, 1), (4, 1))
    assert mods[0]["down_proj"].trellis.shape[-1] == words16_per_tile(4)
    experts = [expert_from_linears(m["up_proj"], m["down_proj"], m["gate_proj"]) for m in mods]
    layer = MoELayerRuntime("blk.1.experts", layout, experts, hidden=h, intermediate=i, top_k=k,
                            settings=MoESettings(max_batched=64, max_decode_m=4), cache=make_cache(),
                            owner=Owner.of(SCOPE, "blk.1.experts"))
    for m in (3, 20):
        x, ids, w = inputs(m, seed=m, n=n, k=k, h=h)
        torch.testing.assert_close(layer(x, ids, w), loop_moe(x, ids, w, experts), rtol=1e-4, atol=1e-4)


# ---- prewarm ------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)


class Model(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in layers)
        for blk, layer in zip(self.blocks, layers):
            attach(blk, layer)


def test_prewarm_visits_every_reachable_specialization_once():
    rec = Recorder()
    cache = make_cache(rec)
    a = make_layer(cache, name="a", seed=1)
    b = make_layer(cache, name="b", seed=2)                       # shares a's runtime
    c = make_layer(cache, name="c", bits=(4,) * 8, settings=MoESettings(max_batched=16))  # decode only
    for layer in (a, b, c):
        layer.plan("cpu", torch.float32, torch.int32)
    n = prewarm(Model([a, b, c]))
    decode = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32]     # both ends of each row bucket
    # capacity 128 < max_batched 256: tails of any size reach the prefill plan; its route block steps up at 32 rows
    # (16 → 32) and 64 (→ 64) for this geometry (8 experts, top-2): 17-31, 32, 33-63, 64 are separate ranges
    prefill = [1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 63, 64, 65, 128]
    small = [1, 2, 3, 4, 5, 8, 9, 16]
    want = sorted((kind, r, str(d)) for kind, rows in (("decode", decode), ("prefill", prefill), ("decode", small))
                  for r in rows for d in (torch.int32, torch.int64))
    assert sorted((kind, r, str(d)) for _, kind, r, d in rec.warm) == want
    assert n == len(want) == 2 * (10 + 16 + 8)


def test_prewarm_fails_closed_without_a_plan_and_ignores_other_models():
    cache = make_cache()
    planned = make_layer(cache, name="model.layers.0.experts")
    unplanned = make_layer(cache, name="model.layers.1.experts")
    planned.plan("cpu", torch.float32)
    with pytest.raises(RuntimeError, match=r"layer model\.layers\.1\.experts has no planned runtime"):
        prewarm(Model([planned, unplanned]))
    assert prewarm(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == 0
