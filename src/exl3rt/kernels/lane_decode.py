"""The per-lane trellis decode of the mma GEMV as one inline-PTX block (text generated per K and codebook).

In the warp-level mma GEMV (:mod:`exl3rt.kernels.mma`) lane L of a warp decodes the 8 consecutive
stream positions ``8L .. 8L + 7`` of a 16×16 tile: exactly its ``mma.m16n8k16`` B fragments of the
tile's two n8 halves, four ``f16x2`` registers. :func:`lane_decode_ptx` writes that decode as one
PTX block whose instruction choice is fixed here rather than left to Triton's code generation:

* inputs: the lane's ``NWL`` raw trellis words (the tile's ring, in order), its normalizing shift
  ``R`` (its last bit is ``R`` bits above bit 0 of the last word) and the MCG/3INST xor constant
  ``0x3B603B60`` in a register (a LOP3 takes one immediate);
* normalization: ``shf.r.clamp`` funnel shifts by ``R`` (none when every lane ends on a word: K = 4,
  8), after which position p's 16-bit window ends ``D_p = (7 − p)·KA + HALF·(4 − ⌊(p + 1)/2⌋)``
  bits before the end — a compile-time constant;
* windows (:func:`plan_windows`): each 16-bit window is cut from a 32-bit extract at offset 0, 8 or 16
  by one ``and``, ``prmt`` (zero fill) or ``shr``; an extract is a word itself or one funnel shift, and
  windows 8 or 16 bits apart share one (K = 4 and K = 2: 11 instructions for the 8 windows instead
  of 13 and 14);
* MCG/3INST: ``mul.lo``/``mad.lo`` by the codebook multiplier, one ``lop3`` for
  ``(x & 0x8FFF8FFF) ^ 0x3B603B60``, ``add.rn.f16`` of the two halves (one HADD2 with half
  selectors per weight, off the integer pipe) and one ``mov {lo, hi}`` (PRMT) per pair;
* MUL1: ``dp4a`` byte sums into 0x6400, one ``prmt`` per pair, one ``fma.rn.f16x2``.

The arithmetic is that of ``format.codebooks.decode_states`` bit for bit; ``tests/ptx_emulator.py``
executes the generated text on the CPU and CI compares it with ``format.reconstruct.decode_stream``
for every K and codebook.
"""

from __future__ import annotations

from functools import lru_cache

MCG_MASK = 0x8FFF8FFF
MCG_XOR = 0x3B603B60
MUL1_K2 = 0x1EEE1EEE   # fp16x2 scale
MUL1_C2 = 0xC931C931   # fp16x2 bias


