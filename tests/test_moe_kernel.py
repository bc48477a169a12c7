"""The tiered MoE kernels (``exl3rt.kernels.moe``) and the Triton launch, against float64 per-token loops.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest): tiny
layers (H = I = 128, a few tokens). The reference is independent of the kernels: dense weights from
``format.reconstruct`` in float64 and a loop over tokens and their routed experts. ``exl3_moe`` runs the
fused passes (kernels/moe_glue.py) by default; ``fused=False`` is the torch glue. The fused tests use
``nt=1, num_warps=8`` (one program per route block: the interpreter pays per program and op).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernel_env import DEV, garbage_empty as _garbage_empty, require_kernels
from spec_keys import record

require_kernels()

from exl3rt.format.bits import words16_per_tile  # noqa: E402
from exl3rt.format.reconstruct import reconstruct  # noqa: E402
from exl3rt.kernels.moe import (GlueLaunch, MoEWeights, default_glue, exl3_moe, fused_glue_supported,  # noqa: E402
                                grouped_gemv, pack_routes_fused, tiered_partials)
from exl3rt.moe import MoELayerRuntime, MoERuntimeCache, MoESettings, Owner  # noqa: E402
from exl3rt.moe.reference import DenseExpert, reference_launch_factory  # noqa: E402
from exl3rt.kernels import common as kc  # noqa: E402
from exl3rt.kernels.routing import pack_routes  # noqa: E402
from exl3rt.moe.tiers import tiers_from_bitrates  # noqa: E402
from exl3rt.moe.triton_launch import triton_launch_factory  # noqa: E402


def _lin(i: int, o: int, bits, g: torch.Generator, codebook: str, suh=None):
    tr = torch.randint(-32768, 32768, (i // 16, o // 16, words16_per_tile(bits)), dtype=torch.int16, generator=g)
    if suh is None:
        suh = ((torch.rand(i, generator=g) + 0.5) * 0.2).half()
    svh = ((torch.rand(o, generator=g) + 0.5) * 0.2).half()
    return SimpleNamespace(trellis=tr.to(DEV), suh=suh.to(DEV), svh=svh.to(DEV), codebook=codebook)


def _experts(bits, *, h=128, i=128, gated=True, shared_h=False, codebook="mcg", seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = ((torch.rand(h, generator=g) + 0.5) * 0.2).half() if shared_h else None
    out = []
    for b in bits:
        ex = {"up_proj": _lin(h, i, b, g, codebook, shared), "down_proj": _lin(i, h, b, g, codebook)}
        if gated:
            ex["gate_proj"] = _lin(h, i, b, g, codebook, shared)
        out.append(ex)
    return out


def _dense(p) -> torch.Tensor:
    return reconstruct(p.trellis.cpu(), p.suh.cpu(), p.svh.cpu(), p.codebook, dtype=torch.float64)


def _loop(x, ids, w, experts, act=F.silu):
    """float64 reference: y[t] = Σ_s w[t,s]·down(act(gate x)·up x) of expert ids[t,s]."""
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            if not 0 <= int(ids[t, s]) < len(experts):
                continue                                    # dropped route (e.g. an expert-parallel sentinel)
            ex = experts[int(ids[t, s])]
            xx = x[t].double().cpu()
            up = xx @ _dense(ex["up_proj"])
            h = act(xx @ _dense(ex["gate_proj"])) * up if "gate_proj" in ex else act(up)
            y[t] += float(w[t, s]) * (h @ _dense(ex["down_proj"]))
    return y


def _inputs(t, e, k, h=128, seed=0, ids_dtype=torch.int64, skip=None):
    g = torch.Generator().manual_seed(seed)
    choices = [i for i in range(e) if i != skip]
    ids = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=g)[:k]] for _ in range(t)])
    return (torch.randn(t, h, generator=g).to(DEV), ids.to(ids_dtype).to(DEV),
            torch.rand(t, k, generator=g).to(DEV))


def _rel(y, ref):
    return float((y.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.parametrize("bits,block_m", [((3, 2, 4, 3), 8), ((2, 4), 32)])
def test_mixed_tiers_match_float64_loop(bits, block_m):
    """Tiers of different K in one launch per projection; block_m below 16 and above (two passes)."""
    experts = _experts(bits, seed=len(bits))
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits), layer="blk.0"), experts)
    x, ids, wts = _inputs(3, len(bits), 2, seed=block_m)
    y = exl3_moe(x, ids, wts, w, block_m=block_m, nt=2, num_warps=2)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert _rel(y, _loop(x, ids, wts, experts)) < 2e-3  # x' and h' in fp16


def test_ungated_shared_h_int32_ids_and_an_idle_expert():
    """Ungated experts, one shared input-side rotation for all experts, int32 ids, an expert with no route."""
    bits = (4, 3, 3)
    experts = _experts(bits, gated=False, shared_h=True, seed=7)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts, act=F.gelu)
    x, ids, wts = _inputs(3, 3, 1, seed=3, ids_dtype=torch.int32, skip=1)
    y = exl3_moe(x, ids, wts, w, block_m=16)
    assert _rel(y, _loop(x, ids, wts, experts, act=F.gelu)) < 2e-3


def test_half_integer_tiers_mul1():
    bits = (2.5, 3.5, 2.5)
    experts = _experts(bits, codebook="mul1", seed=9)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    x, ids, wts = _inputs(2, 3, 2, seed=5)
    assert _rel(exl3_moe(x, ids, wts, w, block_m=8), _loop(x, ids, wts, experts)) < 2e-3


def test_triton_launch_through_the_runtime_matches_the_reference_launch():
    """The same layer planned with the Triton launch and with the torch reference launch; prewarm visits
    the decode launch's specializations."""
    bits = (3, 4, 3, 4)
    experts = _experts(bits, seed=11)
    layout = tiers_from_bitrates(list(bits), layer="model.layers.0.mlp.experts")
    dense = [DenseExpert(up=_dense(e["up_proj"]).float().to(DEV), down=_dense(e["down_proj"]).float().to(DEV),
                         gate=_dense(e["gate_proj"]).float().to(DEV)) for e in experts]
    settings = MoESettings(max_batched=8, max_decode_m=4)
    owner = Owner.of(SimpleNamespace(), layout.layer)
    tri = MoELayerRuntime(layout.layer, layout, experts, hidden=128, intermediate=128, top_k=2, settings=settings,
                          cache=MoERuntimeCache(triton_launch_factory), owner=owner)
    ref = MoELayerRuntime(layout.layer, layout, dense, hidden=128, intermediate=128, top_k=2, settings=settings,
                          cache=MoERuntimeCache(reference_launch_factory), owner=owner)
    x, ids, wts = _inputs(3, 4, 2, seed=1)
    y_tri, y_ref = tri(x, ids, wts), ref(x, ids, wts)
    assert _rel(y_tri, y_ref.double().cpu()) < 2e-3
    launch = tri.runtimes()[0].launches["decode"]
    assert launch.warmup(2, torch.int32) == 6 and (2, torch.int32) in launch.warmed


