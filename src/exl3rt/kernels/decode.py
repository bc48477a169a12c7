"""The trellis decode in Triton: codebook values of 16-bit states, and Q decoded to fp16 in memory.

``decode_values`` turns trellis states into codebook values; the mma GEMV (``mma.py``) runs the same
arithmetic per lane. ``decode_kernel`` writes Q itself (fp16 ``[in_p, out_p]``, bit-exact with
``format.reconstruct.decode``) for the large-row path, where cuBLAS then computes ``x'·Q``.

Decode geometry (one tile = a tail-biting ring of 256·K bits, ``format/bitstream.py``)
-------------------------------------------------------------------------------------
Split the 256 stream positions into NG groups of GP positions: GP = 32 for integer K (32
positions consume exactly K u32 words), GP = 64 for K = KA + ½ (64 positions consume 2·KA + 1
words). Group G of a tile starts at a word boundary, word ``G·WG`` (WG = words per group).
Inside a group, position u's window ends at ring bit ``S(u) = (u+1)·KA + HALF·⌊(u+1)/2⌋``; it
lies in word ``i1(u) = ⌊(S−1)/32⌋`` (and the word before it when the right-shift
``s(u) = 32·(i1+1) − S`` exceeds 16). All of these are compile-time constants, so a program
holding ``[NT n-tiles, NG groups]`` elements loads each word once (``WG + 1`` loads per group,
the extra one being the word before the group, tail-biting at G = 0), and for every position
does::

    state = funnel(prev, cur, s) & 0xFFFF           # SHF (+ LOP3) ; s <= 16: SHF/LOP3 only
    x     = state * M (+ A)                          # IMAD (3inst: the add folds into IMAD)
    mcg/3inst: v = f16(lo(x & 0x8FFF8FFF ^ 0x3B603B60)) + f16(hi(...))    # LOP3, HADD2, HADD2.F32
    mul1:      v = fma.f16(f16(dp4a(x, 0x01010101, 0x6400)), 1/…, bias)   # IDP4A, HFMA2, HADD2.F32

The tile permutation (tensor-core order, ``format/tiles.py``) factors through the group: with
``t = GP·G + u``, the row of Q inside the tile is ``r(u) = 2·((u>>3)&3) + (u&1) + 8·((u>>1)&1)``
(u only) and the column is ``c = (GP/32)·G + (u>>5) + 8·((u>>2)&1)``; ``_decode_tile`` joins the
values of a group along one axis per bit of u and permutes them to natural order once.

On the GPU (``ASM=True``) the fp16 half-sum / mul1 dp4a+fma use ``tl.inline_asm_elementwise``
(the interpreter runs the same arithmetic in plain Triton ops, bit-identical).
"""

from __future__ import annotations

from ..format.codebooks import INST3_ADDEND, INST3_MULTIPLIER, MCG_MULTIPLIER, MUL1_MULTIPLIER

CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
#: per codebook id: (multiplier, addend) of the first uint32 step
CB_AFFINE = {0: (INST3_MULTIPLIER, INST3_ADDEND), 1: (MCG_MULTIPLIER, 0), 2: (MUL1_MULTIPLIER, 0)}
MUL1_SCALE = 0.0067672729492187500   # fp16 0x1EEE
MUL1_BIAS = -10.3828125              # fp16 0xC931

from ._triton import HAVE_TRITON, tl, triton  # noqa: E402

