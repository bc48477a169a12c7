"""The Hopper wgmma decode GEMM (``exl3rt.kernels.wgmma``): host-side rules everywhere, numbers on an H200.

Gluon kernels do not run in Triton's interpreter: on CPU (CI) this file checks the launch rules (row buckets,
K splits, x' in whole row blocks — the kernel replaced by a recorder —, availability, the clear error off Hopper)
and builds the kernel for sm_90 with the installed
Triton (its SASS: the register layout change is free, 4 HGMMAs per chunk, and with the overlapped loop no
instruction writes the A registers of a wgmma still in flight); on a GPU of compute capability 9.0 it checks
the kernel against float64 products with Q from ``format.decode`` for every codebook, K from 2 to 8 and
half-integer K, ragged row counts and K splits (both chunk loops), and ``exl3_linear`` on the wgmma path
against ``format.reconstruct``.
"""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEV, garbage_empty, random_codes as _codes, require_kernels
from sass_check import build_sm90, inflight_a_writes, unpatched_language

require_kernels()

from exl3rt.format.bits import words16_per_tile  # noqa: E402
from exl3rt.format.reconstruct import decode, reconstruct  # noqa: E402
from exl3rt.kernels import linear as kl  # noqa: E402
from exl3rt.kernels import wgmma as wg  # noqa: E402

ON_HOPPER = wg.available(torch.device(DEV))
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA device of compute capability 9.0 (wgmma)")


def test_row_buckets_and_splits():
    assert [wg.default_wgmma_config(r).block_rows for r in (1, 9, 16, 17, 32, 33, 64, 65, 128, 129, 640)] == \
        [16, 16, 16, 32, 32, 64, 64, 128, 128, 256, 256]
    # from 65 rows: the paired loop where the lane decode has a normalizing shift (K other than 4 and 8)
    assert [wg.default_wgmma_config(256, k) for k in (1, 2, 2.5, 3, 4, 5, 6, 8)] == \
        [wg.WGMMA_256_PAIR] * 4 + [wg.WGMMA_256] + [wg.WGMMA_256_PAIR] * 2 + [wg.WGMMA_256]
    assert [wg.default_wgmma_config(100, k) for k in (3, 4, 6, 8)] == \
        [wg.WGMMA_128_PAIR, wg.WGMMA_128, wg.WGMMA_128_PAIR, wg.WGMMA_128]
    assert wg.WGMMA_128_PAIR.pair and (wg.WGMMA_128_PAIR.block_rows, wg.WGMMA_128_PAIR.stages) == (128, 3)
    for k_tiles in (8, 24, 256, 896):
        for programs in (1, 7, 64, 224, 5000):
            for target in (256, 1024):
                splits, k_per = wg.wgmma_splits(k_tiles, programs, target)
                # whole chunks of 4 k-tiles, at least two per split, every k-tile in exactly one split
                assert k_per % wg.KC == 0 and k_per >= min(2 * wg.KC, k_tiles)
                assert (splits - 1) * k_per < k_tiles <= splits * k_per
                assert splits == 1 or programs * splits <= max(target, programs)
    assert wg.wgmma_splits(256, 224, 256) == (1, 256)          # 4096 x 14336: one program per column group
    assert wg.wgmma_splits(896, 64, 256) == (4, 224)           # 14336 x 4096: four K splits
    # two chunks per wait need two x' buffers and the waiting loop (one buffer would wait on itself)
    for bad in (dict(stages=1), dict(overlap=True)):
        with pytest.raises(ValueError, match="pair=True"):
            wg.WgmmaConfig(block_rows=16, pair=True, **bad)