@pytest.mark.parametrize("top_k", [4, 6])
def test_prewarm_meets_every_specialization_of_real_calls(monkeypatch, top_k):
    """Prewarm (``warm_layer``: every plan, row bucket and id dtype, on the launch's dummy layer) records
    a superset of the kernel specializations that real calls of the layer make at every row count from 1 to
    max_batched, decode and prefill plans (the prefill plan's route block differs between its row buckets),
    both id dtypes — no kernel compiles lazily under traffic (the reference system's prewarm bug). The kernels
    are replaced by recorders (nothing runs). Top-6: the packer's sort width (64 routes or more) changes inside
    a row bucket (at 10/11 rows), as it does for any top-k that is not a power of two."""
    from exl3rt.kernels import moe as km
    from exl3rt.kernels import moe_glue as mg
    from exl3rt.moe.prewarm import warm_layer
    from exl3rt.kernels import moe_wgmma as mw
    warm, real = set(), set()
    names = [(km, "_moe_mma_kernel"), (mg, "moe_pack_kernel"), (mg, "moe_pre_kernel"), (mg, "moe_mid_kernel"),
             (mg, "moe_post_kernel")]
    if mw.applies(torch.device(DEV), 64):                   # Hopper: prefill blocks of 64 on the wgmma launch
        names.append((mw, "_moe_wgmma_kernel"))
    bits = (3,) * 13 + (4,) * 7
    experts = _experts(bits, h=1024, i=512, seed=12)
    layout = tiers_from_bitrates(list(bits), layer="model.layers.0.mlp.experts")
    settings = MoESettings(max_batched=96, max_decode_m=8)
    layer = MoELayerRuntime(layout.layer, layout, experts, hidden=1024, intermediate=512, top_k=top_k,
                            settings=settings, cache=MoERuntimeCache(triton_launch_factory),
                            owner=Owner.of(SimpleNamespace(), layout.layer))
    _force_pdl(monkeypatch)              # the decode plan's dependent launches (1-4 rows) are specializations too
    record(monkeypatch, names, real)
    # split K as on a GPU, with a target small enough that the splits (and k-tiles per split) vary with the rows
    # at this small geometry, as they do at real ones with the real target
    monkeypatch.setattr(km, "default_target_programs", lambda device: 300)
    g = torch.Generator().manual_seed(0)
    for dt in (torch.int32, torch.int64):
        for t in range(1, 97):
            ids = torch.stack([torch.randperm(len(bits), generator=g)[:top_k] for _ in range(t)]).to(dt).to(DEV)
            layer(torch.randn(t, 1024, generator=g).to(DEV), ids, torch.rand(t, top_k, generator=g).to(DEV))
    pol = layer.runtimes()[0].policy
    pre = pol.prefill
    # the block of each call's own row count (routes per expert = rows·top_k/20: 16 from 16 routes)
    assert pre.block_m == 32 and [pre.block_for(m) for m in range(9, 97)] == \
        [16 if m * top_k < 16 * 20 else 32 for m in range(9, 97)]
    record(monkeypatch, names, warm)
    assert warm_layer(layer, set()) > 0
    assert {k[0] for k in real} | {"_moe_wgmma_kernel"} == {n for _, n in names} | {"_moe_wgmma_kernel"}
    missing = real - warm
    assert not missing, f"{len(missing)} specializations met only by real calls, e.g. {sorted(missing)[0]}"


