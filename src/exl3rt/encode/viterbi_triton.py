"""GPU (Triton) backend of the tail-biting Viterbi tile encoder (spec §4 step 6, ``quantize_tiles``).

API
---
``encode_tiles(targets, bits, codebook, **options) -> (states, values)``

* ``targets``: float32 ``[T, 256]`` on a CUDA device (on the CPU only under Triton's
  interpreter, ``TRITON_INTERPRET=1`` set before this module is imported), each row one tile's
  256 target weights in stream order.
* ``bits``: integer K in 1..8. Half-integer rates (1.5/2.5/3.5, mul1) raise NotImplementedError.
* ``codebook``: ``"3inst"``, ``"mcg"`` or ``"mul1"``.
* returns ``states`` int16 ``[T, 256]`` (full 16-bit states, two's complement) and ``values``
  float32 ``[T, 256]`` (the codebook value of each state), on the device of ``targets``.
* ``options``: launch tuning (CONFIG_KEYS; defaults per K in DEFAULT_CONFIG), ``programs``,
  ``scratch_bytes``. ``precompile(bits, codebook, **options)`` fills Triton's cache (the first
  call of a configuration compiles for ~1-10 s).

Math
----
Position t of a tile holds an L-bit state (L = 16) ``s_t = ((s_{t-1} << K) | c_t) mod 2^L``.
The *edge* between positions t-1 and t is the (L-K)-bit overlap: the out-edge of ``s_t`` is its
low L-K bits, its in-edge its top L-K bits. With ``NK = 2^K`` predecessors, ``E = 2^(L-K)``
edges and ``EH = 2^(L-2K)``, write an out-edge ``e = e_hi * NK + e_lo`` (``e_lo`` = low K bits).
The predecessor states of out-edge ``e`` are ``s = k * E + e`` (``k < NK``) and the in-edge of
such an ``s`` is ``s >> K = k * EH + e_hi``. One Viterbi step is therefore ::

    cost_t[e_hi, e_lo] = min_k  (cb[k*E + e_hi*NK + e_lo] - w_t)^2  +  cost_{t-1}[k*EH + e_hi]

a broadcast of the previous cost (viewed as ``[NK, EH]``) over ``e_lo`` and a running min /
argmin over ``k``: no gather. The argmin ``k`` (the dropped top K bits of the state) is the
backpointer. Backtracking from out-edge ``e`` at position t: ``s_t = (k << (L-K)) | e``; the
out-edge of position t-1 is ``s_t >> K``.

Tail-biting, two passes (the reference's "QTIP trick"):

1. positions 128..255, 0..127 with a free start (every in-edge costs 0); the argmin of the
   final cost (smallest cost, first edge on ties) is the out-edge of position 127; backtrack to
   position 0: ``e* = s_0 >> K``, the overlap at the 255 -> 0 junction. Only positions 0..127
   need backpointers in this pass.
2. positions 0..255 with only in-edge ``e*`` allowed (cost 0 there, "+inf" = 1e30 elsewhere);
   backtrack from out-edge ``e*`` at position 255. The states form a valid ring
   (``s_0 >> K == s_255 & (2^(L-K) - 1)``); pass 2 is the exact optimum among rings whose
   junction overlap is ``e*``.

Numerics: fp32 costs, ``d = cb - w; d*d + prev`` (on the GPU the multiply-add may become an
FMA, which can only move near-ties relative to the CPU backend; on 128-256 random tiles per K
the states were identical to ``viterbi_numba``'s). Ties over ``k``: strict ``<`` with ``k``
ascending (the smallest ``k`` wins), as the reference. Codebook values are computed inline
with the exact formulas of ``exl3rt.format.codebooks`` (3inst/mcg: uint32 multiply(-add), one
``lop3`` mask/xor, sum of the two fp16 halves; mul1: multiply, byte sum, one rounding of
``h*scale + bias``), the product stepped over ``k`` as ``(k*E + e)*m = e*m + k*(E*m) mod 2^32``,
or read from a 65536-entry fp32 / fp16 table (``lut``; L1/L2 resident, faster at K >= 4).

Kernel organisation (one launch)
--------------------------------
A persistent grid of P programs (P = what is resident on the GPU at once, from the compiled
kernel's registers); program p encodes tile groups p, p+P, ...: one *wave* is P*TPP tiles. A
program handles TPP = 1, 2 or 4 tiles in lockstep as separate variables (not a tensor axis, so
that the compiler cannot spread them over threads): the codebook values of a chunk are decoded
once and used by all TPP tiles. A step walks the E out-edges in chunks of ``CEH x NK`` edges
(a few per thread) with a register-resident running min (and argmin) over ``k``, reading the
previous costs from and writing the new ones to a per-tile scratch slab (L1/L2; a CTA barrier
separates steps). Backtracking is a short sequential loop at the end of each pass.

Two ways to get the backpointers (``recomp``):

* backpointer mode: the argmin is stored as uint8 per (position, edge) (``256 x E`` bytes per
  tile, 4 MiB at K=2); the costs ping-pong between two slots. ``fuse2`` computes two positions
  per step (the intermediate costs stay in registers, half the cost traffic; helped at K=1 only).
* recompute mode: the forward pass keeps only a min (3 instructions per candidate and tile:
  sub, fma, min) and stores every step's costs (``259 x E`` fp32 per tile); the backtrack
  recomputes the NK candidates of the one edge it follows at each position. Faster for K >= 3,
  where the cost vectors are small.

All scratch (costs, backpointers) is allocated once per call (P x TPP slabs, capped by
``scratch_bytes`` and half the free device memory) and reused by every wave.

Measured on one H200 (Triton 3.6, mcg, 65536 tiles = one 4096 x 4096 layer, Gaussian targets of
RMS 1.2437, whole ``encode_tiles`` call, defaults of DEFAULT_CONFIG):

    K   seconds  dB over 2^(-2K)       K   seconds  dB over 2^(-2K)
    1    1.51     0.38                 5    0.36     1.48
    2    0.85     0.40                 6    0.32     3.19
    3    0.70     0.50                 7    0.36     6.70
    4    0.42     0.80                 8    0.42    11.72

At K <= 3 the time is dominated by the traffic of the cost vectors (2 x 64 KiB per tile and
step at K=2) through L2, not by arithmetic.
"""

