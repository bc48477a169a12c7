"""The passes around the tiered MoE launches: packing, gather, rotations, activation, weighted sum.

:func:`exl3rt.kernels.moe.exl3_moe` (fused path) runs six launches::

    pack     moe_pack_kernel   pack_routes in one program, a sort of NP (64 or 1024) keys (same outputs;
                                T·k <= PACK_MAX_ROUTES, else the torch packer)
    pre      moe_pre_kernel    x'[p, s] = (x[tok(s)] ⊙ suh_p[e(s)])·H   fp16; p = gate, up (or one shared);
                                zero rows for padding slots (a program of padding slots only writes
                                nothing: no pass reads their rows); pos[route] = slot (the inverse permutation)
    gate+up  _moe_mma_kernel    one launch for both projections: split-K partials zgu[p, split, slot, I]
    mid      moe_mid_kernel    h'[s] = ((silu(Σ zg·H ⊙ gate_svh) · (Σ zu·H ⊙ up_svh)) ⊙ down_suh)·H   fp16
    down     _moe_mma_kernel    zd[split, slot, H]
    post     moe_post_kernel   y[t] = Σ_j w[t, j] · (Σ zd[:, pos[t·k + j]]·H ⊙ down_svh[e])   x.dtype

Everything is blockwise per 128 columns (the Hadamard blocks), per slot; ``e(s)`` is the slot's block
expert ``block_experts[s // block_m]``. Only slots below ``num_padded`` are live: the tiered launches
leave the partials of the other slots unwritten (buffers come from ``torch.empty``), so every pass masks
by ``num_padded``, and ``post`` only reads the slots that ``pos`` names (clamped into the buffer) and only
adds those where ``sorted_routes[pos[r]] == r`` (``pos`` is never cleared: a stale or garbage entry fails the
check, so a dropped route contributes nothing). The passes issue their index loads (num_padded, the slots'
routes and block experts; in the post-pass the routes, block experts and partials at ``pos``) together and
mask afterwards: one or two dependent loads fewer per pass. The post pass is deterministic: one program per
(token, 128 columns) sums the token's k routes in registers. No pass reads a value back to the host, and every
buffer is sized by the pack's capacity, so the whole call is CUDA-graph capturable.
"""

from __future__ import annotations

