"""Warp-level tensor-core GEMV for 1–16 rows: each lane decodes its own mma fragment.

The EXL3 tile order *is* the ``mma.m16n8k16`` B-fragment order (``format/tiles.py``): stream
position ``t = 8·L + p`` of a tile (lane L = 0..31, p = 0..7) holds row
``r = 2·(L mod 4) + (p & 1) + 8·((p >> 1) & 1)`` and column ``c = L div 4 + 8·(p >> 2)`` — exactly
the B-operand registers of lane L for the two n8 halves of the tile. So a warp multiplies one
16×16 tile with two ``mma.sync.m16n8k16`` after each lane decodes 8 consecutive stream positions:

* lane L's bits are the window ``[S(8L) − 16, E_L)`` of the tile's ring, ``E_L = S(8L + 8)``,
  ``S(n) = n·KA + HALF·⌊n/2⌋`` (``7·KA + 4·HALF + 16`` bits, ``NWL`` words: 2 for K ≤ 4, 3 up to 8);
* the lane loads those words once per tile and shifts them right by ``R = 32·⌈E_L/32⌉ − E_L`` (a
  per-lane constant, 64-bit funnel shifts), after which position p's 16-bit window ends
  ``d_p = (7 − p)·KA + HALF·(4 − ⌊(p + 1)/2⌋)`` bits before the end: compile-time shifts again;
* states → codebook values (``gemv._decode`` arithmetic); on the GPU two positions are packed
  into one ``f16x2`` register (``prmt`` + ``add.rn.f16x2`` for MCG/3INST, ``dp4a`` + ``prmt`` +
  ``fma.rn.f16x2`` for MUL1);
* x' (fp16) is the A operand: lane L loads ``x'[g, 16a + 2c + {0, 1, 8, 9}]`` and the same for
  row ``g + 8`` (g = L div 4, c = L mod 4): 4 32-bit loads per k-tile, shared by the lane's tiles.

Rows 1–16 cost the same decode; the fp32 accumulators are the mma C fragments and go to the
split-K partials ``z[split, rows, out_p]`` (summed and rotated by the post-pass).

The program holds ``[NT, 32]`` elements (NT tiles × 32 lanes, one warp per ``NT/num_warps`` tiles);
the mma needs element ``[t, L]`` to live in lane L, which is Triton's default blocked layout for
this shape when no load is vectorized: the word offsets are gathers, and the x' offsets are
multiplied by a runtime ``one`` so that no contiguity can be proven. ``tests/test_kernels.py`` checks
the compiled kernel against ``format.reconstruct`` on the GPU.

Without inline PTX (``ASM = False``: the interpreter, or ``EXL3RT_KERNEL_NO_ASM``) the same per-lane
decode feeds a plain-Triton emulation of the two mma (gathered x' values, one FMA per weight and row).
"""

from __future__ import annotations

