"""Planned EXL3 linears (``exl3rt.kernels.linear.planned_linear``, ``exl3rt.kernels.launch``): a layer's launches
are recorded on its first call at a row count and replayed on the next ones with the new input, output and
scratch buffers put in. Here (Triton's interpreter) a replay calls each kernel again with the substituted
tensors, so the bookkeeping — which argument is the input, the output, which scratch buffer — is checked against
the full call and float64; the direct launcher path is checked with a stand-in kernel (every parameter, in
order, with the tensors replaced by their addresses). On a GPU the compiled replays are compared bit for bit
with the full call, eager and inside a captured CUDA graph.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kernel_env import DEV, garbage_empty, random_codes as _codes, require_kernels

require_kernels()

from exl3rt.format.reconstruct import reconstruct  # noqa: E402
from exl3rt.kernels import launch as kla  # noqa: E402
from exl3rt.kernels import linear as kl  # noqa: E402


interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreted replays (on a GPU: "
                                     "test_compiled_replays_equal_the_full_call_on_a_gpu)")


@pytest.fixture(autouse=True)
def _fresh_plans():
    kl.reset_plans()
    yield
    kl.reset_plans()


def _ref(x: torch.Tensor, tr, suh, svh, codebook: str) -> torch.Tensor:
    return x.double().cpu() @ reconstruct(tr.cpu(), suh.cpu(), svh.cpu(), codebook, dtype=torch.float64)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.double().cpu()
    assert torch.isfinite(y).all()
    return float((y - ref).norm() / ref.norm())


@interpreter_only
@pytest.mark.parametrize("codebook,bits,rows", [("mcg", 4, 1), ("mul1", 3, 12)])
def test_a_replayed_call_equals_the_full_call(codebook, bits, rows, monkeypatch):
    """First call records, the next ones replay: each replay with a new input gives the full call's output
    bit for bit (same launches, same arguments) and float64 x·W; scratch memory full of NaN is never read
    unwritten (the pre-pass zeroes the accumulation buffer on every replay)."""
    garbage_empty(monkeypatch)
    tr, suh, svh = _codes(128, 128, bits, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    xs = [torch.randn(rows, 128, generator=gen).half().to(DEV) for _ in range(2)]
    ys = [kl.exl3_linear(x, tr, suh, svh, codebook) for x in xs]
    assert len(kl._PLANS) == 1
    plan = next(iter(kl._PLANS.values()))
    assert plan.replay is not None and len(plan.replay.steps) == 3 and not plan.replay.direct
    for x, y in zip(xs, ys):
        full = kl._linear(x, tr, suh, svh, codebook)
        assert torch.equal(y, full)
        assert _rel(y, _ref(x, tr, suh, svh, codebook)) < 2e-3


@interpreter_only
def test_a_fused_layers_call_is_planned_and_replayed_like_one_layer(monkeypatch):
    """Three layers of one input fused (``bounds``): recorded once, then replayed with the fused pre-pass (its
    segments' x' in one buffer) — each replay equals the full call and every segment its own layer's x·W."""
    garbage_empty(monkeypatch)
    layers = [_codes(128, 128, 4, seed=s) for s in range(3)]
    tr = torch.cat([t for t, _, _ in layers], dim=1).contiguous()
    suh = torch.stack([s for _, s, _ in layers]).contiguous()
    svh = torch.cat([v for _, _, v in layers]).contiguous()
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(1, 128, generator=gen).half().to(DEV) for _ in range(2)]
    ys = [kl.exl3_linear(x, tr, suh, svh, "mcg", bounds=(128, 256)) for x in xs]
    assert len(kl._PLANS) == 1
    plan = next(iter(kl._PLANS.values()))
    assert plan.replay is not None and len(plan.replay.steps) == 3
    for x, y in zip(xs, ys):
        assert torch.equal(y, kl._linear(x, tr, suh, svh, "mcg", bounds=(128, 256)))
        for g, (t, s, v) in enumerate(layers):
            assert _rel(y[:, 128 * g:128 * (g + 1)], _ref(x, t, s, v, "mcg")) < 2e-3


@interpreter_only
def test_plans_are_per_layer_and_row_count():
    """Two layers of one shape, and one layer at two row counts, get separate plans and their own results;
    ``reset_plans`` forgets them."""
    a = _codes(128, 128, 4, seed=1)
    b = _codes(128, 128, 4, seed=2)
    x1 = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)).half().to(DEV)
    x3 = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).half().to(DEV)
    for _ in range(2):
        for layer, x in ((a, x1), (b, x1), (a, x3)):
            assert _rel(kl.exl3_linear(x, *layer, "mcg"), _ref(x, *layer, "mcg")) < 2e-3
    assert len(kl._PLANS) == 3
    kl.reset_plans()
    assert not kl._PLANS