def test_tier_spec_names_each_tier_k_and_words_per_lane():
    """The ``TIERS`` string the tiered kernels read their tiers from: every K the kernels take, in order, reads back
    as its whole bits, half bit and the lane decode's words per lane."""
    from exl3rt.kernels.mma import words_per_lane
    bits = [1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8]
    spec = kc.tier_spec(bits)
    assert kc.tier_count(spec) == len(bits)
    for t, b in enumerate(bits):
        assert [kc.tier_field(spec, t, i) for i in range(3)] == [int(b), int(b != int(b)), words_per_lane(b)], b


def test_grouped_gemv_rejects_bad_stacks():
    g = torch.Generator().manual_seed(0)
    tr = torch.randint(-32768, 32768, (1, 8, 8, 32), dtype=torch.int16, generator=g).to(DEV)
    xs = torch.zeros(16, 128, dtype=torch.float16, device=DEV)
    blk = torch.zeros(1, dtype=torch.int32, device=DEV)
    npad = torch.full((1,), 16, dtype=torch.int32, device=DEV)
    desc = torch.zeros(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="tiers"):
        grouped_gemv(xs, [tr] * 5, blk, npad, desc, 8, 16, "mcg")
    with pytest.raises(ValueError, match="stack"):
        grouped_gemv(xs, [tr, tr[:, :4]], blk, npad, desc, 8, 16, "mcg")
    with pytest.raises(ValueError, match="columns"):
        grouped_gemv(xs[:, :64], [tr], blk, npad, desc, 8, 16, "mcg")


# T, top-k, bits per expert, block_m, gated, one input rotation for gate/up (broadcast [1, H] tables),
# x dtype, drop one route (id E: not an expert of this layer)
FUSED_CASES = [
    (1, 2, (3, 4), 8, True, False, torch.float16, False),
    (3, 1, (4, 3, 3), 16, True, True, torch.bfloat16, False),
    (17, 2, (3, 4, 4, 3), 8, True, False, torch.bfloat16, True),
    (3, 2, (4, 3), 8, False, False, torch.float16, False),
    (6, 3, (3, 4, 4), 64, True, False, torch.bfloat16, False),  # four 16-row blocks per pass share each tile
]


