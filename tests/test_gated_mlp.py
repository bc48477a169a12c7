"""A gated MLP ``down(silu(gate(x)) · up(x))`` in one call (``exl3rt.kernels.linear.exl3_gated_mlp``): gate/up as
one fused layer, then one pass for gate/up's output rotation, the activation and down's input rotation, then down.
Checked against float64 products of the three layers with the activation rounded where torch rounds it, and
against the same layers run apart through the kernels; planned calls replay to the full call. Runs in Triton's
interpreter here, compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEV, garbage_empty, random_codes as _codes, require_kernels

require_kernels()

from exl3rt.format.reconstruct import reconstruct  # noqa: E402
from exl3rt.kernels import linear as kl  # noqa: E402
from exl3rt.kernels import ops  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_plans():
    kl.reset_plans()
    yield
    kl.reset_plans()


def _mlp(in_p, n, out_p, gu_bits, d_bits, seed):
    gate, up = _codes(in_p, n, gu_bits, seed=seed), _codes(in_p, n, gu_bits, seed=seed + 1)
    down = _codes(n, out_p, d_bits, seed=seed + 2)
    gu = (torch.cat([gate[0], up[0]], dim=1).contiguous(), torch.stack([gate[1], up[1]]).contiguous(),
          torch.cat([gate[2], up[2]]).contiguous())
    return gate, up, down, gu


def _w(layer, codebook):
    return reconstruct(*(t.cpu() for t in layer), codebook, dtype=torch.float64)


def _reference(x, gate, up, down, cbs, inter, dt):
    """float64 products; g, u, silu(g) and h rounded to ``dt`` as torch rounds them between the layers."""
    x = x.double().cpu()
    g = (x @ _w(gate, cbs[0]))[:, :inter].to(dt)
    u = (x @ _w(up, cbs[0]))[:, :inter].to(dt)
    h = (torch.nn.functional.silu(g.float()).to(dt) * u).to(dt)
    return h.double() @ _w(down, cbs[1])[:inter]


def _apart(x, gu, down, cbs, n, inter):
    """The same layers through the kernels, one after the other, the activation by torch."""
    y = kl._linear(x, *gu, cbs[0], bounds=(n,))
    h = torch.nn.functional.silu(y[:, :inter]) * y[:, n:n + inter]
    h = torch.nn.functional.pad(h, (0, n - inter)).contiguous()
    return kl._linear(h, *down, cbs[1])


def _rel(y, ref):
    y = y.double().cpu()
    assert torch.isfinite(y).all()
    return float((y - ref.double().cpu()).norm() / ref.double().cpu().norm())


@pytest.mark.parametrize("cbs,bits,rows,dtype,inter", [
    (("mcg", "mcg"), (4, 4), 1, torch.bfloat16, 256),
    (("3inst", "mul1"), (3, 2.5), 5, torch.float16, 200),
    (("mcg", "mcg"), (2, 6), 11, torch.float32, 200),
    (("mcg", "3inst"), (4, 4), 20, torch.bfloat16, 256),
    (("mcg", "mcg"), (4, 3), 70, torch.float16, 200),     # past the mma GEMV's rows: the layers apart
])
def test_gated_mlp_is_the_three_layers_with_the_activation_between(cbs, bits, rows, dtype, inter, monkeypatch):
    garbage_empty(monkeypatch)          # no pass may read scratch that no kernel wrote
    in_p, n, out_p = 128, 256, 128
    gate, up, down, gu = _mlp(in_p, n, out_p, *bits, seed=rows)
    x = torch.randn(rows, in_p, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEV)
    fused = kl.gated_mlp_fused(rows, bits[0], bits[1], x.device)
    if DEV == "cpu":            # (on Hopper the wgmma kernel takes 17+ rows, and 9+ at K 3 and 6: apart)
        assert fused == (rows <= 64)
    y = kl._gated_mlp(x, *gu, *down, *cbs, inter, taken=(taken := []))
    assert taken == ["mma" if fused else "apart"] and y.shape == (rows, out_p) and y.dtype == dtype
    ref = _reference(x, gate, up, down, cbs, inter, dtype)
    assert _rel(y, ref) < (2e-3 if dtype == torch.float32 else 2e-2)     # (x' is fp16 in the kernels)
    apart = _apart(x, gu, down, cbs, n, inter)
    # (Triton's interpreter rounds fp32 to bf16 toward zero in conversions, torch to nearest: looser there)
    loose = dtype == torch.bfloat16 and DEV == "cpu"
    assert _rel(y, apart) < (1e-5 if dtype == torch.float32 else 2e-2 if loose else 5e-3)


def test_split_partials_and_planned_replays(monkeypatch):
    """With the K splits stored apart (``EXL3RT_KERNEL_DETERMINISTIC``) the middle pass sums them; a planned call
    records five launches once and replays them with each new input to the full call's output."""
    monkeypatch.setenv("EXL3RT_KERNEL_DETERMINISTIC", "1")
    garbage_empty(monkeypatch)
    cbs, inter = ("mcg", "mcg"), 128
    gate, up, down, gu = _mlp(256, 128, 128, 4, 4, seed=9)
    gen = torch.Generator().manual_seed(3)
    xs = [(0.1 * torch.randn(3, 256, generator=gen)).half().to(DEV) for _ in range(2)]
    ys = [kl.exl3_gated_mlp(x, *gu, *down, *cbs, inter) for x in xs]
    (plan,) = kl._PLANS.values()
    assert plan.replay is not None and len(plan.replay.steps) == 5
    for x, y in zip(xs, ys):
        assert _rel(y, kl._gated_mlp(x, *gu, *down, *cbs, inter)) < 1e-6
        assert _rel(y, _reference(x, gate, up, down, cbs, inter, torch.float16)) < 2e-2