def test_a_plan_holds_none_of_the_recorded_calls_tensors():
    """A plan keeps addresses, never the recorded call's input, output or scratch tensors: a plan made while
    torch.compile's cudagraph trees warm up (on their memory pool) must leave nothing alive there, or their
    check that every live tensor of the pool is an output fails. Weak references to the tensors of the
    recording die with the call's own references."""
    import gc
    import weakref

    tr, suh, svh = _codes(128, 128, 4, seed=8)
    made = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        made.append(weakref.ref(t))
        return t
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(9)).half().to(DEV)
    refs = [weakref.ref(x)]
    try:
        torch.empty = empty
        y = kl.exl3_linear(x, tr, suh, svh, "mcg")
    finally:
        torch.empty = real_empty
    (plan,) = kl._PLANS.values()
    assert plan.replay is not None and made
    refs += [weakref.ref(y)] + made
    del x, y
    gc.collect()
    assert all(r() is None for r in refs)


@interpreter_only
def test_unplanned_calls_still_compute_the_product():
    """A misaligned input (not on a 16-byte boundary) and a path that is not planned (decode + cuBLAS, 65+ rows
    without the wgmma kernel) run in full every call, with the same result."""
    tr, suh, svh = _codes(128, 128, 3, seed=5)
    flat = torch.randn(2 * 128 + 1, generator=torch.Generator().manual_seed(6)).half().to(DEV)
    x = flat[1:].view(2, 128)
    assert x.data_ptr() % 16
    for _ in range(2):
        assert _rel(kl.exl3_linear(x, tr, suh, svh, "mcg"), _ref(x, tr, suh, svh, "mcg")) < 2e-3
    assert not kl._PLANS
    big = torch.randn(70, 128, generator=torch.Generator().manual_seed(7)).half().to(DEV)
    for _ in range(2):
        assert _rel(kl.exl3_linear(big, tr, suh, svh, "mcg"), _ref(big, tr, suh, svh, "mcg")) < 2e-3
    (plan,) = kl._PLANS.values()
    assert plan.replay is None


def test_options_bypass_the_plans():
    """An explicit path or configuration is a one-off call: no plan is made."""
    tr, suh, svh = _codes(128, 128, 4, seed=8)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(9)).half().to(DEV)
    y = kl.exl3_linear(x, tr, suh, svh, "mcg", path="mma")
    assert not kl._PLANS and _rel(y, _ref(x, tr, suh, svh, "mcg")) < 2e-3


# ---- the direct launcher path, with a stand-in kernel -----------------------------------------------------

class _Param:
    def __init__(self, p: inspect.Parameter):
        self.name = p.name
        self.default = p.default
        self.has_default = p.default is not inspect.Parameter.empty


class _Compiled:
    def __init__(self, log):
        self.function, self.packed_metadata, self.log = "fn-handle", "meta", log

    def run(self, *args):
        self.log.append(args)


class _FakeJit:
    """A stand-in for a ``triton.jit`` function: ``fn[grid](...)`` notes the call and returns a compiled kernel
    whose launcher notes its arguments."""

    def __init__(self):
        def kernel(x_ptr, y_ptr, w_ptr, rows, n, BLOCK, FLAG=False, extra_ptr=None, count=0):
            pass
        self.params = [_Param(p) for p in inspect.signature(kernel).parameters.values()]
        self.launches: list = []
        self.jit_calls: list = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return _Compiled(self.launches)
        return call


def test_direct_replay_passes_every_parameter_in_order_with_slots_as_addresses():
    """Direct replays call the compiled launcher with (grid, stream, function, metadata, no hooks) and every
    parameter in signature order — defaults filled in, constexprs included, fixed tensors as their recorded
    addresses, slot tensors (or views at their start) as the new tensors' addresses."""
    fn = _FakeJit()
    x, y, ws = torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(64)
    w = torch.ones(16)
    with kla.Recording() as rec:
        kla.launch(fn, (3, 2), x, y[:2], w, 4, 8, BLOCK=16, count=7, num_warps=1)
        kla.launch(fn, (5,), ws, y, w, 4, 8, 32, FLAG=True, extra_ptr=ws[:10])
    assert len(fn.jit_calls) == 2 and not fn.launches
    replay = kla.Replay(rec, [x, y, ws], direct=True)
    x2, y2, ws2 = torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(64)
    replay(1234, (x2, y2, ws2))
    assert fn.launches == [
        (3, 2, 1, 1234, "fn-handle", "meta", None, None, None,
         x2.data_ptr(), y2.data_ptr(), w.data_ptr(), 4, 8, 16, False, None, 7),
        (5, 1, 1, 1234, "fn-handle", "meta", None, None, None,
         ws2.data_ptr(), y2.data_ptr(), w.data_ptr(), 4, 8, 32, True, ws2.data_ptr(), 0),
    ]
    assert len(fn.jit_calls) == 2          # no JIT call on replay


