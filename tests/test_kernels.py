"""Triton EXL3 linear kernels (``exl3rt.kernels``) against ``format.reconstruct`` / ``format.decode``.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest
before triton is imported): tiny shapes and small launch blocks keep this file near 30 s on 2
cores. On a GPU the same tests run the compiled kernels (with the inline-PTX decode).
On the H200 the real-shape checks are in ``benchmarks/bench_linear.py`` (correctness per shape).
"""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEV, garbage_empty, random_codes as _codes, require_kernels
from spec_keys import record

require_kernels()

from exl3rt.format.reconstruct import decode, reconstruct  # noqa: E402
from exl3rt.kernels import common as kc  # noqa: E402
from exl3rt.kernels import linear as kl  # noqa: E402

# small launch blocks: one or two programs per call in the interpreter
DEC = kl.DecodeConfig(nt=8, num_warps=1, k_per=2)
MMA = kl.MmaConfig(nt=2, num_warps=2, target_programs=2)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.double().cpu()
    assert torch.isfinite(y).all()
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("codebook,bits", [("mcg", k) for k in (1, 2, 3, 4, 5, 6, 7, 8)]
                         + [("3inst", 3), ("3inst", 8), ("mul1", 2), ("mul1", 5)]
                         + [("mul1", 1.5), ("mul1", 2.5), ("mul1", 3.5)])
def test_decode_fp16_bit_exact(codebook, bits):
    tr, _, _ = _codes(32, 128, bits, seed=int(bits * 10))
    q = kl.decode_fp16(tr, codebook, DEC)
    assert torch.equal(q.cpu(), decode(tr.cpu(), bits, codebook))


def test_half_precision_io():
    tr, suh, svh = _codes(128, 128, 4, seed=5)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9))
    ref = x.half().double() @ reconstruct(tr.cpu(), suh.cpu(), svh.cpu(), "mcg", dtype=torch.float64)
    for dt in (torch.float16, torch.bfloat16):
        for path in ("mma", "decode_mm"):
            y = kl.exl3_linear(x.half().to(dt).to(DEV), tr, suh, svh, "mcg", mma_cfg=MMA,
                               decode_cfg=DEC, path=path)
            assert y.dtype == dt
            assert _rel(y, ref) < (2e-3 if dt == torch.float16 else 1e-2), path


def test_gemm_path_decode_then_matmul():
    tr, suh, svh = _codes(128, 256, 4, seed=21)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    ref = x.double() @ reconstruct(tr.cpu(), suh.cpu(), svh.cpu(), "mcg", dtype=torch.float64)
    y = kl.exl3_linear(x.to(DEV), tr, suh, svh, "mcg", path="decode_mm", decode_cfg=DEC)
    assert _rel(y, ref) < 2e-3  # x' rounded to fp16 for the fp16 matmul