@pytest.mark.parametrize("t,k,bits,block_m,gated,shared,dtype,drop", FUSED_CASES)
def test_fused_passes_match_float64_loop(monkeypatch, t, k, bits, block_m, gated, shared, dtype, drop):
    """Pre-pass, gate+up launch, mid-pass, down launch, post-pass vs float64 per-expert matmuls: several T
    and top-k, mixed tiers, per-expert / shared broadcast input rotations, padding slots, an ungated
    silu(up), fp16/bf16 x, a dropped route; ``torch.empty`` buffers full of garbage."""
    experts = _experts(bits, gated=gated, shared_h=shared, seed=20 + t)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    assert fused_glue_supported(w)
    if shared:
        assert w.gate_suh is w.up_suh                           # equal tables are shared at bind time
        w = dataclasses.replace(w, up_suh=w.up_suh[:1], gate_suh=w.up_suh[:1])   # broadcast [1, H]
    x, ids, wts = _inputs(t, len(bits), k, seed=t)
    x = x.to(dtype)
    if drop:
        ids[t // 2, k - 1] = len(bits)
    _garbage_empty(monkeypatch)
    y = exl3_moe(x, ids, wts, w, block_m=block_m, nt=1, num_warps=8)
    assert y.shape == x.shape and y.dtype == dtype
    ref = _loop(x, ids, wts, experts)
    assert _rel(y, ref) < (2e-3 if dtype == torch.float16 else 5e-3)


@pytest.mark.parametrize("block_m,glue", [
    (16, GlueLaunch(frag=True, pre_rows=16, pre_warps=4, mid_rows=4, mid_warps=4, mid_splits=2)),   # A fragments
    (8, GlueLaunch(frag=False, post_splits=2, post_warps=0)),                                       # row-major x'
    (32, GlueLaunch(frag=False, wgmma=False)),           # row-major x', two 16-row blocks per decoded tile (mma)
])
def test_fused_pass_layouts_and_launch_shapes(monkeypatch, block_m, glue):
    """The layouts and launch shapes the defaults do not take (:func:`default_glue`: row-major x' with
    16-row blocks, fragment order with 8-row blocks) still compute the layer: x'/h' as 16-row A fragments
    with 16-row blocks, row-major with 8-row blocks; multi-row, multi-warp programs; garbage
    ``torch.empty`` buffers."""
    assert default_glue(8).frag and not default_glue(16).frag and default_glue(32).frag
    bits = (4, 3, 3)
    experts = _experts(bits, seed=7)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    x, ids, wts = _inputs(6, 3, 2, seed=5)
    _garbage_empty(monkeypatch)
    y = exl3_moe(x, ids, wts, w, block_m=block_m, nt=1, num_warps=8, glue=glue)
    assert _rel(y, _loop(x, ids, wts, experts)) < 2e-3


def test_padding_slots_skipped_bit_for_bit(monkeypatch):
    """``GlueLaunch.skip_padding`` (the default): the tiered launches count each route block's live routes and
    leave the padding slots out — x' loads, stores and, for 16-row blocks of padding only, the mma (compiled
    kernels). Two experts (K4, K3) take 18 routes each: 16-row block 0 of each 64-route block is live, block 1
    holds two routes and 14 padding slots, blocks 2 and 3 padding only. The layer is bit-identical to computing
    every slot, and matches the float64 loop; garbage buffers."""
    block_m = 64
    bits = (4, 3)
    experts = _experts(bits, seed=9)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    x, ids, wts = _inputs(18, len(bits), 2, seed=6)
    _garbage_empty(monkeypatch)
    # the mma launch (on Hopper, route blocks of 64 would go to the wgmma launch, which computes every slot)
    on = dataclasses.replace(default_glue(block_m), wgmma=False)
    off = dataclasses.replace(on, skip_padding=False)
    assert on.skip_padding
    y = exl3_moe(x, ids, wts, w, block_m=block_m, glue=on)
    assert torch.equal(y, exl3_moe(x, ids, wts, w, block_m=block_m, glue=off))
    assert _rel(y, _loop(x, ids, wts, experts)) < 2e-3


def test_decode_plan_adds_its_splits_into_one_buffer(monkeypatch):
    """Route blocks of 8 (the decode plan): both tiered launches add their K splits into one buffer, whose live
    rows the pre-pass (gate/up) and the mid-pass (down) zero in ``torch.empty`` memory full of NaN; the layer
    equals the per-split partials of ``EXL3RT_KERNEL_DETERMINISTIC=1`` (up to the add order and the fp16
    rounding of h' it can flip) and the float64 loop."""
    from exl3rt.kernels import moe as km
    monkeypatch.setattr(km, "MIN_SPLIT_K_TILES", 2)          # several K splits on 128-wide experts
    monkeypatch.setattr(km, "MIN_SPLIT_K_TILES_ATOMIC", 2)
    shapes = []
    real = km.tiered_partials

    def spy(*a, **kw):
        z = real(*a, **kw)
        shapes.append((kw.get("atomic"), tuple(z.shape)))
        return z
    monkeypatch.setattr(km, "tiered_partials", spy)
    bits = (3, 4, 3)
    experts = _experts(bits, seed=11)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    x, ids, wts = _inputs(3, len(bits), 2, seed=8)
    _garbage_empty(monkeypatch)
    y = exl3_moe(x, ids, wts, w, block_m=8, nt=1, num_warps=8, target_programs=4096)
    monkeypatch.setenv("EXL3RT_KERNEL_DETERMINISTIC", "1")
    y_det = exl3_moe(x, ids, wts, w, block_m=8, nt=1, num_warps=8, target_programs=4096)
    assert [a for a, _ in shapes] == [True, True, False, False]
    assert shapes[0][1][:2] == (2, 1) and shapes[1][1][:2] == (1, 1)          # gate+up, down: one buffer each
    assert shapes[2][1][1] > 1 and shapes[3][1][1] > 1                         # the partials: several splits
    # the modes add the splits in another order and h' is fp16: an element of it can round the other way
    # (H200: up to 3.3e-5 between the modes; a missed zeroing or a split added twice is NaN or O(1))
    assert _rel(y, y_det.double().cpu()) < 2e-4
    assert _rel(y, _loop(x, ids, wts, experts)) < 2e-3
    pack = pack_routes(ids, len(bits), 8)
    xs = torch.zeros(pack.capacity, 128, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="acc must be"):
        real(xs, w.up, pack.block_experts, pack.num_padded, w.descriptors, w.shift, 8, "mcg", atomic=True,
             acc=torch.zeros(1, 2, pack.capacity, 128, device=DEV))


def _force_pdl(monkeypatch):
    """Programmatic dependent launch as on an H200 (the kernels are recorders or built for sm_90: nothing runs)."""
    from exl3rt.kernels import moe as km
    monkeypatch.setattr(km, "use_pdl", lambda device: True)
    monkeypatch.setattr(km, "pdl_args", lambda device: {"PDL": True, "launch_pdl": True})


def test_decode_plan_is_a_dependent_launch_chain_up_to_four_rows(monkeypatch):
    """Route blocks of 8 (:func:`default_glue`: ``pdl_max_rows`` 4): where the device has programmatic dependent
    launch, calls of 1-4 rows make all six launches dependent launches (the ``PDL`` constexpr and the launch
    option), calls of 5-8 rows none; route blocks of 16 never. ``pdl_max_rows`` follows the row buckets."""
    from exl3rt.kernels import moe as km
    from exl3rt.kernels import moe_glue as mg
    assert default_glue(8).pdl_max_rows == 4 and default_glue(16).pdl_max_rows == 0
    with pytest.raises(ValueError, match="power of two"):
        GlueLaunch(pdl_max_rows=3)
    _force_pdl(monkeypatch)
    bits = (3, 4, 3)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), _experts(bits, seed=13))
    names = [(km, "_moe_mma_kernel"), (mg, "moe_pack_kernel"), (mg, "moe_pre_kernel"), (mg, "moe_mid_kernel"),
             (mg, "moe_post_kernel")]
    for block_m, rows in ((8, range(1, 9)), (16, (1, 2))):
        for t in rows:
            keys = set()
            record(monkeypatch, names, keys)
            exl3_moe(*_inputs(t, len(bits), 2, seed=t), w, block_m=block_m)
            pdl = {k[0]: (("PDL", "True") in k, ("launch_pdl", "True") in k) for k in keys}
            assert len(pdl) == 5, pdl
            want = block_m == 8 and t <= 4
            assert set(pdl.values()) == {(want, want)}, (block_m, t, pdl)


