"""EncodedLinear: building from stored tensors, and one clear error per malformed input."""

import pytest
import torch

from exl3rt.format import EncodedLinear, FormatError, MARKERS, pack_signs, unpack_signs
from exl3rt.format.encoded import check_bits
from exl3rt.format.random import random_linear

from conftest import golden_codebook, load_golden


def stored(name="10_mcg_K4_256x512_gauss.safetensors"):
    g, _ = load_golden(name)
    keep = ("trellis", "suh", "svh", "mcg", "mul1")
    return {k: v for k, v in g.items() if k in keep}, g


def test_from_golden_state_dict(golden_layer):
    name, g, meta = golden_layer
    t = {k: v for k, v in g.items() if k in ("trellis", "suh", "svh", "mcg", "mul1")}
    lin = EncodedLinear.from_state_dict(t, "layer")
    assert lin.codebook == golden_codebook(g) == meta["codebook"]
    assert float(lin.bits) == float(meta["K"])
    assert (lin.in_features, lin.out_features) == (int(meta["in_features"]), int(meta["out_features"]))
    rt = lin.state_dict("x")
    assert set(rt) == {f"x.{k}" for k in t}
    for k, v in t.items():
        assert torch.equal(rt[f"x.{k}"], v)
    assert torch.allclose(lin.reconstruct(), g["recon"], rtol=0, atol=1e-5 * float(g["recon"].abs().max()))


def make(**over):
    t, _ = stored()
    kw = dict(trellis=t["trellis"], suh=t["suh"], svh=t["svh"], codebook="mcg", name="blk.q_proj")
    kw.update(over)
    return EncodedLinear(**kw)


def test_error_trellis_dtype():
    with pytest.raises(FormatError, match=r"blk.q_proj.trellis: dtype must be torch.int16, got torch.int32"):
        make(trellis=stored()[0]["trellis"].int())


def test_error_trellis_rank():
    with pytest.raises(FormatError, match=r"blk.q_proj.trellis: expected 3 dimensions"):
        make(trellis=stored()[0]["trellis"].reshape(16, -1))


def test_error_trellis_width_not_16k():
    with pytest.raises(FormatError, match=r"last dimension 33 is not 16·K"):
        make(trellis=torch.zeros(16, 32, 33, dtype=torch.int16))


def test_error_padded_width_not_multiple_of_128():
    with pytest.raises(FormatError, match=r"padded input width 64 is not a positive multiple of 128.*zero-pad"):
        make(trellis=torch.zeros(4, 32, 64, dtype=torch.int16), suh=torch.ones(64, dtype=torch.float16))


def test_error_suh_shape():
    with pytest.raises(FormatError, match=r"blk.q_proj.suh: shape must be \[256\]"):
        make(suh=torch.ones(128, dtype=torch.float16))


def test_error_svh_dtype():
    with pytest.raises(FormatError, match=r"blk.q_proj.svh: dtype must be torch.float16, got torch.float32"):
        make(svh=torch.ones(512))


def test_error_nonfinite_scales():
    suh = stored()[0]["suh"].clone()
    suh[3] = float("nan")
    with pytest.raises(FormatError, match=r"blk.q_proj.suh: 1 non-finite value"):
        make(suh=suh)


def test_error_bias_shape():
    with pytest.raises(FormatError, match=r"blk.q_proj.bias: shape must be \[512\]"):
        make(bias=torch.zeros(500, dtype=torch.float16))


def test_error_unknown_codebook():
    with pytest.raises(FormatError, match="unknown codebook 'qtip'"):
        make(codebook="qtip")


def test_error_half_bits_need_mul1():
    t, _ = stored("21_mul1_K2.5_256x512_gauss.safetensors")
    with pytest.raises(FormatError, match=r"half-integer K = 2.5 requires the mul1 codebook"):
        make(trellis=t["trellis"], codebook="mcg")


def test_error_logical_width_inconsistent():
    with pytest.raises(FormatError, match=r"in_features=100 pads to 128, but the trellis holds 256"):
        make(in_features=100)


def test_logical_widths_trim_reconstruction():
    lin = make(in_features=200, out_features=400)
    assert lin.reconstruct().shape == (200, 400) and lin.reconstruct(trim=False).shape == (256, 512)


def test_error_bits_do_not_follow_from_shape():
    with pytest.raises(FormatError, match=r"bits=5 does not follow from the trellis shape \(16, 32, 64\)"):
        check_bits(make(), 5)
    check_bits(make(), 4)


def test_error_marker_value():
    t, _ = stored()
    t["mcg"] = torch.tensor(0x12345678, dtype=torch.int32)
    with pytest.raises(FormatError, match=r"q.mcg: marker value 0x12345678 is not the locked multiplier 0xcbac1fed"):
        EncodedLinear.from_state_dict(t, "q")


def test_error_marker_dtype():
    t, _ = stored()
    t["mcg"] = torch.tensor(MARKERS["mcg"], dtype=torch.int64)
    with pytest.raises(FormatError, match=r"q.mcg: codebook marker must be an int32 scalar"):
        EncodedLinear.from_state_dict(t, "q")


def test_error_two_markers():
    t, _ = stored()
    t["mul1"] = torch.tensor(MARKERS["mul1"], dtype=torch.int32)
    with pytest.raises(FormatError, match="both .mcg and .mul1 markers"):
        EncodedLinear.from_state_dict(t, "q")


def test_error_missing_scales():
    t, _ = stored()
    del t["svh"]
    with pytest.raises(FormatError, match=r"q.svh: missing \(nor legacy q.sv\)"):
        EncodedLinear.from_state_dict(t, "q")


def test_no_marker_is_3inst_and_fp32_bias_is_cast():
    t, _ = stored()
    del t["mcg"]
    t["bias"] = torch.randn(512)
    lin = EncodedLinear.from_state_dict(t, "q")
    assert lin.codebook == "3inst" and lin.bias.dtype == torch.float16


def test_legacy_sign_vectors():
    g = torch.Generator().manual_seed(3)
    words = torch.randint(-32768, 32768, (16,), dtype=torch.int16, generator=g)
    signs = unpack_signs(words)
    for j in range(16):
        for i in range(16):
            bit = ((int(words[j]) & 0xFFFF) >> i) & 1
            assert float(signs[16 * j + i]) == 1 - 2 * bit
    assert torch.equal(pack_signs(signs), words)
    t, _ = stored()
    t["su"], t["sv"] = pack_signs(torch.sign(t.pop("suh").float())), pack_signs(torch.sign(t.pop("svh").float()))
    lin = EncodedLinear.from_state_dict(t, "q")
    assert set(lin.suh.abs().tolist()) == {1.0} and lin.suh.shape == (256,) and lin.svh.shape == (512,)


def test_random_linear_pads_and_validates():
    lin = random_linear(200, 300, 3.5, "mul1", seed=1, bias=True)
    assert (lin.in_padded, lin.out_padded, lin.in_features, lin.out_features) == (256, 384, 200, 300)
    assert lin.trellis.shape == (16, 24, 56) and lin.bits == 3.5
    assert lin.nbytes == 16 * 24 * 56 * 2 + 2 * (256 + 384 + 384) + 4