def test_an_argument_inside_a_slot_cannot_be_replayed():
    """A view that starts inside a slot tensor (not at its start) would be replayed at its recorded address while
    the slot moves: making the replay refuses it, and the planners then run that call in full."""
    fn = _FakeJit()
    x, y, w = torch.zeros(4, 8), torch.zeros(4, 8), torch.ones(16)
    with kla.Recording() as rec:
        kla.launch(fn, (1,), x, y[1:], w, 4, 8, 16)
    with pytest.raises(ValueError, match="inside a slot"):
        kla.Replay(rec, [x, y], direct=True)
    kla.Replay(rec, [x, y[1:]], direct=True)       # as a slot of its own it is fine


def test_recordings_do_not_nest_and_launch_outside_one_records_nothing():
    fn = _FakeJit()
    kla.launch(fn, (1,), torch.zeros(1), torch.zeros(1), torch.zeros(1), 1, 1, 1)
    with kla.Recording() as rec:
        with pytest.raises(RuntimeError, match="nest"):
            with kla.Recording():
                pass
    assert rec.calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled replays need a CUDA device")
@pytest.mark.parametrize("rows", [1, 4, 8, 12, 16, 24, 64, 100, 300])
def test_compiled_replays_equal_the_full_call_on_a_gpu(rows):
    """Direct replays (the compiled launchers, scratch from the workspace or, while a graph is captured, from
    its pool) give the full call's output: bit for bit where the K splits are stored and summed in order (the
    mma GEMV at 9-64 rows), within fp32 rounding where they are atomic adds in any order (1-8 rows, and the
    wgmma kernel's splits)."""
    tr, suh, svh = _codes(4096, 2048, 4, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    xs = [torch.randn(rows, 4096, generator=gen).half().cuda() for _ in range(3)]
    ys = [kl.exl3_linear(x, tr, suh, svh, "mcg") for x in xs]
    (plan,) = kl._PLANS.values()
    assert (plan.replay is not None) == (kl.choose_path(rows, wgmma=kl._wg.available(xs[0].device)) in kl.PLANNED_PATHS)
    if plan.replay is not None:
        assert plan.replay.direct
    static = xs[0].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = kl.exl3_linear(static, tr, suh, svh, "mcg")
    static.copy_(xs[1])
    g.replay()
    torch.cuda.synchronize()
    path = kl.choose_path(rows, wgmma=kl._wg.available(xs[0].device))
    ordered = path == "mma" and rows > 8
    for x, y in list(zip(xs, ys)) + [(xs[1], yg)]:
        full = kl._linear(x, tr, suh, svh, "mcg")
        if ordered:
            assert torch.equal(y, full)
        else:
            assert float((y.double() - full.double()).norm() / full.double().norm()) < 1e-3
        assert _rel(y, _ref(x, tr, suh, svh, "mcg")) < 2e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_reduce_overhead_compile_keeps_no_buffer_in_the_graph_pool():
    """torch.compile's cudagraph trees warm a function up eagerly on their memory pool and then check that every
    live tensor of the pool is an output: planned calls must keep nothing from there (workspaces are made by
    prewarm only, recorded descriptors keep no base, plans keep no tensor). Two layers, rows 1 and 20 (mma and,
    on Hopper, wgmma), compiled with ``mode="reduce-overhead"`` and called before any eager call (so the plans
    are made during the graphs' warm-up), give the eager outputs."""
    from exl3rt.runtime.linear import Exl3Linear
    torch._dynamo.reset()
    layers = []
    for seed in (1, 2):
        m = Exl3Linear(1024, 1024, 4, "mcg", device="cuda", dtype=torch.bfloat16)
        m.trellis.copy_(_codes(1024, 1024, 4, seed=seed)[0])
        layers.append(m)
    seq = torch.nn.Sequential(*layers)
    for m in layers:
        m.prepare(torch.bfloat16)
    compiled = torch.compile(seq, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for rows in (1, 20):
            x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):          # no eager call first: the plans are made during the graphs' warm-up
                got = compiled(x).clone()
            torch.testing.assert_close(got, seq(x), rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()