from ._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from .gemv import _decode

    @triton.jit
    def _window(n_prev, n_cur, D: tl.constexpr):
        """16-bit window ending D bits (mod 32) before the end of ``n_cur`` (reaching into ``n_prev``)."""
        if D == 0:
            st = n_cur & 0xFFFF
        elif D <= 16:
            st = (n_cur >> D) & 0xFFFF
        else:
            st = ((n_cur >> D) | (n_prev << (32 - D))) & 0xFFFF
        return st

    @triton.jit
    def _pack_pair(s0, s1, xorc, CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr):
        """f16x2 register (as int32) holding the codebook values of states s0 (low half) and s1.

        ``xorc`` holds 0x3B603B60 in a register (computed from a runtime value, so that it is not
        folded into an immediate): ``(x & 0x8FFF8FFF) ^ 0x3B603B60`` is then one ``lop3``.
        """
        if ADD == 0:
            x0 = s0 * MULT
            x1 = s1 * MULT
        else:
            x0 = s0 * MULT + ADD
            x1 = s1 * MULT + ADD
        if CB == 2:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 a, b, k, c;\n"
                "dp4a.u32.u32 a, $1, 0x01010101, 0x6400;\n"
                "dp4a.u32.u32 b, $2, 0x01010101, 0x6400;\n"
                "prmt.b32 a, a, b, 0x5410;\n"
                "mov.b32 k, 0x1EEE1EEE;\n"
                "mov.b32 c, 0xC931C931;\n"
                "fma.rn.f16x2 $0, a, k, c; }",
                "=r,r,r", [x0, x1], dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 a, b, lo, hi;\n"
                "lop3.b32 a, $1, 0x8FFF8FFF, $3, 0x6A;\n"
                "lop3.b32 b, $2, 0x8FFF8FFF, $3, 0x6A;\n"
                "prmt.b32 lo, a, b, 0x5410;\n"
                "prmt.b32 hi, a, b, 0x7632;\n"
                "add.rn.f16x2 $0, lo, hi; }",
                "=r,r,r,r", [x0, x1, xorc], dtype=tl.int32, is_pure=True, pack=1)
        return r

    @triton.jit
    def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """One warp-wide ``mma.sync.m16n8k16`` (fp16 operands, fp32 accumulators), per lane fragments."""
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _load_words(wa, tiles, wo, NT: tl.constexpr, NW: tl.constexpr, NWL: tl.constexpr):
        """Per tile s < NT: the lane's NWL raw words of k-tile row ``wa`` (int32)."""
        out = ()
        for s_ in tl.static_range(NT):
            wt = wa + tiles[s_] * NW
            ws = ()
            for i in tl.static_range(NWL):
                ws = ws + (tl.load(wt + wo[i]),)
            out = out + (ws,)
        return out

    @triton.jit
    def _load_xfrag(xa_lo, xa_hi, mlo, mhi, a):
        """The lane's A fragment of k-tile a: x'[g, 16a + 2c (+8)] and row g + 8 (int32 fp16 pairs)."""
        return (tl.load(xa_lo + 8 * a, mask=mlo, other=0), tl.load(xa_hi + 8 * a, mask=mhi, other=0),
                tl.load(xa_lo + 8 * a + 4, mask=mlo, other=0), tl.load(xa_hi + 8 * a + 4, mask=mhi, other=0))

    @triton.jit(do_not_specialize=["rows", "one"])
    def _mma_kernel(x_ptr, w_ptr, z_ptr, rows, in_tiles, tn_total, k_per, stride_x, stride_zs, one,
                    KA: tl.constexpr, HALF: tl.constexpr, CB: tl.constexpr, MULT: tl.constexpr,
                    ADD: tl.constexpr, NT: tl.constexpr, WARPS: tl.constexpr, NWL: tl.constexpr,
                    ASM: tl.constexpr):
        """z[split, m, n] = Σ_{k in split} x'[m, k]·Q[k, n] for 16 rows (pid 2), NT·WARPS n-tiles, one K-split."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        a0 = pid_k * k_per
        a1 = tl.minimum(a0 + k_per, in_tiles)
        _mma_pass(x_ptr, w_ptr, z_ptr + pid_k * stride_zs, rows, pid_m * 16, a0, a1, pid_n, tn_total, stride_x, one,
                  KA, HALF, CB, MULT, ADD, NT, WARPS, NWL, ASM)

    @triton.jit
    def _mma_pass(x_ptr, w_ptr, zrow, rows, m0, a0, a1, pid_n, tn_total, stride_x, one,
                  KA: tl.constexpr, HALF: tl.constexpr, CB: tl.constexpr, MULT: tl.constexpr,
                  ADD: tl.constexpr, NT: tl.constexpr, WARPS: tl.constexpr, NWL: tl.constexpr,
                  ASM: tl.constexpr):
        """Rows ``m0 .. m0 + 15`` (those < ``rows``) of ``z = x'·Q[a0·16 : a1·16, :]`` for the n-tiles of
        ``pid_n``, stored at ``zrow`` (``[rows, out_p]`` fp32); ``w_ptr`` points at Q's first tile.

        Tensors are 1-D ``[32·WARPS]`` (one element per thread: element i lives in lane i mod 32 of
        warp i div 32, the only layout Triton can give them once no load is vectorizable); warp w
        handles tiles ``pid_n·NT·WARPS + s·WARPS + w`` for s < NT, accumulators in tuples.
        """
        NW: tl.constexpr = 8 * KA + 4 * HALF                      # words per tile
        idx = tl.arange(0, 32 * WARPS)
        lane = idx % 32
        warp = idx // 32
        e_end = (8 * lane + 8) * KA + HALF * (4 * lane + 4)       # E_L: the lane's last bit + 1
        last = (e_end - 1) // 32                                  # word holding it
        rsh = (32 * (last + 1) - e_end).to(tl.uint64)             # right padding of that word
        # the lane's word offsets inside a tile (ring); ·one: no provable contiguity, so no load is
        # vectorized and element i stays in lane i mod 32 (the mma needs that)
        wo = ()
        for i in tl.static_range(NWL):
            wo = wo + (((last - NWL + 1 + i + NW) % NW) * one,)
        tiles = ()
        for s_ in tl.static_range(NT):
            tiles = tiles + ((pid_n * NT + s_) * WARPS + warp,)
        if ASM:
            g = lane // 4
            c = lane % 4
            ra = m0 + g
            xi = x_ptr.to(tl.pointer_type(tl.int32))               # x' as int32 pairs of fp16
            xa_lo = xi + ra * (stride_x // 2) + c * one
            xa_hi = xi + (ra + 8) * (stride_x // 2) + c * one
            mlo = ra < rows
            mhi = (ra + 8) < rows
            xorc = (lane * 0 + one * 0x3B603B60).to(tl.uint32)   # a register, not an immediate
            acc = ()                                              # per tile: 2 mma × 4 C registers
            for s_ in tl.static_range(NT):
                zf = tl.zeros([32 * WARPS], tl.float32)
                acc = acc + ((zf, zf, zf, zf, zf, zf, zf, zf),)
        else:
            r_base = 2 * (lane % 4)                               # row of p = 0
            mm = m0 + tl.arange(0, 16)
            mmask = mm < rows
            acc = ()                                              # emulation: [row, warp, column 0..7] × 2
            for s_ in tl.static_range(NT):
                zf = tl.zeros([16, WARPS, 8], tl.float32)
                acc = acc + ((zf, zf),)
        # software pipelining: the words (and x' fragments) of k-tile a + 1 are loaded before k-tile a
        # is decoded, so each lane has two tiles' loads in flight
        wn = _load_words(w_ptr + a0 * tn_total * NW, tiles, wo, NT, NW, NWL)
        if ASM:
            xn = _load_xfrag(xa_lo, xa_hi, mlo, mhi, a0)
        for a in range(a0, a1):
            wc = wn
            an = tl.minimum(a + 1, a1 - 1)
            wn = _load_words(w_ptr + an * tn_total * NW, tiles, wo, NT, NW, NWL)
            if ASM:
                x0, x1, x2, x3 = xn
                xn = _load_xfrag(xa_lo, xa_hi, mlo, mhi, an)
            new_acc = ()
            for s_ in tl.static_range(NT):
                # the lane's NWL words, shifted so that its last bit is bit 0 of nf[NWL - 1]
                raw = wc[s_]
                if (8 * KA + 4 * HALF) % 32 == 0:                    # K = 4, 8: every lane ends on a word
                    nf = ()
                    for i in tl.static_range(NWL):
                        nf = nf + (raw[i].to(tl.uint32, bitcast=True),)
                else:
                    prev = raw[0].to(tl.uint32, bitcast=True).to(tl.uint64)
                    nf = ((prev >> rsh).to(tl.uint32),)
                    for i in tl.static_range(1, NWL):
                        cur = raw[i].to(tl.uint32, bitcast=True).to(tl.uint64)
                        nf = nf + ((((prev << 32) | cur) >> rsh).to(tl.uint32),)
                        prev = cur
                # position p's window ends D_p = (7 - p)·KA + HALF·(4 - (p + 1) // 2) bits before the end
                st = ()
                for p in tl.static_range(8):
                    if NWL - 1 - ((7 - p) * KA + HALF * (4 - (p + 1) // 2)) // 32 == 0:
                        sv = _window(nf[0], nf[0], ((7 - p) * KA + HALF * (4 - (p + 1) // 2)) % 32)
                    else:
                        sv = _window(nf[NWL - 2 - ((7 - p) * KA + HALF * (4 - (p + 1) // 2)) // 32],
                                     nf[NWL - 1 - ((7 - p) * KA + HALF * (4 - (p + 1) // 2)) // 32],
                                     ((7 - p) * KA + HALF * (4 - (p + 1) // 2)) % 32)
                    st = st + (sv,)
                if ASM:
                    p01 = _pack_pair(st[0], st[1], xorc, CB, MULT, ADD)
                    p23 = _pack_pair(st[2], st[3], xorc, CB, MULT, ADD)
                    p45 = _pack_pair(st[4], st[5], xorc, CB, MULT, ADD)
                    p67 = _pack_pair(st[6], st[7], xorc, CB, MULT, ADD)
                    d = acc[s_]
                    d0, d1, d2, d3 = _mma(x0, x1, x2, x3, p01, p23, d[0], d[1], d[2], d[3])
                    d4, d5, d6, d7 = _mma(x0, x1, x2, x3, p45, p67, d[4], d[5], d[6], d[7])
                    new_acc = new_acc + ((d0, d1, d2, d3, d4, d5, d6, d7),)
                else:
                    lo = acc[s_][0]
                    hi = acc[s_][1]
                    for p in tl.static_range(8):
                        v = _decode(st[p], CB, MULT, ADD, False)              # [32·WARPS]
                        kr = a * 16 + r_base + (p & 1) + 8 * ((p >> 1) & 1)  # input index per lane
                        xv = tl.load(x_ptr + mm[:, None] * stride_x + kr[None, :], mask=mmask[:, None],
                                     other=0.0).to(tl.float32)                # [16, 32·WARPS]
                        prod = tl.reshape(xv * v[None, :], [16, WARPS, 8, 4])
                        if p < 4:
                            lo += tl.sum(prod, axis=3)                       # lanes 4G..4G+3 share column G
                        else:
                            hi += tl.sum(prod, axis=3)
                    new_acc = new_acc + ((lo, hi),)
            acc = new_acc
        out_p = tn_total * 16
        if ASM:
            for s_ in tl.static_range(NT):
                col = tiles[s_] * 16 + 2 * c * one
                plo = zrow + ra * out_p + col
                phi = zrow + (ra + 8) * out_p + col
                d = acc[s_]
                tl.store(plo, d[0], mask=mlo)
                tl.store(plo + 1, d[1], mask=mlo)
                tl.store(phi, d[2], mask=mhi)
                tl.store(phi + 1, d[3], mask=mhi)
                tl.store(plo + 8, d[4], mask=mlo)
                tl.store(plo + 9, d[5], mask=mlo)
                tl.store(phi + 8, d[6], mask=mhi)
                tl.store(phi + 9, d[7], mask=mhi)
        else:
            cg = tl.arange(0, 8)
            wi = tl.arange(0, WARPS)
            for s_ in tl.static_range(NT):
                col = ((pid_n * NT + s_) * WARPS + wi)[:, None] * 16 + cg[None, :]      # [WARPS, 8]
                pz = zrow + mm[:, None, None] * out_p + col[None, :, :]
                tl.store(pz, acc[s_][0], mask=mmask[:, None, None])
                tl.store(pz + 8, acc[s_][1], mask=mmask[:, None, None])


def words_per_lane(bits) -> int:
    """NWL: 32-bit words holding a lane's 8 windows (7·KA + 4·HALF + 16 bits) at any of its alignments."""
    ka = int(bits)
    half = 0 if float(bits).is_integer() else 1
    span = 7 * ka + 4 * half + 16
    need = 0
    for lane in range(32):
        e = (8 * lane + 8) * ka + half * (4 * lane + 4)
        need = max(need, (e - 1) // 32 - (e - span) // 32 + 1)
    return need