def test_small_row_buckets_add_many_splits_into_one_buffer(monkeypatch):
    """9-32 rows (16/32 rows per program) add their K splits into one buffer from ATOMIC_MIN_SPLITS splits on
    (14336 × 4096: 23 splits; 4096 × 14336: 6 at 32 rows, stored); larger row buckets never; not with
    ``EXL3RT_KERNEL_DETERMINISTIC``. Where 16 rows per program stay below it, K is split for ~896 programs
    (``stored_target_programs``): 4096 × 14336 in 4 splits of 64 k-tiles (224 column groups × 4); 16 rows per
    program add into one buffer only from 16 splits (8192 × 8192: 7 stored splits, not 12 added)."""
    assert wg.launch_splits(896, 256, wg.WGMMA_16) == (23, 40, True)
    assert wg.launch_splits(896, 256, wg.WGMMA_32)[0::2] == (23, True)
    assert wg.launch_splits(512, 512, wg.WGMMA_32)[0::2] == (12, True)          # 8192 × 8192
    assert wg.launch_splits(512, 512, wg.WGMMA_16) == (7, 76, False)           # (one buffer from 16 splits)
    assert wg.launch_splits(256, 896, wg.WGMMA_32)[0::2] == (6, False)           # 4096 × 14336
    assert wg.launch_splits(256, 896, wg.WGMMA_16) == (4, 64, False)
    assert wg.wgmma_splits(256, 224, 1536) == (6, 44)                            # what 16 rows would get at 1536
    for cfg in (wg.WGMMA_64, wg.WGMMA_128, wg.WGMMA_256):
        assert not wg.use_atomic(cfg, 1000)
    assert [wg.use_atomic(wg.WGMMA_32, n) for n in (1, wg.ATOMIC_MIN_SPLITS - 1, wg.ATOMIC_MIN_SPLITS)] == \
        [False, False, True]
    assert [wg.use_atomic(wg.WGMMA_16, n) for n in (12, 15, 16)] == [False, False, True]
    monkeypatch.setenv("EXL3RT_KERNEL_DETERMINISTIC", "1")
    assert wg.launch_splits(896, 256, wg.WGMMA_16) == (14, 64, False)           # stored: ~896 programs
    assert wg.launch_splits(896, 256, wg.WGMMA_32) == (23, 40, False)


def test_padded_rows_are_whole_row_blocks():
    """x' buffers of the wgmma path hold whole row blocks (a TMA box past the end of x' is slow)."""
    assert [wg.padded_rows(r, wg.WGMMA_256) for r in (129, 256, 257, 512)] == [256, 256, 512, 512]
    assert [wg.padded_rows(r, wg.WGMMA_64) for r in (33, 64, 65)] == [64, 64, 128]
    assert [wg.padded_rows(r, wg.default_wgmma_config(r)) for r in (9, 17, 33, 65, 100, 129, 300)] == \
        [16, 32, 64, 128, 128, 256, 512]


@pytest.mark.parametrize("rows,in_p", [(9, 256), (20, 256), (33, 256), (100, 256), (129, 256), (460, 256),
                                       (9, 4096), (20, 4096)])
