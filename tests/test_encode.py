"""The quantizer: quality against exllamav3's own results, Gaussian floors, calibrated mode, errors.

Independent truths: the reference quantizer's errors stored in the golden files, the
information-theoretic floor 2^(−2K) for Gaussian weights, float64 linear algebra.
"""

import math

import pytest
import torch

from exl3rt.encode.errors import EncodeError
from exl3rt.encode.hessian import HessianCollector
from exl3rt.encode.ldl import block_ldl_feedback, damp, rotate
from exl3rt.encode.quantize import proxy_error, quantize_weight
from exl3rt.encode.backends import get_tile_encoder
from exl3rt.encode.regularize import random_signs, sample_tiles, search_global_scale
from exl3rt.format import EncodedLinear, reconstruct, unpack_states
from exl3rt.format.bitstream import tail_biting_violations
from exl3rt.format.tiles import matrix_to_tiles

from conftest import LAYER_FILES, golden_codebook, load_golden

pytest.importorskip("numba", reason="the CPU encoder backend needs numba (pip install -e '.[test]')")

UNCALIBRATED = [f for f in LAYER_FILES if not f.endswith("_calib.safetensors")]
CALIBRATED = [f for f in LAYER_FILES if f.endswith("_calib.safetensors")]


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", UNCALIBRATED)
def test_quality_matches_reference_on_golden(name):
    g, meta = load_golden(name)
    bits = float(meta["K"])
    bits = int(bits) if bits.is_integer() else bits
    ours = quantize_weight(g["weight"], bits, meta["codebook"], seed=int(meta["seed"]), backend="numba")
    assert isinstance(ours, EncodedLinear) and ours.codebook == golden_codebook(g) and ours.bits == bits
    ref = rel_err(g["recon"], g["weight"])
    got = rel_err(ours.reconstruct(), g["weight"])
    assert got <= 1.02 * ref, f"{name}: ours {got:.5f} vs reference {ref:.5f}"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_within_1db_of_floor(bits):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(bits))
    enc = quantize_weight(w, bits, "mcg", seed=bits, backend="numba")
    mse = rel_err(enc.reconstruct(), w) ** 2
    db_over_floor = 10 * math.log10(mse / 2 ** (-2 * bits))
    assert db_over_floor <= 1.0, f"K={bits}: {db_over_floor:.2f} dB over the floor"
    assert enc.info["proxy_err"] == pytest.approx(mse, rel=0.05)  # uncalibrated proxy = relative MSE


@pytest.mark.parametrize("name", CALIBRATED)
def test_calibrated_proxy_matches_reference(name):
    g, meta = load_golden(name)
    bits = int(float(meta["K"]))
    ours = quantize_weight(g["weight"], bits, meta["codebook"], hessian=g["H"], seed=int(meta["seed"]),
                           backend="numba")
    assert ours.info["calibrated"]
    h = g["H"].double()
    got = proxy_error(g["weight"], ours.reconstruct(), h)
    ref = float(meta["proxy_err"])
    assert got <= 1.05 * ref, f"{name}: ours {got:.6f} vs reference {ref:.6f}"
    # the feedback must help: the same weight uncalibrated has a larger output error under H
    plain = quantize_weight(g["weight"], bits, meta["codebook"], seed=int(meta["seed"]), backend="numba")
    assert got < proxy_error(g["weight"], plain.reconstruct(), h)


def test_fixed_seed_is_deterministic_and_seed_matters():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    a = quantize_weight(w, 3, "mul1", seed=5, backend="numba")
    b = quantize_weight(w, 3, "mul1", seed=5, backend="numba")
    c = quantize_weight(w, 3, "mul1", seed=6, backend="numba")
    assert torch.equal(a.trellis, b.trellis) and torch.equal(a.suh, b.suh) and torch.equal(a.svh, b.svh)
    assert not torch.equal(a.suh.sign(), c.suh.sign())