@pytest.mark.parametrize("codebook,bits,shape,rows,cfg", [
    ("mcg", 4, (256, 256), 1, (2, 1, 4)),
    ("mcg", 2, (128, 256), 5, (1, 2, 8)),
    ("mcg", 3, (128, 128), 16, (2, 2, 2)),
    ("mcg", 5, (128, 128), 3, (1, 1, 64)),
    ("mcg", 8, (128, 128), 17, (2, 1, 1)),
    ("mcg", 1, (128, 256), 2, (1, 4, 4)),
    ("mcg", 6, (128, 128), 33, (2, 1, 3)),
    ("3inst", 3, (128, 128), 7, (1, 2, 4)),
    ("3inst", 7, (128, 128), 2, (2, 1, 2)),
    ("mul1", 2, (128, 128), 4, (2, 1, 4)),
    ("mul1", 1.5, (128, 128), 9, (1, 2, 2)),
    ("mul1", 2.5, (256, 128), 1, (2, 2, 1)),
    ("mul1", 3.5, (128, 128), 6, (1, 1, 8)),
    # row blocks: one decode serves 2 or 4 blocks of 16 rows (last block partial / absent)
    ("mcg", 4, (256, 128), 37, (2, 1, 2, 2)),
    ("mul1", 2.5, (128, 256), 50, (1, 2, 2, 4)),
    ("3inst", 3, (256, 128), 20, (1, 2, 2, 2)),
    # swap: the decoded tile as the A operand, 8 rows per row block
    ("mcg", 4, (256, 128), 1, (2, 1, 4, 1, True)),
    ("mcg", 3, (128, 256), 8, (1, 2, 2, 1, True)),
    ("mul1", 2.5, (256, 128), 11, (2, 2, 3, 1, True)),
    ("3inst", 6, (128, 128), 5, (1, 1, 8, 1, True)),
    # unroll (k-tiles per loop iteration) set against the default for the K
    ("mcg", 4, (384, 128), 3, (1, 2, 4, 1, False, 2)),
    ("mcg", 4, (256, 128), 2, (2, 1, 4, 1, True, 1)),
    ("3inst", 6, (256, 128), 9, (1, 2, 3, 1, False, 2)),
    ("mul1", 2.5, (128, 256), 20, (1, 2, 2, 2, False, 1)),
])
def test_mma_matches_reconstruct(codebook, bits, shape, rows, cfg):
    """The warp-level mma GEMV (interpreter: its per-lane decode feeds an emulation of the mma;
    GPU: inline PTX) equals x·W in float64 up to x' rounded to fp16; several splits, warps, n-blocks
    and 16-row blocks."""
    in_p, out_p = shape
    tr, suh, svh = _codes(in_p, out_p, bits, seed=rows * 7 + int(bits * 10))
    x = torch.randn(rows, in_p, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ reconstruct(tr.cpu(), suh.cpu(), svh.cpu(), codebook, dtype=torch.float64)
    nt, nw, tp, *more = cfg
    mb, sw, un = (list(more) + [1, False, 0][len(more):])[:3]
    y = kl.exl3_linear(x.to(DEV), tr, suh, svh, codebook, path="mma",
                       mma_cfg=kl.MmaConfig(nt=nt, num_warps=nw, target_programs=tp, row_blocks=mb, swap=sw,
                                            unroll=un))
    assert y.shape == (rows, out_p)
    assert _rel(y, ref) < 1e-3


@pytest.mark.parametrize("codebook,bits,rows", [("mcg", 3, 6), ("mul1", 2.5, 1)])
def test_swapped_mma_adds_its_splits_into_one_buffer(codebook, bits, rows, monkeypatch):
    """1-8 rows (swapped operands): the K splits add into one fp32 buffer (atomic adds) — the same sums as the
    per-split partials that ``EXL3RT_KERNEL_DETERMINISTIC=1`` keeps (fp32 order only), and through
    ``exl3_linear`` (the pre-pass zeroes the buffer; ``torch.empty`` memory full of NaN) the same output as
    float64 x·W; a buffer given where the splits are not added is refused."""
    tr, suh, svh = _codes(512, 128, bits, seed=rows)
    cfg = kl.MmaConfig(nt=2, num_warps=1, target_programs=32, swap=True)
    xh = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).half().to(DEV)
    assert kl.use_atomic(cfg) and not kl.use_atomic(kl.MmaConfig(nt=2, swap=False))
    z = kl.mma_rotated(xh, tr, codebook, cfg)
    monkeypatch.setenv("EXL3RT_KERNEL_DETERMINISTIC", "1")
    assert not kl.use_atomic(cfg)
    parts = kl.mma_rotated(xh, tr, codebook, cfg)
    assert z.shape == (1, rows, 128) and parts.shape[0] >= 4 and parts.shape[1:] == (rows, 128)
    assert _rel(z[0], parts.sum(0).double().cpu()) < 1e-6
    ref = xh.double().cpu() @ decode(tr.cpu(), bits, codebook).double()
    assert _rel(z[0], ref) < 1e-3
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(7))
    wref = x.double() @ reconstruct(tr.cpu(), suh.cpu(), svh.cpu(), codebook, dtype=torch.float64)
    with pytest.raises(ValueError, match="acc"):
        kl.mma_rotated(xh, tr, codebook, cfg, acc=torch.zeros(1, rows, 128, device=DEV))
    garbage_empty(monkeypatch)
    ys = []
    for det in ("1", "0"):
        monkeypatch.setenv("EXL3RT_KERNEL_DETERMINISTIC", det)
        ys.append(kl.exl3_linear(x.to(DEV), tr, suh, svh, codebook, path="mma", mma_cfg=cfg))
        assert _rel(ys[-1], wref) < 1e-3
    assert _rel(ys[1], ys[0].double().cpu()) < 1e-6