from ._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from ._triton import HAVE_GDC
    from .hadamard import HAD_SCALE_C, fwht128, frag_offsets

    if HAVE_GDC:
        from ._triton import gdc_launch_dependents, gdc_wait
    else:  # pragma: no cover - a Triton without grid dependency control: PDL is never asked for
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def _pdl_start(PDL: tl.constexpr, FIRST_TRIGGER: tl.constexpr):
        """Programmatic dependent launch (``PDL``): wait for the previous launch's writes and let the next launch
        start — trigger first (``FIRST_TRIGGER``), or only once this program has waited, so that a dependent
        launched early finds every launch before this one complete (the tiered launch reads the packer's block
        experts before its own wait)."""
        if PDL:
            if FIRST_TRIGGER:
                gdc_launch_dependents()
                gdc_wait()
            else:
                gdc_wait()
                gdc_launch_dependents()

    @triton.jit
    def _sum_splits(ptr, offs, mask, splits, stride_s, SB: tl.constexpr, BR: tl.constexpr):
        """Σ_split ptr[split·stride_s + offs] for ``offs/mask [BR, 128]`` (SB splits per load), fp32."""
        acc = tl.zeros([BR, 128], tl.float32)
        sb = tl.arange(0, SB)
        for s0 in range(0, splits, SB):
            sm = (s0 + sb) < splits
            blk = tl.load(ptr + (s0 + sb).to(tl.int64)[:, None, None] * stride_s + offs[None, :, :],
                          mask=sm[:, None, None] & mask[None, :, :], other=0.0)
            acc += tl.sum(blk, axis=0)
        return acc

    @triton.jit
    def _bucket(ids_ptr, map_ptr, idx, mask, n_map, E, EP: tl.constexpr):
        """Combined expert of routes ``idx`` (router id through the expert map), EP where dropped."""
        gid = tl.load(ids_ptr + idx, mask=mask, other=-1)
        in_map = mask & (gid >= 0) & (gid < n_map)
        b = tl.load(map_ptr + tl.where(in_map, gid, 0), mask=in_map, other=-1).to(tl.int32)
        return tl.where(in_map & (b >= 0) & (b < E), b, EP)

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit(do_not_specialize=["numel", "n_map", "cap", "max_blocks"])
    def moe_pack_kernel(ids_ptr, map_ptr, routes_ptr, blk_ptr, npad_ptr, counts_ptr, scratch_ptr,
                         numel, n_map, E, cap, max_blocks,
                         NP: tl.constexpr, EP: tl.constexpr, FB: tl.constexpr, BLOCK_M: tl.constexpr,
                         PDL: tl.constexpr = False):
        """:func:`~exl3rt.kernels.routing.pack_routes` in one program (same outputs, bit for bit). The routes
        (NP ≥ numel, a power of two) are sorted by the key ``expert·NP + route`` (stable by construction;
        dropped routes and lanes past numel get expert EP and sort last). In sorted order, a run of one
        expert starts where the expert changes (neighbours read back from ``scratch_ptr [NP]`` after a
        barrier): rank = position − run start, and the run's padded length sits on its last element, so
        an exclusive cumsum gives every run's first slot. ``block_experts[slot // BLOCK_M] = expert`` for
        every route's slot names every live block (no block of a run is padding only)."""
        _pdl_start(PDL, True)
        i = tl.arange(0, NP)
        b = _bucket(ids_ptr, map_ptr, i, i < numel, n_map, E, EP)
        sk = tl.sort(b * NP + i)
        sb = sk // NP
        si = sk % NP
        valid = sb < EP
        tl.store(scratch_ptr + i, sb)
        ev = tl.arange(0, EP)
        tl.store(counts_ptr + ev, ev * 0, mask=ev < E)
        fc = tl.arange(0, FB)
        for f0 in range(0, cap, FB):
            tl.store(routes_ptr + f0 + fc, numel + fc * 0, mask=(f0 + fc) < cap)
        for f0 in range(0, max_blocks, FB):
            tl.store(blk_ptr + f0 + fc, fc * 0 - 1, mask=(f0 + fc) < max_blocks)
        tl.debug_barrier()                        # the sorted experts and the fills are visible
        prev = tl.load(scratch_ptr + i - 1, mask=i > 0, other=-1)
        nxt = tl.load(scratch_ptr + i + 1, mask=i < NP - 1, other=-1)
        run_start = tl.associative_scan(tl.where(sb != prev, i, 0), 0, _max_combine)
        rank = i - run_start
        plast = tl.where(valid & (sb != nxt), (rank + BLOCK_M) // BLOCK_M * BLOCK_M, 0)
        dest = tl.cumsum(plast, 0) - plast + rank
        tl.store(routes_ptr + dest, si, mask=valid)
        tl.store(blk_ptr + dest // BLOCK_M, sb, mask=valid)
        tl.store(counts_ptr + tl.where(valid, sb, 0), rank + 1, mask=valid & (sb != nxt))
        tl.store(npad_ptr, tl.sum(plast, axis=0))

    @triton.jit
    def _slot_routes(routes_ptr, blk_ptr, npad_ptr, slots, numel, BR: tl.constexpr, BLOCK_M: tl.constexpr):
        """This program's slots ``s`` (BR of them), columns ``c`` (one 128-block), which slots exist (below
        ``num_padded`` and ``slots``), their routes ``r``, which are live (an existing slot holding a route, not
        padding) and their block experts ``e`` (int64, 0 where not live). The routes and block experts are loaded
        with num_padded, not after it (every slot below ``slots`` is in the buffers; past num_padded the values are
        stale and masked by ``live``)."""
        s = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * 128 + tl.arange(0, 128)
        smask = s < tl.minimum(tl.load(npad_ptr), slots)
        r = tl.load(routes_ptr + s, mask=s < slots, other=numel)
        eb = tl.load(blk_ptr + s // BLOCK_M, mask=s < slots, other=0)
        live = smask & (r < numel)
        return s, c, smask, r, live, tl.where(live, tl.maximum(eb, 0), 0).to(tl.int64)

    @triton.jit
    def _slot_offsets(s, c, n, FRAG: tl.constexpr):
        """fp16 offsets of elements (slot ``s``, column ``c``) of a ``[slots, n]`` pass output: row-major,
        or (FRAG 1/2) the tiered launch's fragment order (16-row A / 8-row B fragments, route blocks are
        whole row blocks)."""
        if FRAG:
            return frag_offsets(s.to(tl.int64)[:, None], c[None, :], n * (4 if FRAG == 2 else 8), FRAG == 2)
        return s.to(tl.int64)[:, None] * n + c[None, :]

    @triton.jit
    def _zero_rows(z_ptr, s, live, n, pstride, NP: tl.constexpr, BR: tl.constexpr):
        """z[p, s, :] = 0 for the live slots ``s`` (``[BR]``) of NP projections (rows of ``n``, projections
        ``pstride`` apart), the 128-blocks shared out over the programs of grid axis 1."""
        nb = n // 128
        zc = tl.arange(0, 128)
        for blk in range(tl.program_id(1), NP * nb, tl.num_programs(1)):
            pz = (z_ptr + (blk // nb).to(tl.int64) * pstride + s.to(tl.int64)[:, None] * n + (blk % nb) * 128
                  + zc[None, :])
            tl.store(pz, tl.zeros([BR, 128], tl.float32), mask=live[:, None])

    @triton.jit(do_not_specialize=["slots", "numel", "k", "stride_x", "two"])
    def moe_pre_kernel(x_ptr, routes_ptr, blk_ptr, npad_ptr, su_ptr, sg_ptr, xs_ptr, pos_ptr,
                        slots, numel, k, H, stride_x, su_se, sg_se, stride_xsp, two,
                        BR: tl.constexpr, BLOCK_M: tl.constexpr, FRAG: tl.constexpr = 0,
                        zz_ptr=None, zz_n=0, zz_pstride=0, ZNP: tl.constexpr = 0, PDL: tl.constexpr = False):
        """Slots ``program_id(0)·BR …``, columns ``program_id(1)·128 …``: x' = (x[tok] ⊙ suh[e])·H, zero
        for the padding slots of a program with a live slot (a program of padding slots only writes nothing:
        a row of x' only reaches its own row of the partials, which no pass reads; nothing past
        ``num_padded``); pos[r] = slot. ``two`` = 1: x'_gate at ``xs``,
        x'_up at ``xs + stride_xsp`` (the order of the gate+up launch's projections); 0: x'_up (shared
        with gate) at ``xs``. ``two`` is a runtime value, not a specialization: one compiled kernel (and
        one prewarm) serves both. ``FRAG``: x' in the tiered launch's fragment order (:func:`_slot_offsets`).
        ``ZNP`` > 0: also zero the live slots' rows of the gate+up launch's accumulation buffer
        (``zz [ZNP, slots, zz_n]``, projections ``zz_pstride`` apart). ``PDL``: :func:`_pdl_start` (trigger after
        the wait)."""
        _pdl_start(PDL, False)
        s, c, smask, r, live, e = _slot_routes(routes_ptr, blk_ptr, npad_ptr, slots, numel, BR, BLOCK_M)
        if tl.max(live.to(tl.int32), axis=0) > 0:      # padding-only programs write nothing
            tok = tl.where(live, r // k, 0).to(tl.int64)
            xv = tl.load(x_ptr + tok[:, None] * stride_x + c[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            so = _slot_offsets(s, c, H, FRAG)
            su = tl.load(su_ptr + e[:, None] * su_se + c[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            yu = fwht128(xv * (su * HAD_SCALE_C), BR)
            tl.store(xs_ptr + two * stride_xsp + so, yu.to(tl.float16), mask=smask[:, None])
            if two != 0:
                sg = tl.load(sg_ptr + e[:, None] * sg_se + c[None, :], mask=live[:, None], other=0.0).to(tl.float32)
                yg = fwht128(xv * (sg * HAD_SCALE_C), BR)
                tl.store(xs_ptr + so, yg.to(tl.float16), mask=smask[:, None])
            if tl.program_id(1) == 0:
                tl.store(pos_ptr + tl.where(live, r, 0), s, mask=live)
            if ZNP > 0:
                _zero_rows(zz_ptr, s, live, zz_n, zz_pstride, ZNP, BR)

    @triton.jit(do_not_specialize=["slots", "splits", "numel"])
    def moe_mid_kernel(z_ptr, routes_ptr, blk_ptr, npad_ptr, gsv_ptr, usv_ptr, dsu_ptr, h_ptr,
                        slots, numel, I, splits, stride_zs, stride_zp, g_se, u_se, d_se,
                        GATED: tl.constexpr, BR: tl.constexpr, SB: tl.constexpr, BLOCK_M: tl.constexpr,
                        FRAG: tl.constexpr = 0, zz_ptr=None, zz_n=0, ZERO_D: tl.constexpr = False,
                        PDL: tl.constexpr = False):
        """h'[s, cols] = ((silu(g)·u) ⊙ down_suh[e])·H (ungated: silu(u)), g/u = (Σ_split z)·H ⊙ svh[e];
        padding slots get zero rows without reading their partials (none in a program of padding slots only,
        see the pre-pass), nothing past ``num_padded``. ``FRAG``:
        h' in the down launch's fragment order (:func:`_slot_offsets`). ``ZERO_D``: also zero the live slots' rows
        of the down launch's accumulation buffer (``zz [slots, zz_n]``). ``PDL``: :func:`_pdl_start` (trigger after
        the wait)."""
        _pdl_start(PDL, False)
        s, c, smask, _, live, e = _slot_routes(routes_ptr, blk_ptr, npad_ptr, slots, numel, BR, BLOCK_M)
        if tl.max(live.to(tl.int32), axis=0) > 0:      # padding-only programs write nothing
            offs = s.to(tl.int64)[:, None] * I + c[None, :]
            m2 = live[:, None]
            if GATED:
                zu_ptr = z_ptr + stride_zp
            else:
                zu_ptr = z_ptr
            usv = tl.load(usv_ptr + e[:, None] * u_se + c[None, :], mask=m2, other=0.0).to(tl.float32)
            u = fwht128(_sum_splits(zu_ptr, offs, m2, splits, stride_zs, SB, BR), BR) * (usv * HAD_SCALE_C)
            if GATED:
                gsv = tl.load(gsv_ptr + e[:, None] * g_se + c[None, :], mask=m2, other=0.0).to(tl.float32)
                g = fwht128(_sum_splits(z_ptr, offs, m2, splits, stride_zs, SB, BR), BR) * (gsv * HAD_SCALE_C)
                h = g / (1.0 + tl.exp(-g)) * u
            else:
                h = u / (1.0 + tl.exp(-u))
            dsu = tl.load(dsu_ptr + e[:, None] * d_se + c[None, :], mask=m2, other=0.0).to(tl.float32)
            hd = fwht128(h * (dsu * HAD_SCALE_C), BR)
            tl.store(h_ptr + _slot_offsets(s, c, I, FRAG), hd.to(tl.float16), mask=smask[:, None])
            if ZERO_D:
                _zero_rows(zz_ptr, s, live, zz_n, 0, 1, BR)

    @triton.jit(do_not_specialize=["numel", "splits", "cap"])
    def moe_post_kernel(z_ptr, routes_ptr, pos_ptr, blk_ptr, w_ptr, sv_ptr, y_ptr,
                         numel, k, H, splits, stride_zs, sv_se, cap,
                         KP: tl.constexpr, SB: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
        """y[t, cols] = Σ_j w[t·k + j] · ((Σ_split zd[:, slot_j, cols])·H ⊙ down_svh[e_j]) over the token's
        live routes (slot_j = pos[t·k + j], checked against sorted_routes). ``PDL``: :func:`_pdl_start`."""
        _pdl_start(PDL, True)
        t = tl.program_id(0)
        pid_c = tl.program_id(1)
        j = tl.arange(0, KP)
        jm = j < k
        r = t * k + j
        p = tl.load(pos_ptr + r, mask=jm, other=0)
        p = tl.minimum(tl.maximum(p, 0), cap - 1)              # pos is never cleared: any value is safe
        # the slot's route, block expert and partials are loaded together (p is in range whatever pos holds); a
        # route that fails the check is masked out of the sum below
        ok = jm & (tl.load(routes_ptr + p, mask=jm, other=-1) == r)
        e = tl.load(blk_ptr + p // BLOCK_M, mask=jm, other=0)
        wt = tl.load(w_ptr + r, mask=jm, other=0.0).to(tl.float32)
        c = pid_c * 128 + tl.arange(0, 128)
        m2 = ok[:, None]
        offs = p.to(tl.int64)[:, None] * H + c[None, :]
        z = _sum_splits(z_ptr, offs, jm[:, None], splits, stride_zs, SB, KP)
        e = tl.where(ok, tl.maximum(e, 0), 0).to(tl.int64)
        sv = tl.load(sv_ptr + e[:, None] * sv_se + c[None, :], mask=m2, other=0.0).to(tl.float32)
        yv = fwht128(z, KP) * (sv * (wt * HAD_SCALE_C)[:, None])
        yv = tl.where(m2, yv, 0.0)
        tl.store(y_ptr + t.to(tl.int64) * H + c, tl.sum(yv, axis=0).to(y_ptr.dtype.element_ty))


__all__: list[str] = []