def test_half_integer_bits():
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(1))
    enc = quantize_weight(w, 2.5, "mul1", backend="numba")
    assert enc.bits == 2.5 and enc.trellis.shape == (8, 8, 40)
    assert not tail_biting_violations(unpack_states(enc.trellis, 2.5), 2.5).any()
    e25 = rel_err(enc.reconstruct(), w)
    e2 = rel_err(quantize_weight(w, 2, "mul1", backend="numba").reconstruct(), w)
    e3 = rel_err(quantize_weight(w, 3, "mul1", backend="numba").reconstruct(), w)
    assert e3 < e25 < e2


def test_padding_is_recorded_and_trimmed():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(2))
    enc = quantize_weight(w, 4, "mcg", backend="numba")
    assert (enc.in_features, enc.out_features, enc.in_padded, enc.out_padded) == (200, 300, 256, 384)
    assert enc.reconstruct().shape == (200, 300)
    assert rel_err(enc.reconstruct(), w) < 0.08
    full = reconstruct(enc.trellis, enc.suh, enc.svh, enc.codebook)
    assert float(full[200:].abs().max()) < 0.5 * float(w.abs().max())  # padding decodes to small noise


def test_error_nan_weight_names_the_tensor():
    w = torch.randn(128, 128)
    w[3, 4] = float("nan")
    with pytest.raises(EncodeError, match=r"layers.0.q_proj: 1 non-finite value"):
        quantize_weight(w, 4, name="layers.0.q_proj", backend="numba")


def test_error_bad_arguments():
    w = torch.randn(128, 128)
    with pytest.raises(EncodeError, match="half-integer bits .* need codebook='mul1'"):
        quantize_weight(w, 2.5, "mcg", backend="numba")
    with pytest.raises(EncodeError, match="unsupported bitrate 9"):
        quantize_weight(w, 9, backend="numba")
    with pytest.raises(EncodeError, match="unknown codebook"):
        quantize_weight(w, 4, "qtip", backend="numba")
    with pytest.raises(EncodeError, match=r"hessian shape \(64, 64\) does not match in_features 128"):
        quantize_weight(w, 4, hessian=torch.eye(64), backend="numba")
    with pytest.raises(EncodeError, match="expected a 2-D"):
        quantize_weight(torch.randn(128), 4, backend="numba")
    with pytest.raises(EncodeError, match="unknown encoder backend 'cuda9'"):
        quantize_weight(w, 4, backend="cuda9")