def _swapped_mma_sm90_ops(ka: int, nt: int, *, halves: bool, atomic: bool, **options) -> list[str]:
    """SASS instruction lines of the swapped one-warp mma kernel (MCG, K = ``ka``, ``nt`` tiles per warp, fragment-order
    x') built for sm_90 in a fresh process (no GPU needed); ``options``: launch options."""
    from sass_check import build_sm90_triton
    from exl3rt.kernels import mma as _mm
    cb, mult, add = kc.cb_args("mcg")
    args = {"x_ptr": "*fp16", "w_ptr": "*i32", "z_ptr": "*fp32", "rows": "i32", "in_tiles": "i32", "tn_total": "i32",
            "k_per": "i32", "stride_x": "i32", "stride_zs": "i32", "one": "i32",
            "seg_b1": "i32", "seg_b2": "i32", "seg_x": "i32"}
    const = dict(KA=ka, HALF=0, CB=cb, MULT=mult, ADD=add, NT=nt, WARPS=1, NWL=_mm.words_per_lane(ka), ASM=True,
                 MB=1, SWAP=True, PDL=False, UNROLL=_mm.default_unroll(ka), XFRAG=True, HALVES=halves,
                 ATOMIC=atomic)
    sass = build_sm90_triton("exl3rt.kernels.mma", "mma_kernel", args, const, num_warps=1, **options)
    if sass is None:
        pytest.skip("this Triton ships no nvdisasm")
    return [ln for ln in sass.splitlines() if "/*" in ln]


@pytest.mark.parametrize("atomic", [False, True])
def test_swapped_mma_sm90_build_adds_or_stores(atomic):
    """The swapped kernel built for sm_90 (no GPU needed): with ``ATOMIC`` its results leave as ``red.add.f32``
    (REDG, fire-and-forget: no returned value, no compare-and-swap loop) and nothing is stored; without, plain
    stores (4 per tile either way)."""
    ops = _swapped_mma_sm90_ops(3, 4, halves=True, atomic=atomic)
    red = [ln for ln in ops if "REDG.E.ADD.F32" in ln]
    assert len(red) == (16 if atomic else 0)
    assert sum(" STG" in ln for ln in ops) == (0 if atomic else 16)
    assert not any("ATOMG" in ln or "ATOM." in ln for ln in ops)