def _sm90_ops(module: str, name: str, args: dict, const: dict) -> list[str]:
    """The SASS opcodes (with operands) of ``module.name`` built for sm_90 in a fresh process (no GPU needed)."""
    from sass_check import build_sm90_triton
    sass = build_sm90_triton(module, name, args, const, num_warps=1)
    if sass is None:
        pytest.skip("this Triton ships no nvdisasm")
    return [ln.split("*/")[-1].split(";")[0].strip() for ln in sass.splitlines() if "/*" in ln and "*/" in ln]


def test_dependent_launch_builds_wait_where_the_chain_needs_it():
    """Built for sm_90 (no GPU needed): the tiered launch with ``PDL`` reads the packer's outputs from L2
    (``LDG.E.STRONG.GPU``), then its first trellis words, and only then waits for the pass that wrote x'
    (``ACQBULK``, once per tier's pass; no early trigger, ``PREEXIT``); without ``PDL`` neither instruction. The
    pre-pass triggers its dependent (``PREEXIT``) only after its own wait (so the tiered launch's early reads
    find the packer done); the post-pass triggers first."""
    from exl3rt.kernels import linear as kl
    cb, mult, add = kc.cb_args("mcg")
    args = {n: "i32" for n in ("numel", "rows", "k_tiles", "n_tiles", "k_per", "stride_x", "stride_zs", "one",
                               "n_blocks", "stride_xp", "stride_zp")}
    args.update({"x_ptr": "*fp16", "z_ptr": "*fp32", "blk_ptr": "*i32", "desc_ptr": "*i32", "npad_ptr": "*i32",
                 "routes_ptr": "*i32", **{f"{c}{i}": "*i32" for c in "wv" for i in range(4)}})
    for pdl in (False, True):
        const = dict(SHIFT=8, TIERS=kc.tier_spec([3, 4]), CB=cb, MULT=mult, ADD=add, NT=4, WARPS=1, BLOCK_M=8,
                     ASM=True, NPROJ=2, XFRAG=True, MB=1, REAL=True, HALVES=True, ATOMIC=True, PDL=pdl)
        ops = _sm90_ops("exl3rt.kernels.moe", "_moe_mma_kernel", args, const)
        waits = [i for i, o in enumerate(ops) if o.startswith("ACQBULK")]
        assert not any(o.startswith("PREEXIT") for o in ops)
        if not pdl:
            assert not waits and not next(o for o in ops if "LDG" in o).startswith("LDG.E.STRONG.GPU")
            continue
        assert len(waits) == 2                                   # one per tier's pass
        before = ops[:waits[0]]
        strong = [i for i, o in enumerate(before) if o.startswith("LDG.E.STRONG.GPU")]
        words = [i for i, o in enumerate(before) if o.startswith("LDG.E ")]
        assert len(strong) >= 2 and len(words) >= 8 and max(strong) < words[-8]
    glue = {"moe_pre_kernel": ({n: "*fp16" if n in ("x_ptr", "xs_ptr") else "*i32" if n.endswith("_ptr") else "i32"
                                 for n in ("x_ptr", "routes_ptr", "blk_ptr", "npad_ptr", "su_ptr", "sg_ptr", "xs_ptr",
                                           "pos_ptr", "slots", "numel", "k", "H", "stride_x", "su_se", "sg_se",
                                           "stride_xsp", "two", "zz_n", "zz_pstride")}
                                | {"su_ptr": "*fp32", "sg_ptr": "*fp32", "zz_ptr": "*fp32"},
                                dict(BR=4, BLOCK_M=8, FRAG=2, ZNP=0, PDL=True), ("ACQBULK", "PREEXIT")),
            "moe_post_kernel": ({n: "*fp32" if n in ("z_ptr", "w_ptr", "sv_ptr") else "*bf16" if n == "y_ptr" else
                                  "*i32" if n.endswith("_ptr") else "i32"
                                  for n in ("z_ptr", "routes_ptr", "pos_ptr", "blk_ptr", "w_ptr", "sv_ptr", "y_ptr",
                                            "numel", "k", "H", "splits", "stride_zs", "sv_se", "cap")},
                                 dict(KP=8, SB=1, BLOCK_M=8, PDL=True), ("PREEXIT", "ACQBULK"))}
    for name, (gargs, gconst, order) in glue.items():
        ops = _sm90_ops("exl3rt.kernels.moe_glue", name, gargs, gconst)
        first = [next(i for i, o in enumerate(ops) if o.startswith(op)) for op in order]
        assert first[0] < first[1], (name, order)
        assert min(i for i, o in enumerate(ops) if "LDG" in o) > first[order.index("ACQBULK")], name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (dependent launches)")