def test_hessian_collector_against_float64():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5, 7, 32, generator=g), torch.randn(11, 32, generator=g).half()]
    xs[0][1, 2, 5] = float("nan")
    xs[1][4, 0] = float("inf")
    hc = HessianCollector(32)
    for x in xs:
        hc.update(x)
    rows = torch.cat([xs[0].reshape(-1, 32).double(), xs[1].double()])
    rows = rows[torch.isfinite(rows).all(1)]
    assert (hc.rows, hc.dropped) == (rows.shape[0], 2)
    assert torch.allclose(hc.finalize().double(), rows.T @ rows / rows.shape[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(EncodeError, match="activations have 31 features, expected 32"):
        hc.update(torch.zeros(2, 31))
    assert HessianCollector(8).finalize() is None


def test_block_ldl_feedback_factorizes_the_rotated_hessian():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(600, 128, generator=g, dtype=torch.float64) @ torch.randn(128, 128, generator=g, dtype=torch.float64)
    h = damp(x.T @ x / 600)
    s = random_signs(128, g)
    hr = rotate(h, s)
    f = block_ldl_feedback(hr)
    unit = f + torch.eye(128, dtype=torch.float64)
    d = torch.linalg.solve(unit, torch.linalg.solve(unit, hr).T).T  # L⁻¹ H L⁻ᵀ
    blk = torch.arange(128) // 16
    off = blk[:, None] != blk[None, :]
    assert float(d[off].abs().max()) < 1e-8 * float(d.abs().max())
    assert float(f[~off].abs().max()) == 0.0 and float(torch.triu(f).abs().max()) == 0.0
    assert damp(torch.zeros(16, 16)) is None


def test_sample_tiles_reference_set_and_cap():
    """Small layers: the reference's set (width-3 wrapped diagonal + 8 lowest/highest-RMS tiles);
    larger ones: at most the cap, all on that diagonal, every tile row present, stream order."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(4))
    tiles = matrix_to_tiles(w).reshape(-1, 256)
    diag = {(d % 16) * 32 + (d + j) % 32 for d in range(32) for j in range(3)}
    order = torch.argsort(tiles.square().mean(1)).tolist()
    want = sorted(diag | set(order[:8]) | set(order[-8:]))
    assert torch.equal(sample_tiles(w), tiles[want])
    big = torch.randn(640, 1536, generator=torch.Generator().manual_seed(5))  # 40 x 96 tiles
    bt = matrix_to_tiles(big).reshape(-1, 256)
    bdiag = sorted({(d % 40) * 96 + (d + j) % 96 for d in range(96) for j in range(3)})
    for cap in (None, 64, 200):
        s = sample_tiles(big, cap)
        n = cap or 128
        assert s.shape == (n, 256)
        ids = [next(i for i in bdiag if torch.equal(bt[i], row)) for row in s]
        assert ids == sorted(set(ids))
        assert len({i // 96 for i in ids}) == 40


@pytest.mark.parametrize("bits", [2, 4])
def test_g_search_open_path_estimate(bits):
    """With ``open_cost`` the search measures each (g, tile) once: an encoder whose open_cost is
    the full encode's own error gives the same g as the full-encode search; the real open-path
    estimate gives a g within 3 % of it (the open-path error runs a few % below, almost uniformly)."""
    enc = get_tile_encoder("numba")
    assert hasattr(enc, "open_cost") and hasattr(get_tile_encoder("torch"), "open_cost")
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(bits)) * 1.2437
    calls = []

    def full(t, b, c):
        calls.append(t.shape[0])
        return enc(t, b, c)

    def exact_cost(t, b, c):
        _, v = enc(t, b, c)
        return (v.double() - t.double()).square().sum(1)

    g_full = search_global_scale(full, w, bits, "mcg")
    full.open_cost = exact_cost
    calls.clear()
    assert search_global_scale(full, w, bits, "mcg") == pytest.approx(g_full, rel=1e-6)
    assert calls == []
    counted = []
    enc_counting = lambda t, b, c: enc(t, b, c)  # noqa: E731
    enc_counting.open_cost = lambda t, b, c: (counted.append(t.shape[0]), enc.open_cost(t, b, c))[1]
    g_open = search_global_scale(enc_counting, w, bits, "mcg")
    # coarse points on every 3rd sample (32), fine points on all 96, except the one at the coarse
    # best, which reuses the 32 it has
    assert counted.count(64) == 1 and set(counted) == {32, 64, 96}
    assert abs(g_open / g_full - 1) < 0.03, (g_open, g_full)


# ---- weights fp16 scales cannot carry: all zero, partly zero, tiny, huge ------------------------------------

def _digest(enc) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in (enc.trellis, enc.suh, enc.svh):
        h.update(t.contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def test_ordinary_weights_encode_as_before():
    """Codes, scales, proxy error and g of ordinary weights (some zero rows and columns included) are those the
    encoder produced before zero weights were handled (digests recorded then, on encoder version 2): the
    cache keys stay valid."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(128, 256, generator=g)
    w[:, 5] = 0
    w[17] = 0
    x = torch.randn(512, 128, generator=g)
    h = x.T @ x / 512
    want = {(2, "mcg", False): ("1800e12c97e370b4", 0.06872015903771365, 0.9898861720135715),
            (2.5, "mul1", False): ("272fe8dd69c5ad51", 0.03467549732639238, 0.7702102297656475),
            (3, "3inst", False): ("b5b88a81a1513752", 0.017877211667757013, 0.9263065730562617),
            (3, "mcg", True): ("f29bcc2e6af9cb83", 0.01536846048577417, 0.9286875126925886)}
    for (bits, cb, cal), (digest, err, g_scale) in want.items():
        enc = quantize_weight(w, bits, cb, hessian=h if cal else None, seed=3, backend="numba")
        # the codes bit for bit; the two float summaries to 1e-6 (BLAS kernels round differently on other CPUs)
        assert _digest(enc) == digest, (bits, cb, cal)
        assert enc.info["proxy_err"] == pytest.approx(err, rel=1e-6) and \
            enc.info["g_scale"] == pytest.approx(g_scale, rel=1e-6), (bits, cb, cal)


@pytest.mark.parametrize("bits,codebook,calibrated", [(2, "mcg", False), (4, "mcg", False), (2.5, "mul1", False),
                                                      (4, "3inst", False), (3, "mcg", True)])
def test_zero_weight_encodes_to_exact_zero(bits, codebook, calibrated):
    w = torch.zeros(256, 200)
    h = torch.eye(256) if calibrated else None
    enc = quantize_weight(w, bits, codebook, hessian=h, backend="numba", name="z")
    assert isinstance(enc, EncodedLinear) and enc.bits == bits and enc.codebook == codebook
    assert enc.trellis.shape == (16, 16, int(16 * bits)) and (enc.in_features, enc.out_features) == (256, 200)
    assert enc.info["proxy_err"] == 0.0 and enc.info["calibrated"] == calibrated
    assert torch.isfinite(enc.suh.float()).all() and not enc.svh.any()
    assert torch.equal(enc.reconstruct(), torch.zeros(256, 200))
    full = reconstruct(enc.trellis, enc.suh, enc.svh, enc.codebook)
    assert torch.equal(full, torch.zeros(256, 256))
    assert not tail_biting_violations(unpack_states(enc.trellis, bits), bits).any()
    EncodedLinear(enc.trellis, enc.suh, enc.svh, enc.codebook)  # validates as a stored linear would


def test_partly_zero_weight():
    """All-zero rows and columns in an otherwise ordinary weight: finite proxy error, zero columns exactly zero,
    the rest at the Gaussian error level."""
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(8))
    w[:, 100:140] = 0     # columns (across a 128-block boundary)
    w[:, 250] = 0
    w[30:60] = 0          # rows
    enc = quantize_weight(w, 4, "mcg", backend="numba")
    err = enc.info["proxy_err"]
    assert math.isfinite(err) and 0 < err < 0.02
    rec = enc.reconstruct()
    assert not rec[:, 100:140].any() and not rec[:, 250].any()
    true_err = proxy_error(w, rec)
    assert true_err < 2 * 2 ** (-2 * 4) and err == pytest.approx(true_err, rel=0.5)


@pytest.mark.parametrize("scale", [1e-30, 1e-21, 1e-10, 1e-8])
def test_tiny_weight_is_an_honest_zero(scale):
    """Magnitudes fp16 scales cannot carry: the reconstruction is exactly zero and the proxy error is its true
    relative error, 1 (1e-8: found only after the g search, where suh / g rounds to zero)."""
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(9)) * scale
    enc = quantize_weight(w, 4, "mcg", backend="numba")
    rec = enc.reconstruct()
    assert torch.equal(rec, torch.zeros(128, 128))
    truth = float(((w.double() - rec.double()).square().sum() / w.double().square().sum()))
    assert truth == 1.0 and enc.info["proxy_err"] == 1.0
    assert torch.isfinite(enc.suh.float()).all() and torch.isfinite(enc.svh.float()).all()


