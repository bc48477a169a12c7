"""The MoE tiered launch on Hopper's wgmma (``exl3rt.kernels.moe_wgmma``): host rules and an sm_90 build
everywhere, numbers on an H200.

Gluon has no interpreter: on CPU (CI) this file checks when the launch applies, its clear error elsewhere, and
builds the kernel for sm_90 with the installed Triton (two tiers gate+up in one grid, four tiers with a
half-integer K; SASS: 4 HGMMAs per chunk and tier, no shared-memory traffic besides TMA, no write to an
in-flight A register). On a GPU of compute capability 9.0 the partials equal the mma launch's and float64
products for route blocks of 64/128, mixed tiers, gate+up with one or two inputs, and the whole layer
(fused passes, row-major x') matches the float64 per-token loop.
"""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEV, require_kernels
from sass_check import build_sm90, inflight_a_writes

require_kernels()

from exl3rt.format.bits import words16_per_tile  # noqa: E402
from exl3rt.format.reconstruct import decode  # noqa: E402
from exl3rt.kernels import moe_wgmma as mw  # noqa: E402
from exl3rt.kernels import wgmma as wg  # noqa: E402
from exl3rt.kernels.moe import GlueLaunch, MoEWeights, exl3_moe, tiered_partials  # noqa: E402
from exl3rt.kernels.routing import pack_routes  # noqa: E402
from exl3rt.moe.tiers import tiers_from_bitrates  # noqa: E402

ON_HOPPER = wg.available(torch.device(DEV))
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA device of compute capability 9.0 (wgmma)")


def test_applies_only_to_wgmma_devices_and_prefill_blocks():
    assert tuple(mw.SETTINGS) == (32, 64, 128) and mw.SETTINGS[32] == (2, True)       # blocks of 32: paired chunks
    assert all(stages >= 2 for stages, pair in mw.SETTINGS.values() if pair)
    assert not mw.applies(torch.device("cpu"), 64)
    if ON_HOPPER:
        assert [mw.applies(torch.device(DEV), b) for b in (8, 16, 32, 64, 128, 256)] == [False, False, True, True,
                                                                                          True, False]


@pytest.mark.skipif(ON_HOPPER, reason="checks the error off Hopper")
def test_off_hopper_it_says_why():
    xs = torch.zeros(64, 128, dtype=torch.float16)
    tr = [torch.zeros(1, 8, 8, words16_per_tile(4), dtype=torch.int16)]
    blk = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        mw.tiered_partials_wgmma(xs, tr, blk, blk, blk, 8, 64, "mcg")


def _build_sm90(tier_bits, block, nproj):
    """The SASS of the kernel ``tiered_partials_wgmma`` launches for these tiers (MCG), built for sm_90."""
    args = {"z_ptr": "*fp32", "blk_ptr": "*i32", "desc_ptr": "*i32", "npad_ptr": "*i32"}
    args.update({n: "*i32" for n in ("w0", "w1", "w2", "w3", "v0", "v1", "v2", "v3")})
    args.update({n: "i32" for n in ("slots", "k_tiles", "n_tiles", "k_per", "stride_zs", "stride_zp", "xrow_p",
                                    "one", "n_groups")})
    return build_sm90(mw._moe_wgmma_kernel, block, args,
                      dict(SHIFT=8, **mw.kernel_constants(tier_bits, "mcg", block, nproj)))


@pytest.mark.skipif(not wg.HAVE_GLUON, reason="Triton without Gluon")
@pytest.mark.parametrize("tier_bits,block,nproj", [((3, 4), 64, 2), ((2, 3, 4, 2.5), 128, 1), ((4,), 64, 1),
                                                   ((3, 4), 32, 2)])
def test_kernel_builds_for_sm90_without_a_gpu(tier_bits, block, nproj):
    """The kernel compiles for sm_90 with this machine's Triton; one decode-and-wgmma loop per tier (4 HGMMAs
    of N = the route block per chunk; the paired loop of blocks of 32 has three chunk sites: even, odd, a last odd
    chunk), the decoded registers used in place (no shared-memory traffic besides TMA) and never rewritten under
    a wgmma in flight."""
    sass = _build_sm90(tier_bits, block, nproj)
    if sass is None:
        pytest.skip("no nvdisasm next to Triton's ptxas")
    sites = 3 if mw.SETTINGS[block][1] else 1
    assert sass.count("HGMMA.64x%dx16" % block) == 4 * sites * len(tier_bits)
    for op in ("STS", "LDS", "STSM", "LDSM"):
        assert f" {op}" not in sass and f"{op}." not in sass, op
    assert inflight_a_writes(sass) == []


def _stacks(layout, k_tiles, n_tiles, g):
    return [torch.randint(-32768, 32768, (t.count, k_tiles, n_tiles, words16_per_tile(t.bits)), dtype=torch.int16,
                          generator=g).to(DEV) for t in layout.tiers]