def test_dependent_launch_chain_computes_the_layer_on_a_gpu():
    """On a GPU (compiled kernels; a dependent launch chain where the device has it): 1-4 rows with
    :func:`default_glue` equal the same calls without dependent launches (add order only) and the float64
    loop, at real widths and several K splits."""
    bits = (3, 4, 3, 4)
    experts = _experts(bits, h=1024, i=512, seed=14)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    off = dataclasses.replace(default_glue(8), pdl_max_rows=0)
    for t in (1, 2, 3, 4):
        x, ids, wts = _inputs(t, len(bits), 2, h=1024, seed=20 + t)
        y = exl3_moe(x, ids, wts, w, block_m=8)
        # both add their K splits into one buffer in whatever order the programs run, and h' is fp16: an element
        # of it can round the other way (H200, 2026-12-02: 1.8-2.6e-5 with the 8-k-tile split floor; a missed
        # wait reads garbage or zeros, O(1))
        assert _rel(y, exl3_moe(x, ids, wts, w, block_m=8, glue=off).double().cpu()) < 2e-4
        assert _rel(y, _loop(x, ids, wts, experts)) < 2e-3


def test_fragment_order_needs_whole_row_blocks():
    tr = torch.zeros(1, 8, 8, words16_per_tile(3), dtype=torch.int16, device=DEV)
    pack = pack_routes(torch.zeros(1, 1, dtype=torch.int64, device=DEV), 1, 4)
    with pytest.raises(ValueError, match="route blocks of 8"):
        tiered_partials(torch.zeros(pack.capacity, 128, dtype=torch.float16, device=DEV), [tr], pack.block_experts,
                        pack.num_padded, torch.zeros(1, dtype=torch.int32, device=DEV), 8, 4, "mcg", xfrag=True)