def test_pre_pass_zeroes_the_accumulation_buffer():
    """``had(..., zero=buf)`` (pre-pass) writes zeros over every element of ``buf`` — more elements than the
    launch has programs, a count that is no multiple of them — and x' as without it; a non-fp32 buffer or a
    post-pass with ``zero`` is refused."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(DEV)
    s = torch.rand(256, generator=torch.Generator().manual_seed(2)).half().to(DEV)
    buf = torch.full((1, 3, 1411), float("nan"), device=DEV)
    out, ref = torch.empty(3, 256, device=DEV), torch.empty(3, 256, device=DEV)
    kl._had(x, s, out, pre=True, zero=buf)
    kl._had(x, s, ref, pre=True)
    assert torch.equal(buf, torch.zeros_like(buf)) and torch.equal(out, ref)
    with pytest.raises(ValueError, match="zero="):
        kl._had(x, s, out, pre=True, zero=buf.half())
    with pytest.raises(ValueError, match="zero="):
        kl._had(out, s, ref, pre=False, zero=buf)


def test_mma_words_per_lane():
    """NWL covers every lane's 8 windows (7·KA + 4·HALF + 16 bits at the lane's alignment), brute force."""
    from exl3rt.kernels.mma import words_per_lane
    for bits in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8):
        ka, half = int(bits), 0 if float(bits).is_integer() else 1
        need = 0
        for lane in range(32):
            bits_used = set()
            for p in range(8):
                t = 8 * lane + p
                end = (t + 1) * ka + half * ((t + 1) // 2)
                bits_used.update(range(end - 16, end))
            need = max(need, max(bits_used) // 32 - min(bits_used) // 32 + 1)
        assert words_per_lane(bits) == need, bits
    assert words_per_lane(4) == 2 and words_per_lane(8) == 3


def test_dispatch_and_prewarm_buckets():
    assert [kl.choose_path(r) for r in (1, 2, 16, 17, 32, 33, 64, 65, 2048)] == \
        ["mma", "mma", "mma", "mma", "mma", "mma", "mma", "decode_mm", "decode_mm"]
    assert [kl.default_mma_config(r).row_blocks for r in (16, 17, 32, 33, 64)] == [1, 2, 2, 4, 4]
    assert [kl.default_mma_config(r).swap for r in (1, 8, 9)] == [True, True, False]
    assert len({kl.specialization(r) for r in kl.PREWARM_ROWS}) == len(kl.PREWARM_ROWS)
    assert len({kl.specialization(r, 4, True) for r in kl.WGMMA_PREWARM_ROWS}) == len(kl.WGMMA_PREWARM_ROWS)
    # where the wgmma kernel runs (Hopper): 17-256 and 417-512 rows, in five row buckets, decode + cuBLAS
    # between (one mostly empty 256-row block) and above (three blocks); from 9 rows at K other than 1, 2, 4
    assert [kl.choose_path(r, wgmma=True) for r in (16, 17, 32, 33, 64, 65, 256, 257, 416, 417, 512, 513, 640)] == \
        ["mma"] + ["wgmma"] * 6 + ["decode_mm"] * 2 + ["wgmma"] * 2 + ["decode_mm"] * 2
    for bits in (1, 2, 4, 3, 2.5, 3.5, 5, 6, 8):
        first = 17 if bits in (1, 2, 4) else 9
        assert [kl.choose_path(r, wgmma=True, bits=bits) for r in (8, first - 1, first, 17, 32)] == \
            ["mma", "mma"] + ["wgmma"] * 3, bits
        assert [kl.choose_path(r, bits=bits) for r in (9, 16, 17, 32)] == ["mma"] * 4, bits    # no wgmma kernel
    # every row count maps to a bucket that the prewarm rows cover, at every K, with and without wgmma
    for bits in (2, 3, 4, 5, 6, 8, 2.5):
        assert {kl.specialization(r, bits) for r in range(1, 300)} <= {kl.specialization(r, bits) for r in kl.PREWARM_ROWS}
        assert {kl.specialization(r, bits, True) for r in range(1, 1100)} <= \
            {kl.specialization(r, bits, True) for r in kl.WGMMA_PREWARM_ROWS}
    # 9-16 rows above K = 4: four tiles per warp (the one-k-tile loop), two at K <= 4
    assert [kl.default_mma_config(r, b).nt for r, b in ((12, 4), (12, 4.5), (16, 6), (8, 6), (17, 6))] == [2, 4, 4, 4, 4]


@pytest.mark.parametrize("in_p,out_p,bits,codebook", [(256, 384, 3, "mcg"), (384, 256, 6, "3inst"), (512, 256, 2.5, "mul1")])
def test_prewarm_meets_every_specialization_of_real_calls(monkeypatch, in_p, out_p, bits, codebook):
    """``prewarm`` (one call per row bucket on random codes of the layer's shape) records a superset of the
    kernel specializations that ``exl3_linear`` meets at every row count from 1 to 80 (every mma
    configuration and decode_mm), in bf16 and fp16 — nothing compiles lazily after it. Kernels are replaced by
    recorders of Triton's specialization key (nothing runs)."""
    from exl3rt.kernels import decode, hadamard, mma, wgmma
    targets = [(hadamard, "_had_kernel"), (mma, "mma_kernel"), (decode, "decode_kernel")]
    wg = wgmma.available(torch.device(DEV))       # on an H200: 33-256 and 417-512 rows take the wgmma kernel
    if wg:
        targets.append((wgmma, "_wgmma_kernel"))
    real, warm = set(), set()
    tr, suh, svh = _codes(in_p, out_p, bits, seed=4)
    record(monkeypatch, targets, real)
    for dtype in (torch.bfloat16, torch.float16):
        for rows in list(range(1, 81)) + ([130, 200, 257, 300, 417, 500, 513, 800] if wg else []):
            kl.exl3_linear(torch.randn(rows, in_p).to(dtype).to(DEV), tr, suh, svh, codebook)
    record(monkeypatch, targets, warm)
    for dtype in (torch.bfloat16, torch.float16):
        assert kl.prewarm([(in_p, out_p, bits, codebook)], device=DEV, dtype=dtype) == len(kl.prewarm_rows(DEV))
    assert {k[0] for k in real} == {"_had_kernel", "mma_kernel", "decode_kernel"} | ({"_wgmma_kernel"} if wg else set())
    missing = real - warm
    assert not missing, f"{len(missing)} specializations met only by real calls, e.g. {sorted(missing)[0]}"


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_hadamard_passes(rows):
    """The fused butterfly pre/post passes equal (x ⊙ s)·H and (Σ z)·H ⊙ s in float64."""
    from exl3rt.format.hadamard import hadamard_blocks
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g)
    s = torch.randn(256, generator=g).half()
    out = torch.empty(rows, 256, device=DEV)
    kl._had(x.to(DEV), s.to(DEV), out, pre=True)
    assert _rel(out, hadamard_blocks(x.double() * s.double(), dim=1)) < 1e-6
    z = torch.randn(3, rows, 256, generator=g)
    kl._had(z.to(DEV), s.to(DEV), out, pre=False, splits=3, stride_split=rows * 256)
    assert _rel(out, hadamard_blocks(z.double().sum(0), dim=1) * s.double()) < 1e-6