@hopper
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("two_inputs", [False, True])
def test_partials_match_the_mma_launch_and_float64(block, two_inputs):
    """Gate+up (two projections, one grid) over three tiers (K3, K4, K2): the partials of every live slot equal
    the mma launch's and the float64 product with Q from ``format.decode``."""
    g = torch.Generator().manual_seed(block + two_inputs)
    layout = tiers_from_bitrates([3, 4, 3, 2, 4, 3, 2])
    e = layout.num_experts
    h, i = 256, 192
    gate = _stacks(layout, h // 16, i // 16, g)
    up = _stacks(layout, h // 16, i // 16, g)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(70)]).to(DEV)
    pack = pack_routes(ids, e, block, expert_map=layout.global_to_combined_tensor(DEV))
    slots = pack.capacity
    xs = torch.randn((2 if two_inputs else 1, slots, h), generator=g).half().to(DEV)
    desc = layout.descriptor_tensor(DEV).to(torch.int32)
    common = (pack.block_experts, pack.num_padded, desc, layout.descriptor_shift, block, "mcg")
    xin = xs if two_inputs else xs[0]
    z = mw.tiered_partials_wgmma(xin, gate, *common, second=up).sum(1)
    z_mma = tiered_partials(xin, gate, *common, second=up).sum(1)
    live = (pack.sorted_routes < ids.numel()).nonzero().flatten()
    assert live.numel() == ids.numel()
    blk = pack.block_experts.long()
    for p, stacks in enumerate((gate, up)):
        got, want = z[p][live].double(), z_mma[p][live].double()
        assert float((got - want).norm() / want.norm()) < 1e-5
        for n, slot in list(enumerate(live.tolist()))[::7]:
            tier, local = divmod(int(desc[int(blk[slot // block])]), 1 << layout.descriptor_shift)
            q = decode(stacks[tier][local], layout.tiers[tier].bits, "mcg").double()
            ref = xs[p if two_inputs else 0, slot].double() @ q
            assert float((got[n] - ref).norm() / ref.norm()) < 1e-5


@hopper
@pytest.mark.parametrize("block", [32, 64, 128])
def test_layer_with_the_wgmma_launch_matches_the_mma_launch(block):
    """``exl3_moe`` at prefill route blocks (fused passes, row-major x'/h' for the wgmma launch) equals the same
    layer on the mma launch (``GlueLaunch(wgmma=False)``) to fp32-sum order."""
    g = torch.Generator().manual_seed(block)
    bits = [3] * 5 + [4] * 3
    layout = tiers_from_bitrates(bits)
    h, i = 256, 256

    def stack(a, b):
        return [torch.randint(-32768, 32768, (t.count, a // 16, b // 16, words16_per_tile(t.bits)),
                              dtype=torch.int16, generator=g).to(DEV) for t in layout.tiers]

    def scales(n):
        return ((torch.rand(len(bits), n, generator=g) + 0.5) * 0.1).to(DEV)

    w = MoEWeights(up=stack(h, i), gate=stack(h, i), down=stack(i, h), up_suh=scales(h), up_svh=scales(i),
                   gate_suh=scales(h), gate_svh=scales(i), down_suh=scales(i), down_svh=scales(h),
                   descriptors=layout.descriptor_tensor(DEV).to(torch.int32), shift=layout.descriptor_shift,
                   expert_map=layout.global_to_combined_tensor(DEV), codebook="mcg")
    x = torch.randn(96, h, generator=g).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(len(bits), generator=g)[:3] for _ in range(96)]).to(DEV)
    wts = torch.rand(96, 3, generator=g).to(DEV)
    y = exl3_moe(x, ids, wts, w, block_m=block)
    y_mma = exl3_moe(x, ids, wts, w, block_m=block, glue=GlueLaunch(wgmma=False, frag=True))
    assert float((y.double() - y_mma.double()).norm() / y_mma.double().norm()) < 3e-3   # bf16 outputs


def test_fused_path_sends_blocks_of_64_to_the_wgmma_launch(monkeypatch):
    """The glue's side of the launch, on any machine: where the wgmma launch applies (faked here), route blocks
    of 64 (and 32) send gate+up (one grid, two projections) and down to it with row-major x'/h' — a stand-in
    running the mma launch on those row-major inputs gives the float64 layer — while blocks of 16 and
    ``GlueLaunch(wgmma=False)`` keep the mma launch."""
    import dataclasses

    from test_moe_kernel import _experts, _inputs, _loop, _rel

    from exl3rt.kernels.moe import default_glue
    calls = []

    def stand_in(xs, tiers, *common, second=None, alloc=None):
        calls.append((tuple(xs.shape), second is not None))
        return tiered_partials(xs, tiers, *common, second=second, zero=False, nt=1, num_warps=8, alloc=alloc)

    monkeypatch.setattr(mw, "applies", lambda device, block_m: block_m in mw.SETTINGS)
    monkeypatch.setattr(mw, "tiered_partials_wgmma", stand_in)
    bits = (4, 3, 3)
    experts = _experts(bits, seed=11)
    w = MoEWeights.from_experts(tiers_from_bitrates(list(bits)), experts)
    x, ids, wts = _inputs(5, len(bits), 2, seed=4)
    y = exl3_moe(x, ids, wts, w, block_m=64, nt=1, num_warps=8)
    assert [c[1] for c in calls] == [True, False]               # gate+up in one grid, then down
    assert _rel(y, _loop(x, ids, wts, experts)) < 2e-3
    calls.clear()
    assert _rel(exl3_moe(x, ids, wts, w, block_m=32, nt=1, num_warps=8), _loop(x, ids, wts, experts)) < 2e-3
    assert [c[1] for c in calls] == [True, False]
    calls.clear()
    exl3_moe(x, ids, wts, w, block_m=16, nt=1, num_warps=8)
    exl3_moe(x, ids, wts, w, block_m=64, nt=1, num_warps=8, glue=dataclasses.replace(default_glue(64), wgmma=False))
    assert calls == []
