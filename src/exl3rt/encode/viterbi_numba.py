"""Fast CPU backend of the tail-biting Viterbi tile encoder (numba).

Same algorithm and the same fp32 arithmetic as :mod:`exl3rt.encode.viterbi_ref` (see its
docstring for the model), so both give identical states: ``d = cb[s] - w; d * d + prev`` with
no fused multiply-add, ties to the smallest ``k``.

Layout (what makes it fast)
---------------------------
One Viterbi step at position ``i`` with shifts ``D = shifts[i]``, ``D' = shifts[i+1]`` and
``M = L - D - D'`` computes, for every out-edge ``e = (m << D) | l`` (``m < 2^M``, ``l < 2^D``)::

    new[e] = min_k (cb[s] - w)^2 + prev[(k << M) | m],   s = (k << (L - D')) | (m << D) | l

Two kernels, chosen per ``(D, D')``:

* **A** (``D <= 3``, ``D' <= 4``, ``M >= 3``; K = 1..3 and the ``D <= 3`` steps of 1.5..3.5):
  for blocks of 256 ``m`` values, loops ``l`` (outer) and ``m`` (inner, vectorized, AVX-512 on this machine), with ``k`` fully
  unrolled and the running minimum and its ``uint8`` index in registers. The codebook is
  pre-permuted per ``(D, D')`` to ``TA[(l * 2^D' + k) * (2^M + pad) + m] = cb[s]`` so that the
  table, ``prev[(k << M) | m]`` and the output are all contiguous in ``m``. The ``[l][m]`` block
  is then interleaved (still in L1) into natural edge order ``(m << D) | l`` for the next step.
  Backpointers stay in ``[l][m]`` order.
* **B** (otherwise: K >= 4): loops ``m``, chunks of 4 ``k`` (unrolled), ``l`` (inner,
  vectorized, ``2^D >= 16`` lanes); natural table (rows padded), natural output, ``prev`` is a
  broadcast scalar.

Cost arrays hold edge ``e = (k << M) | m`` at ``e + (e >> M) * pad`` (rows padded by 128 bytes
when ``2^M >= 128``), and table rows are padded too: without it the ``2^D'`` rows read together
sit at multiples of 4 KiB, map to the same cache sets, and the kernel runs 2-5x slower.

Every size is a compile-time constant: the kernels and the driver are generated as source text
per ``(L, shift pattern)``, written once to ``~/.cache/exl3rt/viterbi_numba`` (or the temp
directory) and imported from there, so numba's on-disk cache (``cache=True``) works across
processes (first use of a bit width: ~2-4 s of compilation; later processes: ~0.1 s). Two
tiles advance in lockstep and share the table loads; ``num_threads`` Python threads (the kernels
release the GIL) take runs of up to 8 tile pairs from a shared queue, each thread with one
workspace for all its runs. :func:`open_costs` runs pass 1 alone (the g search's estimate).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from .. import env

from .viterbi_ref import Bits, check_bits, encode_tiles_ref, shifts_for_bits  # noqa: F401  (re-export)

__all__ = ["encode_tiles", "encode_tiles_custom", "encode_tiles_ref", "open_costs", "open_costs_custom",
           "warmup", "kernel_plan"]

_GENERATOR_VERSION = "7"
_CHUNK_K = 4    # k values per unrolled chunk in kernel B
_PAD = 32       # floats of padding after every cost-array row of 2^M floats (when M >= _PAD_MIN)
_PAD_T = 48     # floats of padding after every kernel-A table row (when M >= _PAD_MIN)
_PAD_MIN = 7    # rows shorter than 2^7 floats are not padded
_STAGGER = 96   # floats between the 4 KiB phases of the workspace arrays


def _pad(M: int) -> int:
    return _PAD if M >= _PAD_MIN else 0


def _pad_t(M: int) -> int:
    return _PAD_T if M >= _PAD_MIN else 0


def _kind_for(L: int, D: int, Dn: int) -> str:
    M = L - D - Dn
    if M < 0:
        raise ValueError(f"shift pair ({D}, {Dn}) too large for state width L={L}")
    return "A" if (D <= 3 and Dn <= 4 and M >= 3) else "B"


def kernel_plan(L: int, shifts: Sequence[int], kind: Optional[str] = None) -> tuple[tuple[int, int, int, str], ...]:
    """The distinct steps ``(D, D', D'', kernel)`` of a shift sequence (ring order, wrapping):
    shifts of the position, of the next one (the out-edge width is ``L - D'``) and of the one
    after (which fixes the memory layout the output is written in)."""
    N = len(shifts)
    trip = sorted({(int(shifts[i]), int(shifts[(i + 1) % N]), int(shifts[(i + 2) % N])) for i in range(N)})
    for D, Dn, _ in trip:
        _kind_for(L, D, Dn)
    return tuple((D, Dn, Dnn, kind or _kind_for(L, D, Dn)) for D, Dn, Dnn in trip)


def _pairs(plan) -> list[tuple[int, int, str]]:
    """Distinct (D, D', kernel) of a plan, in a fixed order (one table each)."""
    return sorted({(D, Dn, kind) for D, Dn, _, kind in plan})


# Memory layout of a cost array read by a step with M = L - D - D' middle bits: edge
# e = (k << M) | m lives at e + (e >> M) * _pad(M) (rows of 2^M floats, padded so the 2^D'
# rows read together do not map to the same cache sets).


def _block_m(D: int, M: int) -> int:
    """m values per block of the fused kernel A (its [l][m] block stays in L1)."""
    return min(512 if D <= 1 else 256, 1 << M)


def _gen_kernel_a(L: int, D: int, Dn: int, Dnn: int) -> str:
    """Kernel A, fused with the interleave: per block of MB m values, compute the [l][m] block
    into the small buffers rs0/rs1, then write it to the next step's layout of e = (m << D) | l."""
    nl, nk, M = 1 << D, 1 << Dn, L - D - Dn
    nm = 1 << M
    sT, sP = nm + _pad_t(M), nm + _pad(M)
    MB = _block_m(D, M)
    sR = MB + 16
    Mn = L - Dn - Dnn
    pn = _pad(Mn)
    per = MB if pn == 0 else min(MB, (1 << Mn) // nl)   # m values per contiguous output run
    assert per >= 1 and MB % per == 0
    s = [f"@njit(**_J)", f"def kA_{D}_{Dn}_{Dnn}(T, p0, o0, b0, w0, p1, o1, b1, w1, rs0, rs1):"]
    s.append(f"    for mb in range(0, {nm}, {MB}):")
    s.append(f"        for l in range({nl}):")
    s.append(f"            tb = l * {nk * sT} + mb")
    s.append(f"            rb = l * {sR}")
    s.append(f"            bb = l * {nm} + mb")
    s.append(f"            for mi in range({MB}):")
    for k in range(nk):
        s.append(f"                t{k} = T[tb + {k * sT} + mi]")
    for j in range(2):
        for k in range(nk):
            s.append(f"                d{k} = t{k} - w{j}")
            s.append(f"                v{k} = d{k} * d{k} + p{j}[{k * sP} + mb + mi]")
        s.append(f"                best = v0")
        s.append(f"                arg = np.uint8(0)")
        for k in range(1, nk):
            s.append(f"                c = v{k} < best")
            s.append(f"                best = v{k} if c else best")
            s.append(f"                arg = np.uint8({k}) if c else arg")
        s.append(f"                rs{j}[rb + mi] = best")
        s.append(f"                b{j}[bb + mi] = arg")
    s.append(f"        for sb in range({MB // per}):")
    s.append(f"            m0 = mb + sb * {per}")
    if pn == 0:
        s.append(f"            ob = m0 * {nl}")
    else:
        s.append(f"            ob = m0 * {nl} + ((m0 * {nl}) >> {Mn}) * {pn}")
    s.append(f"            rb = sb * {per}")
    for j in range(2):
        s.append(f"            for mi in range({per}):")
        for l in range(nl):
            s.append(f"                o{j}[ob + mi * {nl} + {l}] = rs{j}[{l * sR} + rb + mi]")
    return "\n".join(s) + "\n"


def _gen_kernel_b(L: int, D: int, Dn: int, Dnn: int) -> str:
    nl, nk, M = 1 << D, 1 << Dn, L - D - Dn
    nm, sP = 1 << M, (1 << M) + _pad(M)
    W = L - Dn
    sTB = (1 << W) + _pad_t(W)
    Mn = L - Dn - Dnn
    pn = _pad(Mn)
    ck = min(_CHUNK_K, nk)
    s = [f"@njit(**_J)", f"def kB_{D}_{Dn}_{Dnn}(T, p0, o0, b0, w0, p1, o1, b1, w1):"]
    s.append(f"    for m in range({nm}):")
    s.append(f"        bb = m * {nl}")
    if pn == 0:
        s.append(f"        ob = bb")
    else:
        assert nl <= (1 << Mn)
        s.append(f"        ob = bb + (bb >> {Mn}) * {pn}")

    def chunk(indent: str, first: bool):
        kc = "0" if first else "kc"
        for j in range(2):
            for k in range(ck):
                s.append(f"{indent}q{j}_{k} = p{j}[({kc} + {k}) * {sP} + m]")
        s.append(f"{indent}tb = {kc} * {sTB} + bb")
        s.append(f"{indent}for l in range({nl}):")
        ind = indent + "    "
        for k in range(ck):
            s.append(f"{ind}t{k} = T[tb + {k * sTB} + l]")
        for j in range(2):
            for k in range(ck):
                s.append(f"{ind}d{k} = t{k} - w{j}")
                s.append(f"{ind}v{k} = d{k} * d{k} + q{j}_{k}")
            if first:
                s.append(f"{ind}best = v0")
                s.append(f"{ind}arg = np.uint8(0)")
                k_from = 1
            else:
                s.append(f"{ind}best = o{j}[ob + l]")
                s.append(f"{ind}arg = b{j}[bb + l]")
                k_from = 0
            for k in range(k_from, ck):
                s.append(f"{ind}c = v{k} < best")
                s.append(f"{ind}best = v{k} if c else best")
                kv = f"{k}" if first else f"kc + {k}"
                s.append(f"{ind}arg = np.uint8({kv}) if c else arg")
            s.append(f"{ind}o{j}[ob + l] = best")
            s.append(f"{ind}b{j}[bb + l] = arg")

    chunk("        ", True)
    if ck < nk:
        s.append(f"        for kc in range({ck}, {nk}, {ck}):")
        chunk("            ", False)
    return "\n".join(s) + "\n"


def _padded_size(width: int, M: int) -> int:
    return (1 << width) + ((1 << width) >> M) * _pad(M)


def _gen_module(L: int, plan: tuple[tuple[int, int, int, str], ...]) -> str:
    pairs = _pairs(plan)
    # largest cost array (over every layout used) and r buffer; rounded to 4 KiB, then staggered
    SZ = 0
    for D, Dn, Dnn, kind in plan:
        SZ = max(SZ, _padded_size(L - D, L - D - Dn), _padded_size(L - Dn, L - Dn - Dnn))
        SZ = max(SZ, (1 << D) * (_block_m(D, L - D - Dn) + 16))
    SZ = -(-SZ // 1024) * 1024
    SZB = -(-(1 << (L - min(p[1] for p in plan))) // 4096) * 4096
    out = [
        '"""Generated by exl3rt.encode.viterbi_numba; do not edit."""',
        "import numpy as np",
        "from numba import njit",
        "_J = dict(nogil=True, cache=True, fastmath=False, boundscheck=False, error_model='numpy')",
        "",
    ]
    for D, Dn, Dnn, kind in plan:
        out.append(_gen_kernel_a(L, D, Dn, Dnn) if kind == "A" else _gen_kernel_b(L, D, Dn, Dnn))
    tab_args = ", ".join(f"tab{n}" for n in range(len(pairs)))

    def dispatch(ind: str, row: str) -> list[str]:
        r = []
        for n, (D, Dn, Dnn, kind) in enumerate(plan):
            kw = "if" if n == 0 else "elif"
            r.append(f"{ind}{kw} D == {D} and Dn == {Dn} and Dnn == {Dnn}:")
            t = pairs.index((D, Dn, kind))
            b0, b1 = (f"bp0[{row}]", f"bp1[{row}]") if row else ("bp0", "bp1")
            if kind == "A":
                r.append(f"{ind}    kA_{D}_{Dn}_{Dnn}(tab{t}, pv0, nw0, {b0}, w0, pv1, nw1, {b1}, w1, r0, r1)")
            else:
                r.append(f"{ind}    kB_{D}_{Dn}_{Dnn}(tab{t}, pv0, nw0, {b0}, w0, pv1, nw1, {b1}, w1)")
        return r

    def shifts3(ind: str, i: str) -> list[str]:
        return [f"{ind}D = shifts[{i}]",
                f"{ind}Dn = shifts[{i} + 1] if {i} + 1 < N else shifts[{i} + 1 - N]",
                f"{ind}Dnn = shifts[{i} + 2] if {i} + 2 < N else shifts[{i} + 2 - N]"]

    out += [
        "@njit(**_J)",
        "def _state(D, Dn, row, e):",
        "    # the full state at a step from its out-edge e and the step's backpointer row",
    ]
    for n, (D, Dn, kind) in enumerate(pairs):
        kw = "if" if n == 0 else "elif"
        out.append(f"    {kw} D == {D} and Dn == {Dn}:")
        if kind == "A":
            out.append(f"        k = np.int64(row[(e & {(1 << D) - 1}) * {1 << (L - D - Dn)} + (e >> {D})])")
        else:
            out.append(f"        k = np.int64(row[e])")
        out.append(f"        return (k << {L - Dn}) | e")
    out += [
        "    return np.int64(0)",
        "",
        "@njit(**_J)",
        "def _idx(D, Dn, e):",
        "    # where in-edge e of a step with shifts (D, Dn) lives in its cost array",
        f"    M = {L} - D - Dn",
        f"    if M >= {_PAD_MIN}:",
        f"        return e + (e >> M) * {_PAD}",
        "    return e",
        "",
        "@njit(**_J)",
        "def _argmin(c, D, Dn):",
        "    # first index of the smallest value among the in-edges of a (D, Dn) step; 0 if none < inf",
        "    best = np.inf",
        "    e = 0",
        f"    for q in range(1 << ({L} - D)):",
        "        x = c[_idx(D, Dn, q)]",
        "        if x < best:",
        "            best = x",
        "            e = q",
        "    return e",
        "",
        f"WS_F32 = {6 * SZ + 6 * _STAGGER}",
        f"SZB = {SZB}",
        f"BP_GAP = {4 * _STAGGER}",
        "",
    ]

    def views(bp_rows: str) -> list[str]:
        # the workspace (ws: WS_F32 floats; bpw: 2 * rows * SZB + BP_GAP bytes) split into the cost
        # arrays and the backpointer rows of both tiles ("1": one flat scratch row each)
        return [
            f"    x0 = ws[0:{SZ}]",
            f"    y0 = ws[{SZ + _STAGGER}:{2 * SZ + _STAGGER}]",
            f"    r0 = ws[{2 * SZ + 2 * _STAGGER}:{3 * SZ + 2 * _STAGGER}]",
            f"    x1 = ws[{3 * SZ + 3 * _STAGGER}:{4 * SZ + 3 * _STAGGER}]",
            f"    y1 = ws[{4 * SZ + 4 * _STAGGER}:{5 * SZ + 4 * _STAGGER}]",
            f"    r1 = ws[{5 * SZ + 5 * _STAGGER}:{6 * SZ + 5 * _STAGGER}]",
        ] + ([
            f"    bp0 = bpw[0:{SZB}]",
            f"    bp1 = bpw[{SZB + 4 * _STAGGER}:{2 * SZB + 4 * _STAGGER}]",
        ] if bp_rows == "1" else [
            f"    bp0 = bpw[0:{bp_rows} * {SZB}].reshape(({bp_rows}, {SZB}))",
            f"    bp1 = bpw[{bp_rows} * {SZB} + {4 * _STAGGER}:2 * {bp_rows} * {SZB} + {4 * _STAGGER}].reshape(({bp_rows}, {SZB}))",
        ])

    def pass1(row: str) -> list[str]:
        r = [
            "        # pass 1: positions half..N-1, 0..half-1, free start",
            "        x0[:] = 0.0",
            "        x1[:] = 0.0",
            "        pv0 = x0",
            "        nw0 = y0",
            "        pv1 = x1",
            "        nw1 = y1",
            "        for j in range(N):",
            "            i = half + j",
            "            if i >= N:",
            "                i -= N",
        ]
        r += shifts3("            ", "i")
        r += [
            "            w0 = targets[a, i]",
            "            w1 = targets[b, i]",
        ]
        r += dispatch("            ", row)
        r += [
            "            pv0, nw0 = nw0, pv0",
            "            pv1, nw1 = nw1, pv1",
        ]
        return r

    # pass 1 only (the open-path minimum), backpointers into one scratch row per tile
    out += ["@njit(**_J)",
            f"def run_costs(targets, ia, ib, shifts, costs, ws, bpw, {tab_args}):",
            "    N = shifts.shape[0]",
            "    half = N // 2"]
    out += views("1")
    out += ["    for p in range(ia.shape[0]):",
            "        a = ia[p]",
            "        b = ib[p]"]
    out += pass1("")
    out += [
        "        Dh = shifts[half]",
        "        Dh1 = shifts[half + 1] if half + 1 < N else shifts[half + 1 - N]",
        "        costs[a] = pv0[_idx(Dh, Dh1, _argmin(pv0, Dh, Dh1))]",
        "        costs[b] = pv1[_idx(Dh, Dh1, _argmin(pv1, Dh, Dh1))]",
        "",
    ]

    out += ["@njit(**_J)",
            f"def run_pairs(targets, ia, ib, shifts, cbv, states_out, values_out, info, ws, bpw, {tab_args}):",
            "    N = shifts.shape[0]",
            "    half = N // 2"]
    out += views("N")
    out += ["    for p in range(ia.shape[0]):",
            "        a = ia[p]",
            "        b = ib[p]"]
    out += pass1("j")
    out += [
        "        # final costs are laid out for the step at position half",
        "        Dh = shifts[half]",
        "        Dh1 = shifts[half + 1] if half + 1 < N else shifts[half + 1 - N]",
        "        e0 = _argmin(pv0, Dh, Dh1)",
        "        e1 = _argmin(pv1, Dh, Dh1)",
        "        info[a, 0] = pv0[_idx(Dh, Dh1, e0)]",
        "        info[b, 0] = pv1[_idx(Dh, Dh1, e1)]",
        "        for j in range(N - 1, N - half - 1, -1):",
        "            i = half + j",
        "            if i >= N:",
        "                i -= N",
        "            D = shifts[i]",
        "            Dn = shifts[i + 1] if i + 1 < N else shifts[0]",
        "            e0 = _state(D, Dn, bp0[j], e0) >> D",
        "            e1 = _state(D, Dn, bp1[j], e1) >> D",
        "        es0 = e0",
        "        es1 = e1",
        "        info[a, 1] = es0",
        "        info[b, 1] = es1",
        "        # pass 2: positions 0..N-1, in-edge of position 0 fixed to e*",
        "        D0 = shifts[0]",
        "        D1 = shifts[1]",
        "        x0[:] = np.inf",
        "        x1[:] = np.inf",
        "        x0[_idx(D0, D1, es0)] = 0.0",
        "        x1[_idx(D0, D1, es1)] = 0.0",
        "        pv0 = x0",
        "        nw0 = y0",
        "        pv1 = x1",
        "        nw1 = y1",
        "        for i in range(N):",
    ]
    out += shifts3("            ", "i")
    out += [
        "            w0 = targets[a, i]",
        "            w1 = targets[b, i]",
    ]
    out += dispatch("            ", "i")
    out += [
        "            pv0, nw0 = nw0, pv0",
        "            pv1, nw1 = nw1, pv1",
        "        info[a, 2] = pv0[_idx(D0, D1, es0)]",
        "        info[b, 2] = pv1[_idx(D0, D1, es1)]",
        "        e0 = es0",
        "        e1 = es1",
        "        for i in range(N - 1, -1, -1):",
        "            D = shifts[i]",
        "            Dn = shifts[i + 1] if i + 1 < N else shifts[0]",
        "            s0 = _state(D, Dn, bp0[i], e0)",
        "            s1 = _state(D, Dn, bp1[i], e1)",
        "            states_out[a, i] = s0",
        "            states_out[b, i] = s1",
        "            values_out[a, i] = cbv[s0]",
        "            values_out[b, i] = cbv[s1]",
        "            e0 = s0 >> D",
        "            e1 = s1 >> D",
        "",
    ]
    return "\n".join(out) + "\n"


def _cache_dir() -> Path:
    """``EXL3RT_KERNEL_CACHE_DIR`` (default ~/.cache/exl3rt/kernels)/viterbi_numba, else a per-user temp dir."""
    candidates = [Path(env.kernel_cache_dir()) / "viterbi_numba",
                  Path(tempfile.gettempdir()) / f"exl3rt-{os.getuid() if hasattr(os, 'getuid') else 'u'}" / "viterbi_numba"]
    for c in candidates:
        try:
            c.mkdir(parents=True, exist_ok=True)
            if os.access(c, os.W_OK):
                return c
        except OSError:
            continue
    raise RuntimeError("no writable directory for the generated numba kernels; set EXL3RT_KERNEL_CACHE_DIR")


_module_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _load_module(L: int, plan: tuple[tuple[int, int, int, str], ...]):
    src = _gen_module(L, plan)
    digest = hashlib.sha1((_GENERATOR_VERSION + "\n" + src).encode()).hexdigest()[:16]
    name = f"exl3rt_viterbi_gen_{digest}"
    with _module_lock:
        if name in sys.modules:
            return sys.modules[name]
        path = _cache_dir() / f"{name}.py"
        if not path.is_file() or path.read_text() != src:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(src)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod


def _tables(table: np.ndarray, L: int, plan) -> tuple[np.ndarray, ...]:
    """One table per distinct (D, D', kernel): natural for B; for A the padded
    ``[l][k][m]`` permutation ``TA[(l * 2^D' + k) * (2^M + pad) + m] = cb[(k << (L - D')) | (m << D) | l]``."""
    tabs = []
    for D, Dn, kind in _pairs(plan):
        if kind == "B":
            # natural order, rows of 2^(L - D') (one per k) padded
            W = L - Dn
            t = np.zeros((1 << Dn, (1 << W) + _pad_t(W)), dtype=np.float32)
            t[:, : 1 << W] = table.reshape(1 << Dn, 1 << W)
            tabs.append(t.reshape(-1))
            continue
        nl, nk, M = 1 << D, 1 << Dn, L - D - Dn
        nm = 1 << M
        l = np.arange(nl, dtype=np.int64)[:, None, None]
        k = np.arange(nk, dtype=np.int64)[None, :, None]
        m = np.arange(nm, dtype=np.int64)[None, None, :]
        s = (k << (L - Dn)) | (m << D) | l
        t = np.zeros((nl, nk, nm + _pad_t(M)), dtype=np.float32)
        t[:, :, :nm] = table[s]
        tabs.append(t.reshape(-1))
    return tuple(tabs)


@functools.lru_cache(maxsize=None)
def _named_setup(codebook: str, bits_key: int):
    from exl3rt.format.codebooks import codebook_values

    shifts = np.asarray(shifts_for_bits(bits_key / 2, 256), dtype=np.int64)
    table = np.ascontiguousarray(codebook_values(codebook).numpy().astype(np.float32))
    plan = kernel_plan(16, shifts)
    tabs = _tables(table, 16, plan)
    return shifts, table, plan, tabs


# --------------------------------------------------------------------------------------------
# drivers


def _default_threads() -> int:
    """numba's thread count, capped by the cores this process may run on now (a server may pin its workers after
    numba read the machine's count)."""
    import numba

    n = int(numba.get_num_threads())
    try:
        n = min(n, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):     # no affinity API (macOS)
        pass
    return max(1, n)


#: pairs of tiles per work item: threads take items from a shared queue (a core slowed by other
#: processes then takes fewer), and an item is long enough (tens of ms) to hide the hand-off
_CHUNK_PAIRS = 8


def _parallel(mod, npairs: int, num_threads: Optional[int], n_rows: int, call) -> None:
    """Run ``call(lo, hi, ws, bpw)`` over the pair ranges ``[lo, hi)`` of ``0..npairs``, on up to
    ``num_threads`` threads, each with its own workspace (``n_rows`` backpointer rows per tile)."""
    nt = max(1, min(num_threads or _default_threads(), npairs))

    def workspace():
        return (np.empty(mod.WS_F32, np.float32), np.empty(2 * n_rows * mod.SZB + mod.BP_GAP, np.uint8))

    if nt == 1:
        call(0, npairs, *workspace())
        return
    chunk = max(1, min(_CHUNK_PAIRS, npairs // (4 * nt)))
    starts = iter(range(0, npairs, chunk))
    lock = threading.Lock()

    def worker():
        ws, bpw = workspace()
        while True:
            with lock:
                lo = next(starts, None)
            if lo is None:
                return
            call(lo, min(lo + chunk, npairs), ws, bpw)

    with ThreadPoolExecutor(max_workers=nt) as ex:
        for f in [ex.submit(worker) for _ in range(nt)]:
            f.result()


def _pair_indices(T: int) -> tuple[np.ndarray, np.ndarray]:
    ia = np.arange(0, T, 2, dtype=np.int64)
    ib = np.minimum(ia + 1, T - 1)  # odd T: the last tile runs paired with itself
    return ia, ib


def _run(w: np.ndarray, shifts: np.ndarray, table: np.ndarray, L: int, plan, tabs, num_threads: Optional[int]):
    T, N = w.shape
    mod = _load_module(L, plan)
    states = np.zeros((T, N), dtype=np.int64)
    values = np.zeros((T, N), dtype=np.float32)
    info = np.zeros((T, 3), dtype=np.float64)
    if T == 0:
        return states, values, info
    ia, ib = _pair_indices(T)

    def call(lo, hi, ws, bpw):
        mod.run_pairs(w, ia[lo:hi], ib[lo:hi], shifts, table, states, values, info, ws, bpw, *tabs)

    _parallel(mod, ia.shape[0], num_threads, N, call)
    return states, values, info


def _run_costs(w: np.ndarray, shifts: np.ndarray, L: int, plan, tabs, num_threads: Optional[int]) -> np.ndarray:
    T = w.shape[0]
    mod = _load_module(L, plan)
    costs = np.zeros(T, dtype=np.float32)
    if T == 0:
        return costs
    ia, ib = _pair_indices(T)

    def call(lo, hi, ws, bpw):
        mod.run_costs(w, ia[lo:hi], ib[lo:hi], shifts, costs, ws, bpw, *tabs)

    _parallel(mod, ia.shape[0], num_threads, 1, call)
    return costs


def _to_numpy_f32(x) -> tuple[np.ndarray, bool]:
    if isinstance(x, torch.Tensor):
        return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy()), True
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)), False


def encode_tiles(targets, bits: Bits, codebook: str, *, num_threads: Optional[int] = None):
    """Tail-biting Viterbi encode of 16x16 tiles (EXL3 ``quantize_tiles``), fast CPU backend.

    ``targets``: float32 ``[T, 256]``, each row one tile's target weights in stream order.
    ``bits``: 1..8, or 1.5/2.5/3.5 (mul1 only). ``codebook``: ``"3inst"``, ``"mcg"`` or ``"mul1"``.
    ``num_threads``: worker threads (default ``numba.get_num_threads()``).

    Returns ``(states, values)``: ``states`` int16 ``[T, 256]`` (the full 16-bit state per
    position, two's complement of the uint16), ``values`` float32 ``[T, 256]`` = codebook value
    of each state. Torch tensor in -> torch tensors out (CPU); otherwise numpy arrays out.
    """
    from exl3rt.format.codebooks import check_codebook

    check_codebook(codebook)
    check_bits(bits, codebook)
    w, is_torch = _to_numpy_f32(targets)
    if w.ndim != 2 or w.shape[1] != 256:
        raise ValueError(f"targets must be [T, 256], got {tuple(w.shape)}")
    shifts, table, plan, tabs = _named_setup(codebook, int(round(float(bits) * 2)))
    states, values, _ = _run(w, shifts, table, 16, plan, tabs, num_threads)
    states16 = states.astype(np.uint16).view(np.int16)
    if is_torch:
        return torch.from_numpy(states16), torch.from_numpy(values)
    return states16, values


def _custom_setup(targets, shifts: Sequence[int], table, L: int, kind: Optional[str]):
    """Checked inputs of the generic-trellis entry points: (targets, shifts, table, kernel plan)."""
    w, _ = _to_numpy_f32(targets)
    shifts_a = np.asarray([int(d) for d in shifts], dtype=np.int64)
    N = shifts_a.shape[0]
    if w.ndim != 2 or w.shape[1] != N or N < 2:
        raise ValueError(f"targets must be [T, {N}] with N >= 2, got {tuple(w.shape)}")
    if shifts_a.min() < 1 or (shifts_a + np.roll(shifts_a, -1)).max() > L:
        raise ValueError("need shifts >= 1 and shifts[i] + shifts[i+1] <= L")
    tab, _ = _to_numpy_f32(table)
    tab = tab.reshape(-1)
    if tab.shape[0] != 1 << L:
        raise ValueError(f"table must hold 2^L = {1 << L} values")
    if kind is not None and kind not in ("A", "B"):
        raise ValueError("kind must be None, 'A' or 'B'")
    plan = kernel_plan(L, shifts_a, kind)
    return w, shifts_a, tab, plan


def encode_tiles_custom(targets, shifts: Sequence[int], table, L: int, *, kind: Optional[str] = None,
                        num_threads: Optional[int] = None, return_info: bool = False):
    """The same encoder on a generic trellis: state width ``L``, ``N = len(shifts)`` positions
    with per-position shifts, codebook ``table`` (``2^L`` values). ``kind`` forces kernel
    ``"A"`` or ``"B"`` for every step (default: chosen per step).

    Returns numpy ``(states int64 [T, N], values float32 [T, N])`` and, with ``return_info``, a
    dict of ``cost1`` (pass-1 minimum), ``estar`` (junction overlap) and ``cost2`` (pass-2 cost).
    """
    w, shifts_a, tab, plan = _custom_setup(targets, shifts, table, L, kind)
    states, values, info = _run(w, shifts_a, tab, L, plan, _tables(tab, L, plan), num_threads)
    if return_info:
        return states, values, {
            "cost1": info[:, 0].astype(np.float32),
            "estar": info[:, 1].astype(np.int64),
            "cost2": info[:, 2].astype(np.float32),
        }
    return states, values


def open_costs(targets, bits: Bits, codebook: str, *, num_threads: Optional[int] = None):
    """Pass 1 alone: per tile, the smallest squared error over *open* paths (free start and end,
    positions 128..255, 0..127) -- the ``cost1`` of :func:`encode_tiles_custom`, at half the work
    of a full encode and without states. The global-scale search uses it as its error estimate.

    ``targets`` fp32 ``[T, 256]``; returns fp32 ``[T]`` (torch in -> torch out).
    """
    from exl3rt.format.codebooks import check_codebook

    check_codebook(codebook)
    check_bits(bits, codebook)
    w, is_torch = _to_numpy_f32(targets)
    if w.ndim != 2 or w.shape[1] != 256:
        raise ValueError(f"targets must be [T, 256], got {tuple(w.shape)}")
    shifts, _, plan, tabs = _named_setup(codebook, int(round(float(bits) * 2)))
    costs = _run_costs(w, shifts, 16, plan, tabs, num_threads)
    return torch.from_numpy(costs) if is_torch else costs


def open_costs_custom(targets, shifts: Sequence[int], table, L: int, *, kind: Optional[str] = None,
                      num_threads: Optional[int] = None) -> np.ndarray:
    """:func:`open_costs` on a generic trellis (arguments as :func:`encode_tiles_custom`)."""
    w, shifts_a, tab, plan = _custom_setup(targets, shifts, table, L, kind)
    return _run_costs(w, shifts_a, L, plan, _tables(tab, L, plan), num_threads)


def warmup(bits: Bits = 4, codebook: str = "mcg") -> None:
    """Compile (or load from the on-disk cache) the kernels for one bit width."""
    encode_tiles(np.zeros((1, 256), np.float32), bits, codebook, num_threads=1)