def test_fused_equals_torch_glue_and_writes_out():
    """The fused passes and the torch glue (``fused=False``) agree to fp16 rounding of x'/h'; ``out`` is
    written in place; gate and up with their own input rotations (two x' rows per slot)."""
    bits = (3, 4, 3)
    experts = _experts(bits, seed=3)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    assert w.gate_suh is not w.up_suh
    x, ids, wts = _inputs(5, 3, 2, seed=4)
    out = torch.empty_like(x)
    y = exl3_moe(x, ids, wts, w, block_m=8, nt=1, num_warps=8, out=out)
    y0 = exl3_moe(x, ids, wts, w, block_m=8, nt=1, num_warps=8, fused=False)
    assert y is out
    assert _rel(y, y0.double().cpu()) < 1e-4


@pytest.mark.parametrize("t,k,e,block_m", [(1, 8, 256, 8), (3, 2, 5, 16), (17, 2, 4, 8), (40, 4, 7, 8), (5, 1, 3, 1)])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_one_launch_route_packing_equals_pack_routes(t, k, e, block_m, ids_dtype):
    """The fused path's packer (one Triton program) gives pack_routes' outputs bit for bit: stable order
    inside an expert, padding sentinels, block experts (-1 past the live blocks), counts; ids outside the
    map and experts mapped to -1 are dropped."""
    g = torch.Generator().manual_seed(t * 100 + e)
    ids = torch.randint(-1, e + 2, (t, k), generator=g).to(ids_dtype).to(DEV)
    emap = torch.randperm(e, generator=g).to(torch.int32)
    if e > 3:
        emap[2] = -1
    emap = emap.to(DEV)
    got, want = pack_routes_fused(ids, e, block_m, emap), pack_routes(ids, e, block_m, expert_map=emap)
    for f in ("sorted_routes", "block_experts", "num_padded", "expert_counts"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


def test_a_prefill_packs_in_one_launch_as_pack_routes_does(monkeypatch):
    """Past 1024 routes the packer sorts in its widest width: a 2048-token prefill at top-8 on a GPU.
    The interpreter takes ~90 s per 16k-key sort (so it packs past 1024 routes with torch); on the CPU the
    test makes the widest width 2048 and lets the interpreter take it (the same kernel code, another NP)."""
    import exl3rt.kernels.moe as km

    t, k, e, block_m = (2048, 8, 128, 128) if DEV != "cpu" else (200, 8, 128, 64)
    if DEV == "cpu":
        monkeypatch.setattr(km, "PACK_WIDTHS", ((64, 4), (1024, 4), (2048, 8)))
        monkeypatch.setattr(km, "PACK_INTERPRETED_MAX_ROUTES", 2048)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(-1, e + 1, (t, k), generator=g).to(torch.int32).to(DEV)
    emap = torch.randperm(e, generator=g).to(torch.int32)
    emap[5] = -1
    emap = emap.to(DEV)
    calls = []
    monkeypatch.setattr(km, "pack_routes", lambda *a, **kw: calls.append(1))     # the torch packer must not run
    got = pack_routes_fused(ids, e, block_m, emap)
    want = pack_routes(ids, e, block_m, expert_map=emap)      # this module's name: the real torch packer
    assert not calls
    for f in ("sorted_routes", "block_experts", "num_padded", "expert_counts"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


# ---- launch plans (kernels.moe.planned_moe) ---------------------------------------------------------------------

def test_planned_calls_replay_the_full_call(monkeypatch):
    """The first call at a call shape records its six launches; the next, with new tokens, routes and weights,
    replays them (new slot tensors put in) and gives the full call's output (bit for bit in the interpreter; on
    a GPU the decode plan's K splits are atomic adds in any order) and the float64 loop; scratch full of
    garbage is never read unwritten; a misaligned input runs in full; reset_plans makes the plan stale."""
    from exl3rt.kernels import linear as kl
    from exl3rt.kernels.moe import FUSED_LAUNCHES, planned_moe

    def same(a, b):
        return torch.equal(a, b) if DEV == "cpu" else _rel(a, b.double().cpu()) < 1e-5

    _garbage_empty(monkeypatch)
    bits = (3, 4, 3, 4)
    experts = _experts(bits, seed=21)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    calls = [_inputs(1, 4, 2, seed=s, ids_dtype=torch.int32) for s in range(2)]
    outs = [torch.empty_like(c[0]) for c in calls]     # the runtime's output rows
    got = [planned_moe(*c, w, block_m=8, out=o) for c, o in zip(calls, outs)]
    assert got[0] is outs[0] and got[1] is outs[1]
    (plan,) = w.plans.values()
    assert plan.replay is not None and len(plan.replay.steps) == FUSED_LAUNCHES
    assert same(got[1], exl3_moe(*calls[1], w, block_m=8))
    assert _rel(got[1], _loop(*calls[1], experts)) < 2e-3
    x, ids, wts = calls[1]
    odd = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view_as(x).copy_(x)   # 4-byte aligned
    assert same(planned_moe(odd, ids, wts, w, block_m=8, out=torch.empty_like(x)), got[1])
    kl.reset_plans()
    assert same(planned_moe(*calls[0], w, block_m=8, out=torch.empty_like(x)), got[0])
    (fresh,) = w.plans.values()
    assert fresh is not plan


def test_unplannable_moe_calls_run_in_full():
    """Other activations (the torch glue) and a non-contiguous weight table are never recorded."""
    from exl3rt.kernels.moe import planned_moe

    bits = (4, 3, 3)
    experts = _experts(bits, gated=False, shared_h=True, seed=7)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts, act=F.gelu)
    x, ids, wts = _inputs(2, 3, 1, seed=3, ids_dtype=torch.int32, skip=1)
    assert _rel(planned_moe(x, ids, wts, w, block_m=16), _loop(x, ids, wts, experts, act=F.gelu)) < 2e-3
    assert [p.replay for p in w.plans.values()] == [None]
    experts2 = _experts(bits, seed=8)
    w2 = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts2)
    w2.down_svh = torch.stack([w2.down_svh, w2.down_svh], -1)[..., 0]       # a strided view of the same values
    assert not w2.down_svh.is_contiguous()
    x, ids, wts = _inputs(1, 3, 2, seed=4)
    assert _rel(planned_moe(x, ids, wts, w2, block_m=8), _loop(x, ids, wts, experts2)) < 2e-3
    assert [p.replay for p in w2.plans.values()] == [None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("t,block_m", [(1, 8), (40, 32)])
def test_planned_moe_inside_a_cuda_graph(t, block_m):
    """A planned call captured in a CUDA graph (scratch from the graph's pool; on Hopper the 32-route blocks run
    the wgmma launch, whose tensor descriptor is remade over the captured scratch) gives the full call's output
    for the inputs copied in before the replay."""
    from exl3rt.kernels.moe import planned_moe

    bits = (3, 4, 3, 4)
    experts = _experts(bits, h=256, i=256, seed=31)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    calls = [_inputs(t, 4, 2, h=256, seed=s) for s in range(2)]
    for x, ids, wts in calls:
        planned_moe(x, ids, wts, w, block_m=block_m)               # records, then replays eagerly
    static = [c.clone() for c in calls[0]]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = planned_moe(*static, w, block_m=block_m)
    for s, c in zip(static, calls[1]):
        s.copy_(c)
    g.replay()
    torch.cuda.synchronize()
    want = exl3_moe(*calls[1], w, block_m=block_m)
    assert _rel(y, want.double().cpu()) < 1e-5
    assert _rel(y, _loop(*calls[1], experts)) < 2e-3
