"""The generated per-lane inline PTX (kernels/lane_decode.py), executed by a PTX emulator, equals
``format.reconstruct.decode_stream`` bit for bit (every codebook, every K the format allows)."""

import numpy as np
import pytest
import torch

from exl3rt.format.bits import words16_per_tile
from exl3rt.format.reconstruct import decode_stream
from exl3rt.kernels.decode import CB_AFFINE, CODEBOOK_IDS
from exl3rt.kernels.lane_decode import lane_decode_ptx, lane_shift, lane_span_words, lane_words
from ptx_emulator import run_ptx

CASES = [(cb, k) for cb in ("mcg", "3inst") for k in (1, 2, 3, 4, 5, 6, 7, 8)] + \
        [("mul1", k) for k in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8)]


@pytest.mark.parametrize("codebook,bits", CASES)
def test_lane_decode_ptx_matches_decode_stream(codebook, bits):
    ka, half = int(bits), 0 if float(bits).is_integer() else 1
    cb = CODEBOOK_IDS[codebook]
    mult, add = CB_AFFINE[cb]
    text, cons, n_in = lane_decode_ptx(ka, half, cb, mult, add)
    assert cons.count("=r") == 4 and n_in == lane_span_words(ka, half) + 2
    g = torch.Generator().manual_seed(int(bits * 10) + cb)
    tr = torch.randint(-32768, 32768, (1, 2, words16_per_tile(bits)), dtype=torch.int16, generator=g)
    ref = decode_stream(tr, bits, codebook).to(torch.float16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    words = tr.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    for b in range(2):
        for lane in (range(32) if b == 0 else (0, 1, 7, 31)):
            ins = [int(words[0, b, i]) for i in lane_words(lane, ka, half)]
            out = run_ptx(text, ins + [lane_shift(lane, ka, half), 0x3B603B60], 4)
            got = [(o >> (16 * h)) & 0xFFFF for o in out for h in (0, 1)]
            exp = [int(v) for v in ref[0, b, 8 * lane:8 * lane + 8]]
            assert got == exp, (codebook, bits, b, lane)


def test_lane_decode_ptx_instruction_budget():
    """The K = 4 MCG block stays lean: no normalizing shifts, ≤ 2 instructions per window."""
    text, _, _ = lane_decode_ptx(4, 0, 1, *CB_AFFINE[1])
    body = [s for s in text.split(";") if s.strip() and not s.strip().startswith((".reg", "{", "}"))]
    assert not any("shf" in s and "$6" in s for s in body)
    windows = [s for s in body if s.strip().split()[0] in ("shr.b32", "and.b32", "prmt.b32", "shf.r.clamp.b32")
               and "{" not in s]
    assert len(windows) <= 16


def _window_instructions(ka, half):
    text = lane_decode_ptx(ka, half, 1, CB_AFFINE[1][0], 0)[0]
    ops = [ln.split(" ")[0] for ln in text.splitlines()]
    norm = lane_span_words(ka, half) if (8 * ka + 4 * half) % 32 else 0
    return sum(op in ("shr.b32", "shf.r.clamp.b32", "and.b32", "prmt.b32") for op in ops) - norm


@pytest.mark.parametrize("ka,half", [(k, 0) for k in range(1, 9)] + [(1, 1), (2, 1), (3, 1)])
def test_plan_windows_shares_extracts(ka, half):
    """Every window is one and/prmt/shr of an extract at offset 0/8/16 below it; each extract that is not a
    word costs one shift, and the plan needs no more of them than cutting each window on its own."""
    from exl3rt.kernels.lane_decode import plan_windows, window_end
    plan = plan_windows(ka, half)
    offsets = [window_end(p, ka, half) - plan[p] for p in range(8)]
    assert all(o in (0, 8, 16) for o in offsets)
    shifts = len({e for e in plan.values() if e % 32})
    assert _window_instructions(ka, half) == 8 + shifts
    alone = sum(1 for p in range(8) if not any((window_end(p, ka, half) - o) % 32 == 0 and window_end(p, ka, half) >= o
                                               for o in (0, 8, 16)))
    assert shifts <= alone
    if (ka, half) in ((2, 0), (4, 0)):                  # windows 8 / 16 bits apart share extracts
        assert shifts == 3 and shifts < alone


@pytest.mark.parametrize("codebook,bits", [(cb, k) for cb in ("mcg", "3inst") for k in (1, 2, 3, 4, 6, 8)])
def test_lane_halves_sum_to_the_codebook_value(codebook, bits):
    """``halves=True``: eight outputs, position p's f16x2 word whose two halves, summed exactly and rounded
    once to fp16, are ``decode_stream``'s value of the position (the mma multiplies both halves by x')."""
    ka = int(bits)
    cb = CODEBOOK_IDS[codebook]
    mult, add = CB_AFFINE[cb]
    text, cons, n_in = lane_decode_ptx(ka, 0, cb, mult, add, halves=True)
    assert cons.count("=r") == 8 and n_in == lane_span_words(ka, 0) + 2
    assert "add.rn.f16" not in text
    g = torch.Generator().manual_seed(ka * 7 + cb)
    tr = torch.randint(-32768, 32768, (1, 1, words16_per_tile(bits)), dtype=torch.int16, generator=g)
    ref = decode_stream(tr, bits, codebook).to(torch.float16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    words = tr.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    f16 = lambda b: np.array([b], dtype=np.uint16).view(np.float16)[0]  # noqa: E731
    for lane in range(32):
        ins = [int(words[0, 0, i]) for i in lane_words(lane, ka, 0)]
        out = run_ptx(text, ins + [lane_shift(lane, ka, 0), 0x3B603B60], 8)
        exact = [np.float32(f16(o & 0xFFFF)) + np.float32(f16(o >> 16)) for o in out]   # exact in fp32
        got = [int(np.array([np.float16(v)]).view(np.uint16)[0]) for v in exact]
        assert got == [int(v) for v in ref[0, 0, 8 * lane:8 * lane + 8]], (codebook, bits, lane)


def test_lane_halves_rejects_mul1():
    with pytest.raises(ValueError, match="MUL1"):
        lane_decode_ptx(4, 0, 2, *CB_AFFINE[2], halves=True)