def test_rows_past_the_mma_gemv_run_apart_through_their_plans():
    cbs = ("mcg", "mcg")
    _, _, down, gu = _mlp(128, 128, 128, 4, 4, seed=2)
    x = torch.randn(70, 128, generator=torch.Generator().manual_seed(1)).half().to(DEV)
    y1 = kl.exl3_gated_mlp(x, *gu, *down, *cbs, 128)
    y2 = kl.exl3_gated_mlp(x, *gu, *down, *cbs, 128)
    plans = list(kl._PLANS.values())
    assert [p.replay for p in plans if p.y_shape == (70, 128)][:1] == [None]
    assert _rel(y2, y1) < 1e-6


def test_shapes_are_checked():
    _, _, down, gu = _mlp(128, 128, 128, 4, 4, seed=1)
    x = torch.randn(1, 128).half().to(DEV)
    with pytest.raises(Exception, match="takes 128 inputs"):
        kl._gated_mlp(x, *gu, *down, "mcg", "mcg", 200)
    _, _, down2, _ = _mlp(128, 256, 128, 4, 4, seed=1)
    with pytest.raises(Exception, match="takes 256 inputs"):
        kl._gated_mlp(x, *gu, *down2, "mcg", "mcg", 128)
    with pytest.raises(ValueError, match="expected"):
        kl._gated_mlp(torch.randn(1, 64).half().to(DEV), *gu, *down, "mcg", "mcg", 128)


def test_the_op_passes_opcheck_and_takes_any_leading_shape():
    """``torch.ops.exl3rt.gated_mlp`` (fake impl, schema; here the CPU reference) with an unpadded input width and
    intermediate width, leading dimensions kept."""
    from exl3rt.format.random import random_linear
    gate, up, down = random_linear(100, 200, 4, seed=1), random_linear(100, 200, 4, seed=2), \
        random_linear(200, 72, 3, seed=3)
    x = torch.randn(2, 3, 100, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    args = (x, torch.cat([gate.trellis, up.trellis], dim=1), torch.stack([gate.suh, up.suh]),
            torch.cat([gate.svh, up.svh]), down.trellis, down.suh, down.svh, "mcg", down.codebook, 200, 72)
    torch.library.opcheck(torch.ops.exl3rt.gated_mlp.default, args)
    y = ops.call_gated_mlp(*args)
    assert y.shape == (2, 3, 72) and y.dtype == torch.bfloat16
    xd = x.double()
    g = (xd @ gate.reconstruct(dtype=torch.float64)[:100, :200]).to(torch.bfloat16)
    u = (xd @ up.reconstruct(dtype=torch.float64)[:100, :200]).to(torch.bfloat16)
    h = (torch.nn.functional.silu(g.float()).to(torch.bfloat16) * u).double()
    ref = h @ down.reconstruct(dtype=torch.float64)[:200, :72]
    assert _rel(y, ref) < 2e-2