if HAVE_TRITON:
    MUL1_SCALE_C = tl.constexpr(MUL1_SCALE)
    MUL1_BIAS_C = tl.constexpr(MUL1_BIAS)

    @triton.jit
    def _extract(prev, cur, S: tl.constexpr):
        """16-bit window ending at bit S (1..32) of ``cur`` (MSB-first), reaching into ``prev``."""
        if S == 32:
            st = cur & 0xFFFF
        elif S >= 16:
            st = (cur >> (32 - S)) & 0xFFFF
        else:
            st = ((cur >> (32 - S)) | (prev << S)) & 0xFFFF
        return st

    @triton.jit
    def decode_values(st, CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr, ASM: tl.constexpr):
        """Codebook value (fp32 holding the exact fp16 value) of uint32 states ``st`` (< 2^16)."""
        if ADD == 0:
            x = st * MULT
        else:
            x = st * MULT + ADD
        if CB == 2:
            if ASM:
                v = tl.inline_asm_elementwise(
                    "{ .reg .b32 t; .reg .b16 l, h, k, c;\n"
                    "dp4a.u32.u32 t, $1, 0x01010101, 0x6400;\n"
                    "mov.b32 {l, h}, t;\n"
                    "mov.b16 k, 0x1EEE;\n"
                    "mov.b16 c, 0xC931;\n"
                    "fma.rn.f16 l, l, k, c;\n"
                    "cvt.f32.f16 $0, l; }",
                    "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
            else:
                bsum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
                h = (bsum + 1024).to(tl.float32)
                v = (h * MUL1_SCALE_C + MUL1_BIAS_C).to(tl.float16).to(tl.float32)  # exact, one rounding
        else:
            y = (x & 0x8FFF8FFF) ^ 0x3B603B60
            if ASM:
                v = tl.inline_asm_elementwise(
                    "{ .reg .b16 l, h;\n"
                    "mov.b32 {l, h}, $1;\n"
                    "add.rn.f16 l, l, h;\n"
                    "cvt.f32.f16 $0, l; }",
                    "=r,r", [y], dtype=tl.float32, is_pure=True, pack=1)
            else:
                lo = (y & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
                hi = (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
                v = (lo + hi).to(tl.float16).to(tl.float32)  # exact fp32 sum, one fp16 rounding
        return v

    @triton.jit
    def _decode_tile(wrow, base, poff, KA: tl.constexpr, HALF: tl.constexpr, CB: tl.constexpr,
                     MULT: tl.constexpr, ADD: tl.constexpr, NT: tl.constexpr, ASM: tl.constexpr):
        """Q's rows of one k-tile for NT n-tiles: fp16 ``[16, NT·16]`` (row r, natural column 16·b + c).

        ``wrow`` points at the k-tile's first word, ``base``/``poff`` ([NT, NG]) are the word offsets of
        each group and of the word before it. The GP values of each group are joined into a tensor
        with one axis per bit of u ([NT, G, b0, b1, ...]), permuted to [r, (b, c)] and reshaped:
        r = 8·b1 + 4·b4 + 2·b3 + b0, c = 8·b2 + (GP/32)·G + b5 (b5: half-integer K only).
        """
        GP: tl.constexpr = 32 * (1 + HALF)
        WG: tl.constexpr = (GP * KA) // 32 + HALF
        prev = tl.load(wrow + poff).to(tl.uint32, bitcast=True)
        vs = ()
        for i in tl.static_range(WG):
            cur = tl.load(wrow + base + i).to(tl.uint32, bitcast=True)
            for u in tl.static_range(GP):
                if (((u + 1) * KA + HALF * ((u + 1) // 2)) - 1) // 32 == i:
                    st = _extract(prev, cur, (u + 1) * KA + HALF * ((u + 1) // 2) - 32 * i)
                    vs = vs + (decode_values(st, CB, MULT, ADD, ASM).to(tl.float16),)
            prev = cur
        t1 = ()
        for k in tl.static_range(GP // 2):
            t1 = t1 + (tl.join(vs[2 * k], vs[2 * k + 1]),)                   # new axis: bit0 of u
        t2 = ()
        for k in tl.static_range(GP // 4):
            t2 = t2 + (tl.join(t1[2 * k], t1[2 * k + 1]),)                   # bit1
        t3 = ()
        for k in tl.static_range(GP // 8):
            t3 = t3 + (tl.join(t2[2 * k], t2[2 * k + 1]),)                   # bit2
        t4 = ()
        for k in tl.static_range(GP // 16):
            t4 = t4 + (tl.join(t3[2 * k], t3[2 * k + 1]),)                   # bit3
        if HALF:
            t6 = tl.join(tl.join(t4[0], t4[1]), tl.join(t4[2], t4[3]))       # bit4, bit5
            t = tl.permute(t6, (3, 6, 5, 2, 0, 4, 1, 7))                     # [b1 b4 b3 b0 | b b2 G b5]
        else:
            t5 = tl.join(t4[0], t4[1])                                        # bit4
            t = tl.permute(t5, (3, 6, 5, 2, 0, 4, 1))                        # [b1 b4 b3 b0 | b b2 G]
        return tl.reshape(t, [16, NT * 16])

    @triton.jit
    def decode_kernel(w_ptr, q_ptr, in_tiles, tn_total, k_per, KA: tl.constexpr, HALF: tl.constexpr,
                       CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr, NT: tl.constexpr,
                       ASM: tl.constexpr):
        """Q[16a + r, 16b + c] (fp16, row-major [in_p, out_p]) for NT n-tiles and k_per k-tiles:
        one :func:`_decode_tile` per k-tile, stored as whole rows (coalesced)."""
        GP: tl.constexpr = 32 * (1 + HALF)
        NG: tl.constexpr = 256 // GP
        WG: tl.constexpr = (GP * KA) // 32 + HALF
        NW: tl.constexpr = NG * WG
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        b = pid_n * NT + tl.arange(0, NT)
        g = tl.arange(0, NG)
        base = b[:, None] * NW + g[None, :] * WG
        poff = b[:, None] * NW + (g[None, :] * WG + (NW - 1)) % NW
        out_p = tn_total * 16
        rr = tl.arange(0, 16)
        nn = pid_n * NT * 16 + tl.arange(0, NT * 16)
        a0 = pid_k * k_per
        a1 = tl.minimum(a0 + k_per, in_tiles)
        for a in range(a0, a1):
            t = _decode_tile(w_ptr + a * tn_total * NW, base, poff, KA, HALF, CB, MULT, ADD, NT, ASM)
            tl.store(q_ptr + (a * 16 + rr)[:, None] * out_p + nn[None, :], t)  # int32: in_p·out_p < 2^31


def interpreted() -> bool:
    """True when these kernels were defined for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return HAVE_TRITON and type(decode_kernel).__name__ == "InterpretedFunction"