def _fragment_offsets_from_spec(rows_pad: int, n: int, swap: bool) -> torch.Tensor:
    """fp16 offset of x'[m, k] written from the PTX ``mma.m16n8k16`` fragment tables, lane by lane: per row
    block and k-tile, lane L = 4g + c stores its registers in order, two fp16 each — A (16 × 16, row-major):
    a0 = x'[g, 2c..2c+1], a1 = x'[g+8, 2c..], a2 = x'[g, 2c+8..], a3 = x'[g+8, 2c+8..]; B (x'ᵀ, 16 × 8):
    b0 = x'[g, 2c..2c+1], b1 = x'[g, 2c+8..2c+9]."""
    out = torch.full((rows_pad, n), -1, dtype=torch.int64)
    rb_rows = 8 if swap else 16
    regs = [(0, 0), (0, 8)] if swap else [(0, 0), (8, 0), (0, 8), (8, 8)]   # (row, column) offsets
    pos = 0
    for rb in range(rows_pad // rb_rows):
        for a in range(n // 16):
            for lane in range(32):
                g, c = lane // 4, lane % 4
                for dr, dk in regs:
                    for j in range(2):
                        out[rb * rb_rows + g + dr, a * 16 + 2 * c + dk + j] = pos
                        pos += 1
    return out


@pytest.mark.parametrize("swap", [False, True])
def test_xfrag_layout(swap):
    """x' in fragment order: the Python statement equals the PTX fragment tables, and the pre-pass with
    ``frag`` writes exactly the plain pre-pass's x' scattered to it (bit for bit), padding rows zero."""
    from exl3rt.kernels.hadamard import xfrag_offsets
    rows, n = 11, 256
    rows_pad = kl.xfrag_rows(rows, kl.MmaConfig(swap=swap))
    assert rows_pad == (16 if swap else 16) and kl.xfrag_rows(3, kl.MmaConfig(swap=swap)) == (8 if swap else 16)
    assert torch.equal(xfrag_offsets(rows_pad, n, swap), _fragment_offsets_from_spec(rows_pad, n, swap))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, n, generator=g).to(torch.bfloat16)
    s = torch.randn(n, generator=g).half()
    plain = torch.empty(rows, n, dtype=torch.float16, device=DEV)
    kl._had(x.to(DEV), s.to(DEV), plain, pre=True)
    frag = torch.full((rows_pad, n), float("nan"), dtype=torch.float16, device=DEV)
    kl._had(x.to(DEV), s.to(DEV), frag, pre=True, frag=2 if swap else 1)
    want = torch.zeros(rows_pad * n, dtype=torch.float16)
    want[xfrag_offsets(rows_pad, n, swap)[:rows].reshape(-1)] = plain.cpu().reshape(-1)
    assert torch.equal(frag.cpu().reshape(-1), want)


def test_gemv_splits():
    assert kl.gemv_splits(256, 28, 528) == (19, 14)
    assert kl.gemv_splits(8, 1, 0) == (1, 8)
    assert kl.gemv_splits(256, 224, 1056, k_multiple=8) == (5, 56)   # 52 rounded up to the mma loop's step
    # the MoE launches' floor on k-tiles per split: 16896 programs over 512 would be 32 splits of 12
    assert kl.gemv_splits(384, 512, 16896, k_multiple=2) == (32, 12)
    assert kl.gemv_splits(384, 512, 16896, k_multiple=2, min_k=24) == (16, 24)
    assert kl.gemv_splits(32, 768, 16896, min_k=24) == (2, 16)      # a soft floor: ceil(32 / 24) splits
    for in_tiles, nb, tgt in [(1, 5, 100), (300, 7, 528), (17, 1, 4)]:
        for mult in (1, 2, 8):
            for min_k in (1, 5, 24):
                s, k = kl.gemv_splits(in_tiles, nb, tgt, k_multiple=mult, min_k=min_k)
                assert (s - 1) * k < in_tiles <= s * k and k % mult == 0
                assert s <= max(1, -(-in_tiles // min_k))


def test_rejects_bad_shapes():
    tr, suh, svh = _codes(128, 128, 2, seed=1)
    with pytest.raises(Exception):
        kl.exl3_linear(torch.randn(1, 64, device=DEV), tr, suh, svh, "mcg")
    with pytest.raises(Exception):
        kl.exl3_linear(torch.randn(1, 128, device=DEV), tr, suh, svh, "mcg", bits=3)


def test_exl3linear_prewarm_runs_every_row_bucket_once_per_kernel_key(monkeypatch):
    """``Exl3Linear.prewarm`` runs the layer's kernels once per row bucket of ``specialization`` (so that
    nothing compiles later), nothing for a second layer with an equal kernel key (another K or dtype is
    another key); off the kernel device it does nothing (the CPU forward is the reference, no kernels)."""
    from kernel_env import ON_GPU
    from exl3rt.format.encoded import EncodedLinear
    from exl3rt.runtime.linear import Exl3Linear

    def layer(bits, seed):
        tr, suh, svh = _codes(128, 256, bits, seed)
        return Exl3Linear.from_encoded(EncodedLinear(trellis=tr, suh=suh, svh=svh, codebook="mcg",
                                                     in_features=128, out_features=200))
    a, b, c = layer(4, 1), layer(4, 2), layer(3, 3)
    assert a.kernel_key(torch.float16) == b.kernel_key(torch.float16) != c.kernel_key(torch.float16)
    if not ON_GPU:
        assert a.prewarm(torch.float16, set()) == 0
        monkeypatch.setattr(Exl3Linear, "_on_kernel_device", lambda self: True)
    rows = []    # the launches prewarm makes, recorded (every configuration's kernels run in the tests above)
    monkeypatch.setattr(kl, "_linear", lambda x, tr, suh, svh, cb, **kw: rows.append(x.shape[0]) or (tr.shape, cb))
    done = set()
    n = a.prewarm(torch.float16, done)
    wg = kl._wg.available(a.trellis.device)
    assert n == len(rows) == len(kl.prewarm_rows(a.trellis.device))
    assert {kl.specialization(r, 4, wg) for r in rows} == {kl.specialization(r, 4, wg) for r in range(1, 1000)}
    assert b.prewarm(torch.float16, done) == 0 and len(rows) == n
    assert a.kernel_key(torch.bfloat16) not in done and c.kernel_key(torch.float16) not in done


def _q_unrounded(tr: torch.Tensor, bits, codebook: str) -> torch.Tensor:
    """Q with each MCG/3INST value the exact sum of its two fp16 halves (float64, no fp16 rounding)."""
    from exl3rt.format.bitstream import unpack_states
    from exl3rt.format.codebooks import INST3_ADDEND, INST3_MULTIPLIER, MCG_MULTIPLIER, _fp16_from_bits
    from exl3rt.format.tiles import tiles_to_matrix
    st = unpack_states(tr.cpu(), bits).to(torch.int64) & 0xFFFF
    mult, add = (MCG_MULTIPLIER, 0) if codebook == "mcg" else (INST3_MULTIPLIER, INST3_ADDEND)
    x = ((st * mult + add) & 0xFFFFFFFF & 0x8FFF8FFF) ^ 0x3B603B60
    return tiles_to_matrix(_fp16_from_bits(x & 0xFFFF).double() + _fp16_from_bits(x >> 16).double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the unrounded halves are an inline-PTX path (GPU)")
@pytest.mark.parametrize("codebook,bits,rounded", [("mcg", 3, False), ("3inst", 6, False), ("mcg", 2, True),
                                                   ("mcg", 4, False)])
def test_swapped_mma_multiplies_the_unrounded_halves(codebook, bits, rounded, monkeypatch):
    """1-8 rows (swapped operands), K other than 4/8: the kernel's Q is the exact sum of each codebook value's
    fp16 halves (x' given in fp16: only fp32 accumulation differs); with ``EXL3RT_KERNEL_ROUNDED_DECODE=1``,
    and at K = 4, the format's fp16-rounded Q."""
    if rounded:
        monkeypatch.setenv("EXL3RT_KERNEL_ROUNDED_DECODE", "1")
    tr, _, _ = _codes(256, 256, bits, seed=bits)
    xh = torch.randn(5, 256, generator=torch.Generator().manual_seed(bits)).half()
    z = kl.mma_rotated(xh.to(DEV), tr, codebook, kl.MmaConfig(nt=2, num_warps=1, target_programs=4, swap=True))
    z = z.sum(0).double().cpu()
    exact = xh.double() @ _q_unrounded(tr, bits, codebook)
    fp16 = xh.double() @ decode(tr.cpu(), bits, codebook).double()
    halves = not rounded and bits != 4
    assert _rel(z, exact if halves else fp16) < 2e-6
    assert _rel(z, fp16 if halves else exact) > 2e-5


@pytest.mark.parametrize("codebook,bits,rows,path,cfg", [
    ("mcg", 4, 1, "mma", kl.MmaConfig(nt=2, num_warps=1, target_programs=4, swap=True)),
    ("mul1", 2.5, 5, "mma", kl.MmaConfig(nt=2, num_warps=2, target_programs=2, swap=True)),
    ("3inst", 3, 11, "mma", kl.MmaConfig(nt=4, num_warps=1, target_programs=2)),
    ("mcg", 2, 20, "mma", kl.MmaConfig(nt=1, num_warps=2, target_programs=2, row_blocks=2)),
    ("mcg", 3, 7, "decode_mm", None),
    ("mcg", 4, 40, "wgmma", None),
    ("mul1", 2.5, 130, "wgmma", None),
])
def test_fused_layers_give_each_layer_its_own_product(codebook, bits, rows, path, cfg):
    """Layers of one input and K fused into one call (trellises concatenated along the output tiles, each keeping its
    own input scales, ``bounds`` the segment starts) give each layer's own x·W_g in its columns: three layers of
    widths 256 / 128 / 128 against float64 products of each layer alone."""
    from exl3rt.kernels import wgmma
    if path == "wgmma" and not wgmma.available(torch.device(DEV)):
        pytest.skip("the wgmma kernel runs on Hopper GPUs only")
    in_p, widths = 256, (256, 128, 128)
    layers = [_codes(in_p, w, bits, seed=31 * i + rows) for i, w in enumerate(widths)]
    x = torch.randn(rows, in_p, generator=torch.Generator().manual_seed(rows))
    tr = torch.cat([t for t, _, _ in layers], dim=1)
    suh = torch.stack([s for _, s, _ in layers])
    svh = torch.cat([v for _, _, v in layers])
    bounds = (256, 384)
    y = kl.exl3_linear(x.to(DEV), tr, suh, svh, codebook, path=path, mma_cfg=cfg, decode_cfg=DEC, bounds=bounds)
    assert y.shape == (rows, sum(widths))
    for (t, s, v), a, b in zip(layers, (0, 256, 384), (256, 384, 512)):
        ref = x.double() @ reconstruct(t.cpu(), s.cpu(), v.cpu(), codebook, dtype=torch.float64)
        assert _rel(y[:, a:b], ref) < 1e-3, (a, b)


def test_fused_layer_bounds_are_checked():
    tr, suh, svh = _codes(128, 256, 4, seed=3)
    x = torch.randn(2, 128).to(DEV)
    two = torch.stack([suh, suh])
    with pytest.raises(ValueError, match="segment bounds"):
        kl.exl3_linear(x, tr, two, svh, "mcg", path="mma", mma_cfg=MMA, bounds=(100,))
    with pytest.raises(Exception, match="segments"):
        kl.exl3_linear(x, tr, suh, svh, "mcg", path="mma", mma_cfg=MMA, bounds=(128,))
    with pytest.raises(ValueError, match="expected one of"):
        kl.exl3_linear(x, tr, two, svh, "mcg", path="ffma", bounds=(128,))
