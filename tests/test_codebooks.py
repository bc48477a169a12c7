"""Codebooks against exllamav3's own tables and the spec's whole-LUT checks (exl3_format.md §8.1)."""

import hashlib

import numpy as np
import pytest
import torch

from exl3rt.format import FormatError, codebook_values, decode_states
from exl3rt.format.codebooks import codebook_values_fp16

from conftest import load_golden

GOLDEN_TABLES, _ = load_golden("codebooks.safetensors")


@pytest.mark.parametrize("cb", ["3inst", "mcg", "mul1"])
def test_codebook_bit_exact_with_reference(cb):
    ours = codebook_values(cb)
    assert ours.dtype == torch.float32 and ours.shape == (65536,)
    assert torch.equal(ours.view(torch.int32), GOLDEN_TABLES[cb].view(torch.int32))


# fp16 bits of states 0..7, and (sum, sha256 prefix, rms, distinct) of the whole fp16 LUT
SPEC = {
    "3inst": ("3a25 bb5b 3b74 34b6 3924 2cb0 404f b906", 13.791504, "ad88de2dcff5bb05fff2faec37cceceb", 1.243711, 10598),
    "mcg": ("3f60 304e ba13 3ab8 3952 b75f bea4 bc71", -2.419922, "95383563929baa9d1ae5de0be2249028", 1.244112, 10746),
    "mul1": ("c2e8 3921 b72d 3239 bb29 b409 bd5e b997", -126.555870, "bc48d02cb1c14939dc47b90f870dd689", 1.000312, 913),
}


@pytest.mark.parametrize("cb", sorted(SPEC))
def test_codebook_whole_lut_checks(cb):
    first, total, sha, rms, distinct = SPEC[cb]
    lut16 = codebook_values_fp16(cb)
    bits = [f"{int(b) & 0xFFFF:04x}" for b in lut16[:8].view(torch.int16)]
    assert " ".join(bits) == first
    raw = lut16.numpy().astype("<f2").tobytes()
    assert hashlib.sha256(raw).hexdigest().startswith(sha)
    v = lut16.double()
    assert abs(float(v.sum()) - total) < 5e-6
    assert abs(float(v.square().mean().sqrt()) - rms) < 5e-7
    assert len(np.unique(lut16.numpy())) == distinct


@pytest.mark.parametrize("state,values", [
    (0x0000, (0.76806640625, 1.84375, -3.453125)),
    (0x1234, (-2.19921875, 1.5146484375, -0.5771484375)),
    (0x8000, (-0.498046875, -0.63525390625, -0.8681640625)),
    (0xFFFF, (-0.158203125, 0.85009765625, -0.6513671875)),
])
def test_selected_states(state, values):
    for cb, want in zip(("3inst", "mcg", "mul1"), values):
        assert float(codebook_values(cb)[state]) == want
        # int16 input is read as uint16
        s16 = torch.tensor([state - 65536 if state >= 32768 else state], dtype=torch.int16)
        assert float(decode_states(s16, cb)[0]) == want


def test_mul1_needs_single_rounding():
    """Rounding after the multiply and again after the add differs from the FMA for 60,326 states."""
    x = (torch.arange(65536, dtype=torch.int64) * 0x83DCD12D) & 0xFFFFFFFF
    bytesum = sum((x >> s) & 0xFF for s in (0, 8, 16, 24))
    h = (1024 + bytesum).to(torch.float16)
    k = torch.tensor([0x1EEE], dtype=torch.int16).view(torch.float16)
    b = torch.tensor([0xC931 - 65536], dtype=torch.int16).view(torch.float16)
    twice = (h * k).to(torch.float16) + b  # fp16 ops: two roundings
    assert int((twice != codebook_values_fp16("mul1")).sum()) == 60326


def test_unknown_codebook_is_a_clear_error():
    with pytest.raises(FormatError, match="unknown codebook 'mcg2'.*3inst, mcg, mul1"):
        codebook_values("mcg2")