from __future__ import annotations

from typing import Optional

import torch

try:  # Triton is an optional dependency (extra "gpu")
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAVE_TRITON = False

from exl3rt.format.codebooks import (
    INST3_ADDEND,
    INST3_MULTIPLIER,
    MCG_MULTIPLIER,
    MUL1_MULTIPLIER,
    check_codebook,
    codebook_values,
)

__all__ = ["encode_tiles", "precompile", "launch_config", "HAVE_TRITON", "DEFAULT_CONFIG",
           "CONFIG_KEYS"]

TILE = 256              # weights (positions) per tile
STATE_BITS = 16         # trellis state width L
MASK32 = 0xFFFFFFFF

#: codebook name -> kernel constexpr id (3 / 4 = read values from an fp32 / fp16 table)
CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
_CB_NAMES = {v: k for k, v in CODEBOOK_IDS.items()}
CB_TABLE = 3
CB_TABLE16 = 4

#: per codebook: (multiplier, addend) of the first uint32 step
_CB_AFFINE = {0: (INST3_MULTIPLIER, INST3_ADDEND), 1: (MCG_MULTIPLIER, 0), 2: (MUL1_MULTIPLIER, 0)}

# fp16 constants of the mul1 codebook: fp16(0x1EEE) and fp16(0xC931), exact in fp32
MUL1_SCALE = 0.0067672729492187500
MUL1_BIAS = -10.3828125

#: large finite "infinity" (the constrained start of pass 2)
BIG = 1.0e30

#: default cap on the scratch memory of one call (the grid shrinks to fit)
DEFAULT_SCRATCH_BYTES = 16 << 30

#: launch options (``encode_tiles(..., **config)``):
#:   num_warps; chunk (edges per inner block, CEH*NK); tpp (tiles per program: 1, 2, 4);
#:   order (chunk axis order 0/1); recomp (store every step's costs and recompute the argmins
#:   while backtracking, instead of uint8 backpointers); fuse2 (two positions per step,
#:   backpointer mode, tpp <= 2); lut (None/False: inline decode, pass False to override a
#:   table default; "fp32"/"fp16": 65536-entry table);
#:   k_static (unroll the k loop; default
#:   NK <= 16); progs_per_sm (None: as many programs as are resident at once).
#:   cost16 (store the per-step cost vectors as fp16, arithmetic in fp32; every step's costs are
#:   stored relative to the previous step's minimum so that the competitive ones stay small).
CONFIG_KEYS = ("num_warps", "chunk", "tpp", "order", "recomp", "fuse2", "lut", "k_static", "progs_per_sm",
               "cost16")
_BASE_CONFIG = dict(num_warps=8, chunk=1024, tpp=4, order=0, recomp=True, fuse2=False, lut=None,
                    k_static=None, progs_per_sm=None, cost16=False)

#: per-K defaults (on top of _BASE_CONFIG): the fastest measured variants of the sweeps of
#: benchmarks/bench_viterbi_gpu.py on an H200 (K = 5, 7, 8 were not swept)
DEFAULT_CONFIG = {
    1: dict(recomp=False, fuse2=True, tpp=1, chunk=1024, cost16=True),
    2: dict(recomp=False, tpp=2, chunk=1024, cost16=True),
    3: dict(chunk=1024),
    4: dict(chunk=1024, lut="fp16"),
    5: dict(chunk=1024, lut="fp32"),
    6: dict(chunk=1024, lut="fp16"),
    7: dict(chunk=512, num_warps=4, lut="fp32"),
    8: dict(chunk=256, num_warps=4, lut="fp32"),
}