def window_end(p: int, ka: int, half: int) -> int:
    """D_p: bits between the end of position p's 16-bit window and the end of the lane's last position."""
    return (7 - p) * ka + half * (4 - (p + 1) // 2)


def lane_span_words(ka: int, half: int) -> int:
    """NWL: 32-bit words holding a lane's 8 windows (7·KA + 4·HALF + 16 bits) at any lane's alignment."""
    span = 7 * ka + 4 * half + 16
    need = 0
    for lane in range(32):
        e = (8 * lane + 8) * ka + half * (4 * lane + 4)
        need = max(need, (e - 1) // 32 - (e - span) // 32 + 1)
    return need


def needs_shift(ka: int, half: int) -> bool:
    """False when every lane's last bit ends a word (K = 4, 8): no normalizing funnel shift."""
    return (8 * ka + 4 * half) % 32 != 0


@lru_cache(maxsize=None)
def lane_decode_ptx(ka: int, half: int, cb: int, mult: int, add: int, halves: bool = False) -> tuple[str, str, int]:
    """(PTX text, constraint string, number of inputs) of one lane's decode.

    Operands: ``$0..$3`` the four f16x2 B registers (positions 0/1, 2/3, 4/5, 6/7: low half = even
    position), ``$4 .. $(3 + NWL)`` the raw words, then ``R`` and the xor constant.
    ``cb``: 0 = 3INST, 1 = MCG, 2 = MUL1 (``decode.CODEBOOK_IDS``); ``mult``/``add``: the codebook's
    first step (``decode.CB_AFFINE``).

    ``halves`` (MCG/3INST only): no fp16 add — ``$0..$7`` are the eight masked words
    ``(x & 0x8FFF8FFF) ^ 0x3B603B60`` of positions 0..7, each an f16x2 whose two halves sum to the
    position's codebook value before its fp16 rounding (the mma multiplies both halves by the same x'
    element: :func:`exl3rt.kernels.mma._tiles_swapped`); the raw words then start at ``$8``.
    """
    if halves and cb == 2:
        raise ValueError("lane_decode_ptx: halves applies to the MCG and 3INST codebooks, not MUL1")
    nout = 8 if halves else 4
    nwl = lane_span_words(ka, half)
    raw = [f"${nout + i}" for i in range(nwl)]
    rsh = f"${nout + nwl}"
    xorc = f"${nout + 1 + nwl}"
    lines: list[str] = []
    regs32: list[str] = []
    regs16: list[str] = []

    def r32(name: str) -> str:
        regs32.append(name)
        return name

    def r16(name: str) -> str:
        regs16.append(name)
        return name

    # normalized words: nf[NWL-1] ends at the lane's last bit
    if needs_shift(ka, half):
        nf = [r32(f"n{i}") for i in range(nwl)]
        lines.append(f"shr.b32 n0, {raw[0]}, {rsh};")
        for i in range(1, nwl):
            lines.append(f"shf.r.clamp.b32 n{i}, {raw[i]}, {raw[i - 1]}, {rsh};")
    else:
        nf = raw

    states: list[str] = []
    extracts = plan_windows(ka, half)
    made: dict[int, str] = {}
    for e in sorted(set(extracts.values())):
        j, d = nwl - 1 - e // 32, e % 32
        if d == 0:
            made[e] = nf[j]                      # a word itself
        else:
            v = r32(f"e{e}")
            if j == 0:
                lines.append(f"shr.b32 {v}, {nf[0]}, {d};")
            else:
                lines.append(f"shf.r.clamp.b32 {v}, {nf[j]}, {nf[j - 1]}, {d};")
            made[e] = v
    for p in range(8):
        e = extracts[p]
        v, o = made[e], window_end(p, ka, half) - e
        s = r32(f"s{p}")
        if o == 16:
            lines.append(f"shr.b32 {s}, {v}, 16;")
        elif o == 8:
            lines.append(f"prmt.b32 {s}, {v}, 0, 0x4421;")
        else:
            lines.append(f"and.b32 {s}, {v}, 0xFFFF;")
        states.append(s)

    for q in range(4):
        s0, s1 = states[2 * q], states[2 * q + 1]
        x0, x1 = (f"${2 * q}", f"${2 * q + 1}") if halves else (r32(f"x{2 * q}"), r32(f"x{2 * q + 1}"))
        for s, x in ((s0, x0), (s1, x1)):
            if add:
                lines.append(f"mad.lo.u32 {x}, {s}, 0x{mult:08X}, 0x{add:08X};")
            else:
                lines.append(f"mul.lo.u32 {x}, {s}, 0x{mult:08X};")
        if halves:
            for x in (x0, x1):
                lines.append(f"lop3.b32 {x}, {x}, 0x{MCG_MASK:08X}, {xorc}, 0x6A;")
        elif cb == 2:
            lines.append(f"dp4a.u32.u32 {x0}, {x0}, 0x01010101, 0x6400;")
            lines.append(f"dp4a.u32.u32 {x1}, {x1}, 0x01010101, 0x6400;")
            lines.append(f"prmt.b32 {x0}, {x0}, {x1}, 0x5410;")
            lines.append(f"fma.rn.f16x2 ${q}, {x0}, k2, c2;")
        else:
            h = [r16(f"h{q}_{i}") for i in range(4)]
            v0, v1 = r16(f"v{2 * q}"), r16(f"v{2 * q + 1}")
            for x, (lo, hi), v in ((x0, h[:2], v0), (x1, h[2:], v1)):
                lines.append(f"lop3.b32 {x}, {x}, 0x{MCG_MASK:08X}, {xorc}, 0x6A;")
                lines.append(f"mov.b32 {{{lo}, {hi}}}, {x};")
                lines.append(f"add.rn.f16 {v}, {lo}, {hi};")
            lines.append(f"mov.b32 ${q}, {{{v0}, {v1}}};")

    decl = []
    if cb == 2:
        regs32 += ["k2", "c2"]
        lines.insert(0, f"mov.b32 c2, 0x{MUL1_C2:08X};")
        lines.insert(0, f"mov.b32 k2, 0x{MUL1_K2:08X};")
    if regs32:
        decl.append(".reg .b32 " + ", ".join(regs32) + ";")
    if regs16:
        decl.append(".reg .b16 " + ", ".join(regs16) + ";")
    text = "{\n" + "\n".join(decl + lines) + "\n}"
    constraints = ",".join(["=r"] * nout + ["r"] * (nwl + 2))
    return text, constraints, nwl + 2


@lru_cache(maxsize=None)
def plan_windows(ka: int, half: int) -> dict[int, int]:
    """Position p -> the bit offset e (from the end of the lane's normalized words) of the 32-bit extract its
    window is cut from, at offset D_p − e ∈ {0, 8, 16} (one ``and``, ``prmt`` or ``shr``).

    An extract costs one funnel shift unless it is a word itself (e a multiple of 32); windows 8 or 16 bits
    apart share one (K = 2 and K = 4: 3 shifted extracts for the 8 windows). Exhaustive over the
    ≤ 3⁸ assignments: the fewest funnel shifts (ties: the lowest extracts)."""
    from itertools import product

    ends = [window_end(p, ka, half) for p in range(8)]
    choices = [[d - o for o in (0, 8, 16) if d >= o] for d in ends]
    best = None
    for pick in product(*choices):
        cost = (len({e for e in pick if e % 32}), sum(pick))
        if best is None or cost < best[0]:
            best = (cost, pick)
    return dict(enumerate(best[1]))


def lane_shift(lane: int, ka: int, half: int) -> int:
    """R: how far the lane's last bit + 1 lies below the end of its last word."""
    e = (8 * lane + 8) * ka + half * (4 * lane + 4)
    return 32 * ((e - 1) // 32 + 1) - e


def lane_words(lane: int, ka: int, half: int) -> list[int]:
    """Word indices (inside the tile's ring of ``8·KA + 4·HALF`` words) of the lane's NWL words."""
    nw = 8 * ka + 4 * half
    e = (8 * lane + 8) * ka + half * (4 * lane + 4)
    last = (e - 1) // 32
    nwl = lane_span_words(ka, half)
    return [(last - nwl + 1 + i + nw) % nw for i in range(nwl)]


__all__ = ["lane_decode_ptx", "plan_windows", "lane_span_words", "lane_shift", "lane_words", "window_end", "needs_shift"]