def test_huge_weight_is_refused_by_name():
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(9)) * 1e5
    with pytest.raises(EncodeError, match=r"big: input-channel scales .* exceed fp16's range"):
        quantize_weight(w, 4, "mcg", backend="numba", name="big")


def test_proxy_error_of_zero_energy():
    z = torch.zeros(16, 16)
    one = torch.ones(16, 16)
    assert proxy_error(z, z) == 0.0 and proxy_error(z, z, torch.eye(16)) == 0.0
    assert proxy_error(z, one) == math.inf and proxy_error(z, one, torch.eye(16)) == math.inf
    assert proxy_error(one, z) == 1.0 and proxy_error(one, 0.5 * one) == 0.25


@pytest.fixture(scope="module")
def zero_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("zero") / "tiny", layers=1)


# only o_proj (ordinary) and down_proj (all zero) are quantized: enough for the path, fast on 2 cores
_KEEP_DENSE = ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"]


def _load_zeroed(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.zero_()
    return model


@pytest.mark.parametrize("mode", ["readwrite", "readonly", "off"])
def test_online_quantization_with_an_all_zero_linear(zero_llama, tmp_path, mode):
    """quantize_model on a model with an all-zero linear works in every cache mode; the zero layer outputs exact
    zeros; readwrite publishes both layers (a second run reads them), readonly and off write nothing."""
    from exl3rt.runtime import Exl3Config, Exl3Linear, quantize_model

    root = tmp_path / "cache"
    model = _load_zeroed(zero_llama)
    cfg = Exl3Config(bits=4, cache_mode=mode, cache_dir=str(root), ignore=_KEEP_DENSE)
    summary = quantize_model(model, cfg, progress=False)
    assert (summary["layers"], summary["misses"]) == (2, 2)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, Exl3Linear)
    x = torch.randn(3, down.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(down(x), torch.zeros(3, down.out_features))
        assert torch.isfinite(model(torch.tensor([[1, 5, 7]])).logits).all()
    if mode != "readwrite":
        assert not root.exists()
        return
    assert len(list(root.rglob("*.safetensors"))) == 2
    again = _load_zeroed(zero_llama)
    summary = quantize_model(again, Exl3Config(bits=4, cache_mode="readonly", cache_dir=str(root),
                                               ignore=_KEEP_DENSE), progress=False)
    assert (summary["hits"], summary["misses"]) == (2, 0)
    assert torch.equal(again.model.layers[0].mlp.down_proj.trellis, down.trellis)


def test_from_pretrained_with_an_all_zero_linear(zero_llama, tmp_path):
    """The transformers load path (what `exl3rt generate` does): a checkpoint holding an all-zero linear loads."""
    import shutil

    from transformers import AutoModelForCausalLM

    import exl3rt.integrations.transformers  # noqa: F401  (registers quant_method "exl3rt")
    from exl3rt.runtime import Exl3Config, Exl3Linear

    src = tmp_path / "zeroed"
    shutil.copytree(zero_llama, src)
    _load_zeroed(zero_llama).save_pretrained(str(src), safe_serialization=True)
    cfg = Exl3Config(bits=3, cache_mode="readwrite", cache_dir=str(tmp_path / "cache"), ignore=_KEEP_DENSE)
    model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=cfg, dtype=torch.float32).eval()
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, Exl3Linear) and model.hf_quantizer.summary()["misses"] == 2
    with torch.no_grad():
        assert torch.equal(down(torch.ones(2, down.in_features)), torch.zeros(2, down.out_features))


def test_quantize_cli_with_an_all_zero_linear(zero_llama, tmp_path, capsys):
    """`exl3rt quantize` of a checkpoint with an all-zero linear: a finite mean proxy error (it printed inf) and
    a layer that reconstructs to exactly zero."""
    import shutil

    from exl3rt.cli.main import main
    from exl3rt.format import Exl3Checkpoint

    src = tmp_path / "zeroed"
    shutil.copytree(zero_llama, src)
    _load_zeroed(zero_llama).save_pretrained(str(src), safe_serialization=True)
    out = tmp_path / "exl3"
    keep = [a for p in ("*.self_attn.*", "*.gate_proj", "*.up_proj") for a in ("--keep", p)]
    assert main(["quantize", str(src), str(out), "--bits", "2", "--head-bits", "16", "--quiet", *keep]) == 0
    assert "mean proxy error 0.00e+00" in capsys.readouterr().out
    down = Exl3Checkpoint(out).load_linear("model.layers.0.mlp.down_proj")
    assert down.reconstruct().shape[1] == 128 and not down.reconstruct().any()   # widths as stored: padded