if HAVE_TRITON:
    MUL1_SCALE_C = tl.constexpr(MUL1_SCALE)
    MUL1_BIAS_C = tl.constexpr(MUL1_BIAS)
    BIG_C = tl.constexpr(BIG)

    @triton.jit
    def _min_combine(a, b):
        # reductions use this instead of tl.min: no dependence on triton.language's own @jit
        # helpers, which exist for the CPU interpreter only if TRITON_INTERPRET was set when
        # triton was first imported
        return tl.minimum(a, b)

    @triton.jit
    def _cb_from_product(x, CB: tl.constexpr, ASM: tl.constexpr):
        """Codebook value (fp32 holding an fp16) from ``x`` (uint32) = the state's first step
        ``s*m`` (mcg, mul1) or ``s*m + a`` (3inst)."""
        if CB == 2:  # mul1: byte sum, h = 1024 + bytesum, one fp16 rounding of h*scale + bias
            bsum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
            h = (bsum + 1024).to(tl.float32)
            v = (h * MUL1_SCALE_C + MUL1_BIAS_C).to(tl.float16).to(tl.float32)  # exact in fp32
        else:  # 3inst / mcg: mask/xor, sum of the two fp16 halves (one fp16 rounding)
            if ASM:  # (x & 0x8FFF8FFF) ^ 0x3B603B60 as one lop3 (0x6A = (a & b) ^ c)
                y = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x8FFF8FFF, 0x3B603B60, 0x6A;",
                                              "=r,r", [x], dtype=tl.uint32, is_pure=True, pack=1)
            else:
                y = (x & 0x8FFF8FFF) ^ 0x3B603B60
            lo = (y & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
            v = (lo + hi).to(tl.float32)
        return v

    @triton.jit
    def _cb_value(s, cb_ptr, CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr,
                  ASM: tl.constexpr):
        """Codebook value of states ``s`` (int32 tensor)."""
        if CB >= 3:  # table lookup (fp32 or fp16 table)
            v = tl.load(cb_ptr + s).to(tl.float32)
        else:
            v = _cb_from_product(s.to(tl.uint32) * MULT + ADD, CB, ASM)
        return v

    @triton.jit
    def _cb_k(x0, k: tl.constexpr, cb_ptr, CB: tl.constexpr, E: tl.constexpr, KMULT: tl.constexpr,
              ASM: tl.constexpr):
        """Codebook values of the states ``k*E + e`` given ``x0`` = the product of ``e`` (inline
        decoders: ``(k*E + e)*m + a = x0 + k*(E*m)`` mod 2^32) or ``e`` itself (tables)."""
        if CB >= 3:
            v = tl.load(cb_ptr + (x0 + k * E)).to(tl.float32)
        else:
            v = _cb_from_product(x0 + ((k * KMULT) & 0xFFFFFFFF), CB, ASM)
        return v

    @triton.jit
    def _x0(e, CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr):
        if CB >= 3:
            x0 = e
        else:
            x0 = e.to(tl.uint32) * MULT + ADD                     # product of k = 0
        return x0

    @triton.jit
    def _fold(best, arg, k, v, prev, wt, WANT_ARG: tl.constexpr):
        """Fold predecessor ``k`` (codebook values ``v``, previous costs ``prev``) into one
        tile's running min (and argmin; ties: strict ``<``, the smallest k wins)."""
        d = v - wt
        cand = d * d + prev
        if WANT_ARG:
            upd = cand < best
            best = tl.where(upd, cand, best)
            arg = tl.where(upd, k, arg)
        else:
            best = tl.minimum(best, cand)
        return best, arg

    @triton.jit
    def _finish(best, arg, dst, bp_t, e, off, mn, STORE_BP: tl.constexpr, C16: tl.constexpr):
        """Store one tile's chunk of costs (C16: minus the step offset ``off``, as fp16; ``mn``:
        running minimum of the stored values) and backpointers."""
        if C16:
            rel = best - off
            mn = tl.minimum(mn, rel)
            tl.store(dst + e, rel.to(tl.float16))
        else:
            tl.store(dst + e, best)
        if STORE_BP:
            tl.store(bp_t + e, arg.to(tl.uint8))
        return mn

    @triton.jit
    def _offset(mn, C16: tl.constexpr):
        """Offset of the next step: the minimum of the costs just stored (0 if not C16)."""
        if C16:
            m = tl.reduce(tl.reduce(mn, 1, _min_combine), 0, _min_combine)
            m = tl.where(m < 1.0e4, m, 0.0)
        else:
            m = tl.zeros((), tl.float32)
        return m

    @triton.jit
    def _init(e):
        """Running-min start (+inf) and argmin 0."""
        zero = (e * 0).to(tl.float32)
        return zero + float("inf"), zero.to(tl.int32)

    @triton.jit
    def _chunk_axes(NK: tl.constexpr, CEH: tl.constexpr, ORDER: tl.constexpr):
        if ORDER == 0:
            el = tl.arange(0, NK)[:, None]                        # chunk = [NK, CEH]
            ehl = tl.arange(0, CEH)[None, :]
        else:
            ehl = tl.arange(0, CEH)[:, None]                      # chunk = [CEH, NK]
            el = tl.arange(0, NK)[None, :]
        return el, ehl

    @triton.jit
    def _step(src, dst, bp_t, wa, wb, wc, wd, oa, ob, oc, od, cb_ptr, STORE_BP: tl.constexpr,
              TPP: tl.constexpr, TS: tl.constexpr, BS: tl.constexpr,
              NK: tl.constexpr, EH: tl.constexpr, E: tl.constexpr, CEH: tl.constexpr,
              ORDER: tl.constexpr, CB: tl.constexpr, MULT: tl.constexpr,
              ADD: tl.constexpr, KMULT: tl.constexpr,
              K_STATIC: tl.constexpr, ASM: tl.constexpr, C16: tl.constexpr):
        """One trellis step for TPP = 1, 2 or 4 tiles (targets ``wa``, ``wb``, ``wc``, ``wd``; tile
        i's buffers lie ``i*TS`` / ``i*BS`` elements after tile 0's). Reads the in-edge costs at
        ``src``, writes the out-edge costs at ``dst`` and, if ``STORE_BP``, the argmin k at
        ``bp_t``:

        ``cost[e_hi*NK + e_lo] = min_k (cb[k*E + e_hi*NK + e_lo] - w)^2 + prev[k*EH + e_hi]``

        over chunks of CEH x NK edges; ties: strict ``<`` over ascending k. The codebook values
        of a chunk are decoded once for all TPP tiles (they are separate variables, not a tensor
        axis, so that the compiler cannot spread them over threads). C16: fp16 costs, tile i's
        stored relative to its offset ``o*``; returns the next step's offsets."""
        el, ehl = _chunk_axes(NK, CEH, ORDER)
        ma = (ehl * NK + el).to(tl.float32) * 0.0 + float("inf")  # running minima (C16)
        mb = ma
        mc = ma
        md = ma
        for c in range(0, EH // CEH):
            eh = c * CEH + ehl
            e = eh * NK + el                                      # out-edges of the chunk
            x0 = _x0(e, CB, MULT, ADD)
            ba, aa = _init(e)
            bb, ab = _init(e)
            bc, ac = _init(e)
            bd, ad = _init(e)
            xk = x0
            if K_STATIC:
                for k in tl.static_range(NK):
                    v = _cb_k(x0, k, cb_ptr, CB, E, KMULT, ASM)
                    pa = src + (k * EH + eh)
                    ba, aa = _fold(ba, aa, k, v, tl.load(pa).to(tl.float32), wa, STORE_BP)
                    if TPP >= 2:
                        bb, ab = _fold(bb, ab, k, v, tl.load(pa + TS).to(tl.float32), wb, STORE_BP)
                    if TPP >= 4:
                        bc, ac = _fold(bc, ac, k, v, tl.load(pa + 2 * TS).to(tl.float32), wc, STORE_BP)
                        bd, ad = _fold(bd, ad, k, v, tl.load(pa + 3 * TS).to(tl.float32), wd, STORE_BP)
            else:
                for k in range(0, NK):
                    if CB >= 3:
                        v = tl.load(cb_ptr + xk).to(tl.float32)
                        xk = xk + E
                    else:
                        v = _cb_from_product(xk, CB, ASM)
                        xk = xk + KMULT
                    pa = src + (k * EH + eh)
                    ba, aa = _fold(ba, aa, k, v, tl.load(pa).to(tl.float32), wa, STORE_BP)
                    if TPP >= 2:
                        bb, ab = _fold(bb, ab, k, v, tl.load(pa + TS).to(tl.float32), wb, STORE_BP)
                    if TPP >= 4:
                        bc, ac = _fold(bc, ac, k, v, tl.load(pa + 2 * TS).to(tl.float32), wc, STORE_BP)
                        bd, ad = _fold(bd, ad, k, v, tl.load(pa + 3 * TS).to(tl.float32), wd, STORE_BP)
            ma = _finish(ba, aa, dst, bp_t, e, oa, ma, STORE_BP, C16)
            if TPP >= 2:
                mb = _finish(bb, ab, dst + TS, bp_t + BS, e, ob, mb, STORE_BP, C16)
            if TPP >= 4:
                mc = _finish(bc, ac, dst + 2 * TS, bp_t + 2 * BS, e, oc, mc, STORE_BP, C16)
                md = _finish(bd, ad, dst + 3 * TS, bp_t + 3 * BS, e, od, md, STORE_BP, C16)
        tl.debug_barrier()  # the next step reads costs written by other threads
        oa = _offset(ma, C16)
        if TPP >= 2:
            ob = _offset(mb, C16)
        if TPP >= 4:
            oc = _offset(mc, C16)
            od = _offset(md, C16)
        return oa, ob, oc, od

    @triton.jit
    def _mid(src, j, k2, x0j, wt, cb_ptr, NK: tl.constexpr, EH: tl.constexpr, E: tl.constexpr,
             K: tl.constexpr, CB: tl.constexpr, KMULT: tl.constexpr,
             WANT_ARG: tl.constexpr, ASM: tl.constexpr):
        """Intermediate cost (and argmin) of edges ``j`` after the first step of a fused pair."""
        best, arg = _init(j)
        for k1 in tl.static_range(NK):
            v = _cb_k(x0j, k1, cb_ptr, CB, E, KMULT, ASM)
            best, arg = _fold(best, arg, k1, v, tl.load(src + (k1 * EH + (j >> K))).to(tl.float32), wt, WANT_ARG)
        return best, arg

    @triton.jit
    def _step2(src, dst, bp_t, w0a, w0b, w1a, w1b, oa, ob, cb_ptr, STORE_BP: tl.constexpr,
               TPP: tl.constexpr, TS: tl.constexpr, BS: tl.constexpr, NK: tl.constexpr,
               EH: tl.constexpr, E: tl.constexpr, K: tl.constexpr, CEH: tl.constexpr,
               ORDER: tl.constexpr, CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr,
               KMULT: tl.constexpr, ASM: tl.constexpr, C16: tl.constexpr):
        """Two trellis steps (positions t, t+1; targets ``w0*``, ``w1*``; TPP = 1 or 2 tiles)
        without the round trip of the intermediate costs through memory: for each chunk of
        final out-edges ``e`` and each k2, the intermediate costs of the edges
        ``j = k2*EH + e_hi`` (exactly the in-edges this chunk needs) are computed in registers
        from the costs at ``src`` (min over k1), their argmins go to ``bp_t`` (position t), and
        they are folded into the final running min over k2 (argmins to ``bp_t + E``)."""
        el, ehl = _chunk_axes(NK, CEH, ORDER)
        na = (ehl * NK + el).to(tl.float32) * 0.0 + float("inf")  # running minima (C16)
        nb = na
        for c in range(0, EH // CEH):
            eh = c * CEH + ehl                                    # [1, CEH] or [CEH, 1]
            e = eh * NK + el                                      # final out-edges of the chunk
            x0 = _x0(e, CB, MULT, ADD)
            ba, aa = _init(e)
            bb, ab = _init(e)
            for k2 in tl.static_range(NK):
                j = k2 * EH + eh                                  # intermediate edges
                x0j = _x0(j, CB, MULT, ADD)
                ma, ia = _mid(src, j, k2, x0j, w0a, cb_ptr, NK, EH, E, K, CB, KMULT,
                              STORE_BP, ASM)
                if STORE_BP:
                    tl.store(bp_t + j, ia.to(tl.uint8))
                if TPP >= 2:
                    mb, ib = _mid(src + TS, j, k2, x0j, w0b, cb_ptr, NK, EH, E, K, CB, KMULT, STORE_BP, ASM)
                    if STORE_BP:
                        tl.store(bp_t + BS + j, ib.to(tl.uint8))
                v = _cb_k(x0, k2, cb_ptr, CB, E, KMULT, ASM)
                ba, aa = _fold(ba, aa, k2, v, ma, w1a, STORE_BP)
                if TPP >= 2:
                    bb, ab = _fold(bb, ab, k2, v, mb, w1b, STORE_BP)
            na = _finish(ba, aa, dst, bp_t + E, e, oa, na, STORE_BP, C16)
            if TPP >= 2:
                nb = _finish(bb, ab, dst + TS, bp_t + BS + E, e, ob, nb, STORE_BP, C16)
        tl.debug_barrier()  # the next step reads costs written by other threads
        oa = _offset(na, C16)
        if TPP >= 2:
            ob = _offset(nb, C16)
        return oa, ob

    @triton.jit
    def _advance(hist, src, dst, bp_t, w_row, p, ok_b, ok_c, ok_d, oa, ob, oc, od, cb_ptr,
                 STORE_BP: tl.constexpr,
                 FUSE2: tl.constexpr, N: tl.constexpr, TPP: tl.constexpr, TS: tl.constexpr,
                 BS: tl.constexpr, NK: tl.constexpr, EH: tl.constexpr, E: tl.constexpr,
                 K: tl.constexpr, CEH: tl.constexpr, ORDER: tl.constexpr, CB: tl.constexpr,
                 MULT: tl.constexpr, ADD: tl.constexpr, KMULT: tl.constexpr,
                 K_STATIC: tl.constexpr, ASM: tl.constexpr,
                 C16: tl.constexpr):
        """Position p (or p and p+1 if FUSE2): costs from cost slot ``src`` to slot ``dst``;
        returns the next step's cost offsets (C16)."""
        wa = tl.load(w_row + p)
        wb = tl.load(w_row + N + p, mask=ok_b, other=0.0)
        if FUSE2:
            wa1 = tl.load(w_row + p + 1)
            wb1 = tl.load(w_row + N + p + 1, mask=ok_b, other=0.0)
            oa, ob = _step2(hist + src * E, hist + dst * E, bp_t, wa, wb, wa1, wb1, oa, ob, cb_ptr,
                            STORE_BP, TPP, TS, BS, NK, EH, E, K, CEH, ORDER, CB, MULT, ADD, KMULT, ASM, C16)
        else:
            wc = tl.load(w_row + 2 * N + p, mask=ok_c, other=0.0)
            wd = tl.load(w_row + 3 * N + p, mask=ok_d, other=0.0)
            oa, ob, oc, od = _step(hist + src * E, hist + dst * E, bp_t, wa, wb, wc, wd, oa, ob,
                                   oc, od, cb_ptr, STORE_BP, TPP, TS, BS, NK, EH, E, CEH, ORDER,
                                   CB, MULT, ADD, KMULT, K_STATIC, ASM, C16)
        return oa, ob, oc, od

    @triton.jit
    def _back_k(e, t, w1, hist_t, bp_tiles, cb_ptr, RECOMP: tl.constexpr, NK: tl.constexpr,
                EH: tl.constexpr, E: tl.constexpr, K: tl.constexpr, CB: tl.constexpr,
                MULT: tl.constexpr, ADD: tl.constexpr, ASM: tl.constexpr):
        """The dropped top bits k of the best state at position ``t`` with out-edge ``e`` (one
        per tile, [TPP]). ``RECOMP``: recomputed from the in-edge costs of position t
        (``hist_t``: [TPP] pointers) and the targets ``w1``; else read from the backpointers
        (``bp_tiles``: [TPP] pointers)."""
        if RECOMP:
            kk = tl.arange(0, NK)[None, :]                                        # [1, NK]
            prev = tl.load(hist_t[:, None] + kk * EH + (e >> K)[:, None]).to(tl.float32)          # [TPP, NK]
            v = _cb_value(kk * E + e[:, None], cb_ptr, CB, MULT, ADD, ASM)
            d = v - w1[:, None]
            cand = d * d + prev
            m = tl.reduce(cand, 1, _min_combine)
            k = tl.reduce(tl.where(cand == m[:, None], kk, NK), 1, _min_combine)              # first k
            k = tl.where(k < NK, k, 0)
        else:
            k = tl.load(bp_tiles + t * E + e).to(tl.int32)
        return k

    @triton.jit(do_not_specialize=["n_tiles", "n_progs"])  # one compiled kernel per config
    def _viterbi_kernel(
        tgt_ptr,            # fp32 [T, N] targets
        states_ptr,         # int16 [T, N] out
        values_ptr,         # fp32 [T, N] out
        bp_ptr,             # uint8 [P, TPP, N, E] backpointer scratch (unused if RECOMP)
        hist_ptr,           # fp32 [P, TPP, NSLOT, E] cost scratch
        cb_ptr,             # fp32 / fp16 [2^L] codebook table (read only if CB == 3 / 4)
        n_tiles,
        n_progs,
        N: tl.constexpr,            # positions per tile (256)
        K: tl.constexpr,            # bits per position
        NK: tl.constexpr,           # 2^K: predecessors per edge
        EH: tl.constexpr,           # 2^(L-2K): e_hi values
        E: tl.constexpr,            # 2^(L-K): edges
        CEH: tl.constexpr,          # e_hi values per chunk (chunk = CEH*NK edges)
        TPP: tl.constexpr,          # tiles per program: 1, 2 or 4
        ORDER: tl.constexpr,        # chunk axis order: 0 [NK, CEH], 1 [CEH, NK]
        NSLOT: tl.constexpr,        # cost slots per tile: N+3 if RECOMP else 2
        CB: tl.constexpr,           # 0 3inst, 1 mcg, 2 mul1 (inline), 3 fp32 table, 4 fp16 table
        MULT: tl.constexpr,         # codebook's uint32 multiplier
        ADD: tl.constexpr,          # codebook's uint32 addend
        KMULT: tl.constexpr,        # (E*MULT) mod 2^32: product step per k
        K_STATIC: tl.constexpr,     # unroll the k loop
        RECOMP: tl.constexpr,       # keep every step's costs, recompute argmins while backtracking
        FUSE2: tl.constexpr,        # two positions per step (backpointer mode, TPP <= 2)
        ASM: tl.constexpr,          # inline PTX allowed (not under the interpreter)
        C16: tl.constexpr,          # fp16 cost scratch (costs relative to a per-step offset)
    ):
        HALF: tl.constexpr = N // 2
        STEP: tl.constexpr = 2 if FUSE2 else 1
        CH: tl.constexpr = CEH * NK
        TS: tl.constexpr = NSLOT * E                              # cost scratch per tile
        BS: tl.constexpr = N * E                                  # backpointers per tile
        BP_FWD: tl.constexpr = not RECOMP
        pid = tl.program_id(0)
        tp1 = tl.arange(0, TPP)                                   # [TPP]
        tp2 = tp1[None, :]                                        # [1, TPP]
        ch2 = tl.arange(0, CH)[:, None]                           # [CH, 1]
        hist = hist_ptr + pid.to(tl.int64) * (TPP * TS)          # this program's scratch
        bp = bp_ptr + pid.to(tl.int64) * (TPP * BS)
        hist1 = hist + tp1 * TS                                   # [TPP] per-tile slabs
        hist2 = hist + tp2 * TS                                   # [1, TPP]
        bp1 = bp + tp1 * BS

        n_groups = (n_tiles + (TPP - 1)) // TPP
        for g in range(pid, n_groups, n_progs):                   # one wave per iteration
            tiles1 = g * TPP + tp1
            ok1 = tiles1 < n_tiles
            w1 = tgt_ptr + tiles1 * N
            wa_row = tgt_ptr + (g * TPP) * N                      # rows of tiles a, b, c, d
            ok_b = (g * TPP + 1 < n_tiles) & (TPP >= 2)
            ok_c = (g * TPP + 2 < n_tiles) & (TPP >= 4)
            ok_d = (g * TPP + 3 < n_tiles) & (TPP >= 4)

            # ------------- pass 1: positions HALF..N-1 then 0..HALF-1, free start -------------
            # cost slots. RECOMP: slot t = in-edge costs of position t (t <= HALF); positions
            # HALF..N-1 ping-pong in slots N+1, N+2. Backpointer mode: ping-pong in slots 0, 1.
            if RECOMP:
                z = N + 2
            else:
                z = 0
            for c in range(0, E // CH):
                tl.store(hist2 + z * E + c * CH + ch2,
                         tl.full([CH, TPP], 0.0, tl.float32).to(hist_ptr.dtype.element_ty))
            tl.debug_barrier()
            oa = tl.zeros((), tl.float32)                         # per-tile cost offsets (C16)
            ob = oa
            oc = oa
            od = oa
            for j in range(0, HALF, STEP):                        # positions HALF..N-1
                if RECOMP:
                    src = N + 1 + (j + 1) % 2
                    dst = tl.where(j == HALF - 1, 0, N + 1 + j % 2)
                else:
                    src = (j // STEP) % 2
                    dst = 1 - src
                oa, ob, oc, od = _advance(hist, src, dst, bp, wa_row, HALF + j, ok_b, ok_c, ok_d,
                                          oa, ob, oc, od, cb_ptr, False, FUSE2, N, TPP, TS, BS,
                                          NK, EH, E, K, CEH, ORDER, CB, MULT, ADD, KMULT,
                                          K_STATIC, ASM, C16)
            for t in range(0, HALF, STEP):                        # positions 0..HALF-1
                if RECOMP:
                    src = t
                    dst = t + 1
                else:
                    src = (t // STEP) % 2
                    dst = 1 - src
                oa, ob, oc, od = _advance(hist, src, dst, bp + t * E, wa_row, t, ok_b, ok_c, ok_d,
                                          oa, ob, oc, od, cb_ptr, BP_FWD, FUSE2, N, TPP, TS, BS,
                                          NK, EH, E, K, CEH, ORDER, CB, MULT, ADD, KMULT,
                                          K_STATIC, ASM, C16)
            # argmin of the final cost (first edge on ties) = out-edge of position HALF-1
            if RECOMP:
                fin = HALF
            else:
                fin = 0
            runv = tl.full([CH, TPP], float("inf"), tl.float32)
            runi = tl.full([CH, TPP], 0, tl.int32)
            for c in range(0, E // CH):
                v = tl.load(hist2 + fin * E + c * CH + ch2).to(tl.float32)
                upd = v < runv
                runv = tl.where(upd, v, runv)
                runi = tl.where(upd, c * CH + ch2, runi)
            vmin = tl.reduce(runv, 0, _min_combine)
            e1 = tl.reduce(tl.where(runv == vmin[None, :], runi, E), 0, _min_combine)          # [TPP]
            e1 = tl.where(e1 < E, e1, 0)                                           # all non-finite
            for i in range(0, HALF):                                               # HALF-1 -> 0
                t = HALF - 1 - i
                wt1 = tl.load(w1 + t, mask=ok1, other=0.0)
                k = _back_k(e1, t, wt1, hist1 + t * E, bp1, cb_ptr, RECOMP, NK, EH, E, K, CB,
                            MULT, ADD, ASM)
                e1 = ((k * E) | e1) >> K
            estar = e1                                                             # [TPP]
            tl.debug_barrier()

            # ------------- pass 2: positions 0..N-1, start fixed to in-edge e* -------------
            for c in range(0, E // CH):
                init = tl.where(c * CH + ch2 == estar[None, :], 0.0,
                                float("inf") if C16 else BIG_C)
                tl.store(hist2 + c * CH + ch2, init.to(hist_ptr.dtype.element_ty))  # slot 0
            tl.debug_barrier()
            oa = tl.zeros((), tl.float32)
            ob = oa
            oc = oa
            od = oa
            for t in range(0, N, STEP):
                if RECOMP:
                    src = t
                    dst = t + 1
                else:
                    src = (t // STEP) % 2
                    dst = 1 - src
                oa, ob, oc, od = _advance(hist, src, dst, bp + t * E, wa_row, t, ok_b, ok_c, ok_d,
                                          oa, ob, oc, od, cb_ptr, BP_FWD, FUSE2, N, TPP, TS, BS,
                                          NK, EH, E, K, CEH, ORDER, CB, MULT, ADD, KMULT,
                                          K_STATIC, ASM, C16)
            e2 = estar                                                             # out-edge of N-1
            for i in range(0, N):                                                  # N-1 -> 0
                t = N - 1 - i
                wt1 = tl.load(w1 + t, mask=ok1, other=0.0)
                k = _back_k(e2, t, wt1, hist1 + t * E, bp1, cb_ptr, RECOMP, NK, EH, E, K, CB,
                            MULT, ADD, ASM)
                st = (k * E) | e2
                tl.store(states_ptr + tiles1 * N + t, st.to(tl.int16), mask=ok1)
                tl.store(values_ptr + tiles1 * N + t, _cb_value(st, cb_ptr, CB, MULT, ADD, ASM),
                         mask=ok1)
                e2 = st >> K
            tl.debug_barrier()


def _check_bits(bits) -> int:
    k2 = float(bits) * 2
    if k2 != int(k2) or not (2 <= k2 <= 16):
        raise ValueError(f"bits must be an integer 1..8 (or 1.5/2.5/3.5 for mul1), got {bits!r}")
    if int(k2) % 2:
        raise NotImplementedError(
            f"half-integer bits ({bits}) are not implemented in the Triton Viterbi backend; "
            "use the CPU backend (exl3rt.encode.viterbi_numba / viterbi_ref)"
        )
    return int(k2) // 2


def _interpreting() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return HAVE_TRITON and type(_viterbi_kernel).__name__ == "InterpretedFunction"


def launch_config(K: int, **overrides) -> dict:
    """``DEFAULT_CONFIG[K]`` with the non-None ``overrides`` applied (keys: CONFIG_KEYS)."""
    unknown = set(overrides) - set(CONFIG_KEYS)
    if unknown:
        raise TypeError(f"unknown launch option(s): {', '.join(sorted(unknown))}")
    cfg = dict(_BASE_CONFIG)
    cfg.update(DEFAULT_CONFIG[K])
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def _plan(K: int, L: int, N: int, cfg: dict) -> dict:
    """Validate a launch configuration; returns the kernel's constexpr arguments + num_warps."""
    if N < 4 or N % 4:
        raise ValueError(f"the number of positions must be a multiple of 4, got {N}")
    if L < 2 * K:
        raise ValueError(f"state width {L} must be >= 2K = {2 * K}")
    NK, EH, E = 1 << K, 1 << (L - 2 * K), 1 << (L - K)
    CH = max(NK, min(int(cfg["chunk"]), E))
    tpp, recomp, fuse2 = int(cfg["tpp"]), bool(cfg["recomp"]), bool(cfg["fuse2"])
    if CH & (CH - 1):
        raise ValueError(f"chunk must be a power of two, got {cfg['chunk']}")
    if tpp not in (1, 2, 4):
        raise ValueError(f"tpp must be 1, 2 or 4, got {tpp}")
    if fuse2 and (recomp or tpp > 2 or N % 8):
        raise ValueError("fuse2 needs backpointers (recomp=False), tpp <= 2 and N % 8 == 0")
    lut = cfg["lut"]
    if lut not in (None, False, "fp32", "fp16"):
        raise ValueError(f"lut must be None, 'fp32' or 'fp16', got {lut!r}")
    k_static = cfg["k_static"]
    return dict(N=N, K=K, NK=NK, EH=EH, E=E, CEH=CH // NK, TPP=tpp, ORDER=int(cfg["order"]),
                NSLOT=N + 3 if recomp else 2,
                K_STATIC=bool(NK <= 16 if k_static is None else k_static), RECOMP=recomp,
                FUSE2=fuse2, ASM=not _interpreting(), C16=bool(cfg["cost16"]),
                num_warps=int(cfg["num_warps"]))


def _codebook_args(meta: dict, codebook_id: int, table: Optional[torch.Tensor], lut, device):
    """Add the codebook constexprs to ``meta``; returns the table tensor to pass (or None)."""
    if lut or codebook_id == CB_TABLE:
        cb_id = CB_TABLE16 if lut == "fp16" else CB_TABLE
        dtype = torch.float16 if cb_id == CB_TABLE16 else torch.float32
        tab = table.to(device=device, dtype=dtype).contiguous()
        mult, add = 1, 0
    else:
        cb_id, tab = codebook_id, None
        mult, add = _CB_AFFINE[cb_id]
    meta.update(CB=cb_id, MULT=mult, ADD=add, KMULT=(meta["E"] * mult) & MASK32)
    return tab


def _resident_programs(args, meta, device) -> Optional[int]:
    """How many programs of this kernel fit on the GPU at once (None if unknown)."""
    try:
        kern = _viterbi_kernel.warmup(*args, grid=(1,), **meta)
        kern._init_handles()
        regs = int(kern.n_regs)
        smem = int(kern.metadata.shared)
    except Exception:  # pragma: no cover - depends on the Triton version
        return None
    props = torch.cuda.get_device_properties(device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    warps = meta["num_warps"]
    regs_block = -(-max(regs, 1) * 32 // 256) * 256 * warps  # per-warp allocation unit: 256
    per_sm = min(regs_sm // regs_block, threads_sm // (32 * warps), 32,
                 smem_sm // (smem + 1024) if smem else 32)
    return max(1, per_sm) * props.multi_processor_count


def _encode(tgt: torch.Tensor, K: int, L: int, codebook_id: int, table: Optional[torch.Tensor],
            cfg: dict, programs: Optional[int], scratch_bytes: int):
    """Launch the kernel on fp32 ``tgt`` [T, N] (generic state width ``L``: tests use small L)."""
    device = tgt.device
    if device.type != "cuda" and not _interpreting():
        raise ValueError("targets must be a CUDA tensor (or set TRITON_INTERPRET=1 for the CPU "
                         "interpreter before importing this module)")
    T, N = tgt.shape
    meta = _plan(K, L, N, cfg)
    states = torch.empty((T, N), dtype=torch.int16, device=device)
    values = torch.empty((T, N), dtype=torch.float32, device=device)
    if T == 0:
        return states, values
    max_rows = (2**31 - 1) // N  # int32 offsets inside the kernel
    if T > max_rows:
        for a in range(0, T, max_rows):
            states[a:a + max_rows], values[a:a + max_rows] = _encode(
                tgt[a:a + max_rows], K, L, codebook_id, table, cfg, programs, scratch_bytes)
        return states, values
    lut = cfg["lut"]
    if lut and table is None:
        table = codebook_values(_CB_NAMES[codebook_id])
    tab = _codebook_args(meta, codebook_id, table, lut, device)
    cb = tgt if tab is None else tab  # (unused pointer for the inline decoders)
    tpp, E, nslot, recomp = meta["TPP"], meta["E"], meta["NSLOT"], meta["RECOMP"]

    # persistent grid of P programs: at most what is resident on the GPU at once (more would
    # run in a second round, after the first ones finished all their tiles) and what the
    # scratch budget allows
    pps = cfg["progs_per_sm"]
    if programs is None:
        programs = (torch.cuda.get_device_properties(device).multi_processor_count
                    if device.type == "cuda" else 1) * (pps or 8)
    P = max(1, min(int(programs), -(-T // tpp)))
    hdt = torch.float16 if meta["C16"] else torch.float32
    per_prog = tpp * nslot * E * hdt.itemsize + (0 if recomp else tpp * N * E)
    if device.type == "cuda":
        scratch_bytes = min(scratch_bytes, torch.cuda.mem_get_info(device)[0] // 2)
        if pps is None:
            h = tgt.new_empty(16)  # same dtypes as the real scratch: the same compiled kernel
            dummy = (tgt, states, values, h.to(hdt) if recomp else h.to(torch.uint8), h.to(hdt), cb,
                     T, P)
            P = min(P, _resident_programs(dummy, meta, device) or P)
    P = max(1, min(P, scratch_bytes // per_prog))
    # scratch, allocated once per call and reused by every wave of P*tpp tiles
    hist = torch.empty((P, tpp, nslot, E), dtype=hdt, device=device)
    bp = hist if recomp else torch.empty((P, tpp, N, E), dtype=torch.uint8, device=device)
    _viterbi_kernel[(P,)](tgt, states, values, bp, hist, cb, T, P, **meta)
    return states, values


def encode_tiles(
    targets: torch.Tensor,
    bits,
    codebook: str,
    *,
    programs: Optional[int] = None,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    **config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tail-biting Viterbi encode of ``targets`` (fp32 ``[T, 256]``, stream order) with Triton.

    Returns ``(states int16 [T, 256], values float32 [T, 256])`` on the device of ``targets``:
    full 16-bit states (two's complement) and their codebook values. ``bits``: 1..8
    (half-integer rates raise NotImplementedError); ``codebook``: 3inst, mcg or mul1.

    Optional: ``programs`` caps the persistent grid (default: what is resident at once);
    ``scratch_bytes`` caps the scratch memory (the grid shrinks to fit; also capped at half the
    free device memory); ``**config`` overrides ``DEFAULT_CONFIG[bits]`` (see CONFIG_KEYS).
    """
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed: the GPU Viterbi backend needs the 'gpu' extra")
    K = _check_bits(bits)
    cb_id = CODEBOOK_IDS[check_codebook(codebook)]
    if not isinstance(targets, torch.Tensor):
        raise TypeError("targets must be a torch.Tensor")
    if targets.dim() != 2 or targets.shape[1] != TILE:
        raise ValueError(f"targets must be [T, {TILE}], got {tuple(targets.shape)}")
    cfg = launch_config(K, **config)
    tgt = targets.detach().to(torch.float32).contiguous()
    return _encode(tgt, K, STATE_BITS, cb_id, None, cfg, programs, scratch_bytes)


def precompile(bits, codebook: str, device="cuda", **config):
    """Compile (into Triton's cache) the kernel that ``encode_tiles`` launches for these
    arguments without running it; returns Triton's compiled kernel."""
    K = _check_bits(bits)
    cfg = launch_config(K, **config)
    meta = _plan(K, STATE_BITS, TILE, cfg)
    table = codebook_values(check_codebook(codebook)) if cfg["lut"] else None
    tab = _codebook_args(meta, CODEBOOK_IDS[codebook], table, cfg["lut"], device)
    f = torch.empty(16, dtype=torch.float32, device=device)
    i = torch.empty(16, dtype=torch.int16, device=device)
    h = f.to(torch.float16) if meta["C16"] else f
    bp = h if meta["RECOMP"] else f.to(torch.uint8)
    cb = f if tab is None else tab
    return _viterbi_kernel.warmup(f, i, f, bp, h, cb, 65536, 1024, grid=(1,), **meta)


def encode_tiles_custom(targets: torch.Tensor, K: int, table: torch.Tensor, L: int, *,
                        programs: Optional[int] = None, **config):
    """The same kernel on a generic trellis (state width ``L``, ``N = targets.shape[1]``
    positions (a multiple of 4), codebook ``table`` of ``2^L`` values), for tests. Returns
    (states int64 [T, N], values fp32). Config defaults: tpp 1, one chunk per step, 4 warps."""
    tgt = targets.detach().to(torch.float32).contiguous()
    cfg = dict(_BASE_CONFIG, num_warps=4, chunk=1 << (L - K), tpp=1, lut="fp32")
    cfg.update({k: v for k, v in config.items() if v is not None})
    states, values = _encode(tgt, K, L, CB_TABLE, table, cfg,
                             tgt.shape[0] if programs is None else programs, DEFAULT_SCRATCH_BYTES)
    return states.to(torch.int64) & ((1 << L) - 1), values