def test_wgmma_path_hands_the_kernel_whole_row_blocks(rows, in_p, monkeypatch):
    """``exl3_linear``'s wgmma path, host side (the kernel replaced by a recorder that returns x'·Q in float64, so
    this runs anywhere): x' holds whole row blocks of the row bucket's configuration, the kernel is told the real
    row count, the pre-pass wrote x' rows ``0 … rows − 1`` as the plain pre-pass does, and the output is x·W. At
    9-32 rows of a wide K (4096 × 128: 32 splits) the kernel gets one accumulation buffer, zeroed by the
    pre-pass (``torch.empty`` memory full of NaN here), to add its splits into."""
    tr, suh, svh = _codes(in_p, 128, 4, seed=rows)
    q = decode(tr.cpu(), 4, "mcg").double()
    seen = {}
    garbage_empty(monkeypatch)

    def kernel(xh, trellis, codebook, cfg, pdl=False, rows=None, acc=None, alloc=None):
        seen.update(shape=tuple(xh.shape), rows=rows, block=cfg.block_rows, x=xh[:rows].clone(), acc=acc is not None)
        z = (xh[:rows].double().cpu() @ q).float().to(xh.device)[None]
        if acc is not None:
            assert acc.shape == z.shape and torch.equal(acc, torch.zeros_like(acc))
            return acc.add_(z)
        return z

    monkeypatch.setattr(wg, "wgmma_rotated", kernel)
    x = torch.randn(rows, in_p, generator=torch.Generator().manual_seed(rows)).to(DEV)
    y = kl.exl3_linear(x, tr, suh, svh, "mcg", path="wgmma")
    cfg = wg.default_wgmma_config(rows)
    block = cfg.block_rows
    assert seen["rows"] == rows and seen["block"] == block and seen["shape"] == (-(-rows // block) * block, in_p)
    assert seen["acc"] == (in_p == 4096) == wg.launch_splits(in_p // 16, 8, cfg)[2]
    ref = torch.zeros(rows, in_p, dtype=torch.float16, device=DEV)
    kl._had(x, suh, ref, pre=True)
    assert torch.equal(seen["x"], ref)
    w = reconstruct(tr.cpu(), suh.cpu(), svh.cpu(), "mcg", dtype=torch.float64)
    assert float((y.double().cpu() - x.double().cpu() @ w).norm() / (x.double().cpu() @ w).norm()) < 1e-3


def test_off_hopper_it_is_never_chosen_and_says_why(monkeypatch):
    assert not wg.available(torch.device("cpu"))
    x = torch.zeros(40, 128, dtype=torch.float16)
    tr = torch.zeros(8, 8, words16_per_tile(4), dtype=torch.int16)
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        wg.wgmma_rotated(x, tr, "mcg")
    monkeypatch.setenv("EXL3RT_KERNEL_NO_WGMMA", "1")
    assert not wg.available(torch.device(DEV))


@hopper
@pytest.mark.parametrize("bits,codebook", [(2, "mcg"), (3, "mcg"), (4, "mcg"), (5, "3inst"), (6, "mcg"), (8, "mcg"),
                                           (2.5, "mul1"), (4, "mul1"), (3, "3inst")])
@pytest.mark.parametrize("rows", [13, 29, 33, 100, 300])
def test_kernel_against_float64(bits, codebook, rows):
    """Partials summed over the K splits equal x'·Q in float64 (Q decoded by ``format.decode``)."""
    in_p, out_p = 1024, 512
    tr, _, _ = _codes(in_p, out_p, bits, seed=int(10 * bits) + rows)
    q = decode(tr, bits, codebook).double()
    x = torch.randn(rows, in_p, device=DEV).half()
    # the row bucket's own configuration; many splits with 2 buffers; the chunk loops with 1 and 3 chunks per
    # split (64 k-tiles in 6 splits: 12, 12, 12, 12, 12, 4 k-tiles), the paired loop with 3 and 4, and the
    # overlapped loop with 2 buffers
    for cfg in (None, wg.WgmmaConfig(block_rows=64, stages=2, target_programs=10_000),
                wg.WgmmaConfig(block_rows=16, stages=2, target_programs=48, pair=True),   # 12 k-tiles: 3 chunks
                wg.WgmmaConfig(block_rows=32, stages=3, target_programs=32, pair=True),   # 16 k-tiles: 4 chunks
                wg.WgmmaConfig(block_rows=256, stages=3, target_programs=48, overlap=True),
                wg.WgmmaConfig(block_rows=128, stages=3, target_programs=48),
                wg.WgmmaConfig(block_rows=64, stages=2, target_programs=10_000, overlap=True)):
        z = wg.wgmma_rotated(x, tr, codebook, cfg)
        ref = x.double() @ q
        rel = float((z.double().sum(0) - ref).norm() / ref.norm())
        assert rel < 1e-5, (cfg, rel)          # fp32 accumulation of exact fp16 products
        if cfg is not None:
            assert z.shape[0] == wg.wgmma_splits(in_p // 16, out_p // 64, cfg.target_programs)[0] > 1


@hopper
@pytest.mark.parametrize("rows,bits", [(13, 6), (29, 3)])
def test_kernel_adds_its_splits_into_one_buffer(rows, bits, monkeypatch):
    """9-32 rows over many K splits (4096 × 512: 32): the splits added into one buffer equal the per-split
    partials that ``EXL3RT_KERNEL_DETERMINISTIC=1`` keeps (fp32 order only) and the float64 product; a buffer
    given to a launch that stores its splits is refused; through ``exl3_linear`` (NaN-filled ``torch.empty``) both
    modes give float64 x·W."""
    tr, suh, svh = _codes(4096, 512, bits, seed=rows)
    cfg = wg.default_wgmma_config(rows)
    assert wg.launch_splits(256, 32, cfg)[::2] == (32, True)
    xh = torch.randn(rows, 4096, device=DEV).half()
    z = wg.wgmma_rotated(xh, tr, "mcg", cfg)
    ref = xh.double() @ decode(tr, bits, "mcg").double()
    assert z.shape == (1, rows, 512) and float((z[0].double() - ref).norm() / ref.norm()) < 1e-5
    with pytest.raises(ValueError, match="acc"):
        wg.wgmma_rotated(xh, tr, "mcg", wg.WGMMA_64, acc=torch.zeros(1, rows, 512, device=DEV))
    x = torch.randn(rows, 4096, device=DEV)
    wref = x.double() @ reconstruct(tr, suh, svh, "mcg", dtype=torch.float64)
    garbage_empty(monkeypatch)
    ys = []
    for det in ("1", "0"):
        monkeypatch.setenv("EXL3RT_KERNEL_DETERMINISTIC", det)
        if det == "1":
            parts = wg.wgmma_rotated(xh, tr, "mcg", cfg)
            assert parts.shape == (32, rows, 512)
            assert float((z[0].double() - parts.double().sum(0)).norm() / ref.norm()) < 1e-6
        ys.append(kl.exl3_linear(x, tr, suh, svh, "mcg"))
        assert float((ys[-1].double() - wref).norm() / wref.norm()) < 1e-3


@hopper
@pytest.mark.parametrize("rows", [33, 100, 300])
def test_rows_past_the_product_are_read_never_stored(rows):
    """x' padded to whole row blocks with NaN rows: the product's rows equal the unpadded call's (the padding
    only reaches product rows that are not stored) and ``rows`` out of range is refused."""
    tr, _, _ = _codes(1024, 512, 4, seed=rows)
    cfg = wg.default_wgmma_config(rows)
    x = torch.randn(rows, 1024, device=DEV).half()
    xp = torch.full((wg.padded_rows(rows, cfg), 1024), float("nan"), device=DEV).half()
    xp[:rows] = x
    z = wg.wgmma_rotated(xp, tr, "mcg", cfg, rows=rows)
    assert z.shape[1] == rows and torch.isfinite(z).all()
    assert torch.equal(z, wg.wgmma_rotated(x, tr, "mcg", cfg))
    for bad in (0, xp.shape[0] + 1):
        with pytest.raises(ValueError, match="rows="):
            wg.wgmma_rotated(xp, tr, "mcg", cfg, rows=bad)


@hopper
@pytest.mark.parametrize("rows,bits", [(9, 6), (16, 3), (17, 4), (31, 2), (33, 4), (65, 4), (129, 4), (200, 4),
                                       (417, 4), (512, 4)])
def test_exl3_linear_takes_the_wgmma_path(rows, bits):
    """``exl3_linear`` picks the wgmma kernel for 17-256 and 417-512 rows (from 9 at K other than 1, 2, 4) and
    equals the float64 layer (x' in fp16)."""
    tr, suh, svh = _codes(2048, 1024, bits, seed=rows)
    assert kl.choose_path(rows, wgmma=True, bits=bits) == "wgmma"
    x = torch.randn(rows, 2048, device=DEV)
    y = kl.exl3_linear(x, tr, suh, svh, "mcg")
    ref = x.double() @ reconstruct(tr, suh, svh, "mcg", dtype=torch.float64)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-3


@hopper
def test_prewarm_then_graph_capture():
    """After ``prewarm``, a CUDA graph of wgmma-path calls captures without compiling and replays exactly."""
    tr, suh, svh = _codes(1024, 512, 3, seed=7)
    kl.prewarm([(1024, 512, 3, "mcg")], device=DEV, dtype=torch.bfloat16)
    x = torch.randn(200, 1024, device=DEV, dtype=torch.bfloat16)
    y0 = kl.exl3_linear(x, tr, suh, svh, "mcg")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = kl.exl3_linear(x, tr, suh, svh, "mcg")
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, y0)


def _build_sm90(bits, codebook, cfg, atomic=False):
    """The SASS of the kernel ``wgmma_rotated`` launches for K = ``bits``, ``codebook``, ``cfg``, built for sm_90."""
    args = {"w_ptr": "*i32", "z_ptr": "*fp32", "rows": "i32", "k_tiles": "i32", "n_tiles": "i32", "k_per": "i32",
            "stride_zs": "i32", "one": "i32", "seg_b1": "i32", "seg_b2": "i32", "seg_rows": "i32"}
    const = {**wg.kernel_constants(bits, codebook, cfg, cfg.pdl, atomic), "PDL": cfg.pdl,
             "ATOMIC": atomic}                                                   # a compile names every argument
    return build_sm90(wg._wgmma_kernel, cfg.block_rows, args, const, launch_pdl=cfg.pdl)


@pytest.mark.skipif(not wg.HAVE_GLUON, reason="Triton without Gluon")
@pytest.mark.parametrize("cfg", [wg.WGMMA_16, wg.WGMMA_32])
def test_atomic_build_adds_instead_of_storing(cfg):
    """With its splits added into one buffer the kernel ends in one ``RED.ADD.F32`` per accumulator register
    (BR·64 / 128 per thread) and stores no result; otherwise as many plain stores and no adds."""
    for atomic in (True, False):
        sass = _build_sm90(6, "mcg", cfg, atomic)
        if sass is None:
            pytest.skip("no nvdisasm next to Triton's ptxas")
        red = [ln for ln in sass.splitlines() if " RED" in ln and ".ADD.F32" in ln]
        stg = [ln for ln in sass.splitlines() if " STG" in ln]
        assert (len(red), len(stg)) == ((cfg.block_rows // 2, 0) if atomic else (0, cfg.block_rows // 2))


def test_the_inflight_check_sees_a_race():
    """The SASS check itself: a register of a committed, unretired HGMMA's A operand written inside the loop is
    reported, also when the write comes before the HGMMA in the loop body (the back edge); after the wait
    that retires the group it is not."""
    racy = """
.L_x_3:
        /*0010*/                   IMAD R169, R2, 0x3, RZ ;
        /*0020*/                   WARPGROUP.ARRIVE ;
        /*0030*/                   HGMMA.64x256x16.F32 R24, R168, gdesc[UR8], R24, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0050*/               @P0 BRA `(.L_x_3) ;
"""
    assert inflight_a_writes(racy) == ["IMAD R169, R2, 0x3, RZ"]
    assert inflight_a_writes(racy.replace("0x1 ;", "0x0 ;")) == []
    assert inflight_a_writes(racy.replace("R169, R2", "R172, R2")) == []


def test_builds_see_the_language_as_imported():
    """A language function the interpreter left patched (as a device-function call does) is the imported one
    inside ``unpatched_language`` — where the sm_90 builds compile — and the found state comes back after."""
    import triton.language as tl
    real, leaked = tl.core.mul, (lambda *a, **k: None)
    tl.core.mul = leaked
    try:
        with unpatched_language() as n:       # the imported function (not the interpreter's stand-in)
            assert n >= 1 and tl.core.mul is not leaked and tl.core.mul.__module__ == "triton.language.core"
        assert tl.core.mul is leaked
    finally:
        tl.core.mul = real


@pytest.mark.skipif(not wg.HAVE_GLUON, reason="Triton without Gluon")
@pytest.mark.parametrize("bits,codebook,cfg", [(4, "mcg", wg.WGMMA_256), (3, "mcg", wg.WGMMA_128),
                                               (6, "3inst", wg.WGMMA_64), (2.5, "mul1", wg.WGMMA_256),
                                               (3, "mcg", wg.WGMMA_256), (6, "mcg", wg.WGMMA_256),
                                               (6, "mcg", wg.WGMMA_16), (4, "mul1", wg.WGMMA_32),
                                               (3, "mcg", wg.WGMMA_256_PAIR), (5, "mcg", wg.WGMMA_128_PAIR)])
def test_kernel_builds_for_sm90_without_a_gpu(bits, codebook, cfg):
    """The Gluon kernel compiles for sm_90 with this machine's Triton (CI's, whatever its version: Gluon's API
    moves), the decoded registers become the wgmma A operand without data movement (the build asserts it; the
    SASS has no shared-memory loads or stores besides TMA and the barriers), each chunk is 4 HGMMAs (the
    overlapped and the paired loops have 3 chunk sites: even, odd, a last odd chunk), no instruction writes the
    A registers of a wgmma in flight, and with PDL (BR 16, 32, 64) the grid dependency wait sits between the
    first weight loads and the first x' copy."""
    sass = _build_sm90(bits, codebook, cfg)
    if sass is None:
        pytest.skip("no nvdisasm next to Triton's ptxas")
    assert sass.count("HGMMA.64x%dx16" % cfg.block_rows) == (12 if cfg.overlap or cfg.pair else 4)
    for op in ("STS", "LDS", "STSM", "LDSM"):
        assert f" {op}" not in sass and f"{op}." not in sass, op
    assert inflight_a_writes(sass) == []
    if cfg.pdl:     # PDL: the next grid may launch at once; the first words load before waiting for x' (TMA)
        assert "PREEXIT" in sass and sass.index(" LDG") < sass.index("ACQBULK") < sass.index("UTMALDG")
    if cfg.overlap:
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass      # one group in flight: the decode runs under it
