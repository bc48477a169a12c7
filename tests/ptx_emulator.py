"""A tiny interpreter for the PTX subset that ``exl3rt.kernels.lane_decode`` generates.

It gives CI (no GPU) an independent check of the generated inline-PTX text: each instruction is
executed with its documented semantics (PTX ISA) on Python integers / numpy fp16, and the result is
compared with ``format.reconstruct.decode_stream``.
"""

from __future__ import annotations

import re

import numpy as np

M32 = 0xFFFFFFFF


def _f16(bits: int) -> np.float16:
    return np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0]


def _bits16(v) -> int:
    return int(np.array([v], dtype=np.float16).view(np.uint16)[0])


def _prmt(a: int, b: int, sel: int) -> int:
    src = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:  # sign replicate
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def run_ptx(text: str, inputs: list[int], n_out: int) -> list[int]:
    """Execute ``text`` (one ``{ ... }`` block, ``$k`` operands) with ``$n_out ..`` = inputs (u32)."""
    env: dict[str, int] = {}
    for i, v in enumerate(inputs):
        env[f"${n_out + i}"] = v & M32

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in env:
            return env[tok]
        if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", tok):
            return int(tok, 0)
        raise KeyError(f"unknown operand {tok!r}")

    body = text.strip().lstrip("{").rstrip("}")
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        m = re.fullmatch(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)", rest.strip())
        if op == "mov.b32" and m:                     # split 32 -> two 16
            v = val(m.group(3))
            env[m.group(1)] = v & 0xFFFF
            env[m.group(2)] = v >> 16
            continue
        m = re.fullmatch(r"(\S+)\s*,\s*\{\s*(\S+)\s*,\s*(\S+)\s*\}", rest.strip())
        if op == "mov.b32" and m:                     # pack two 16 -> 32
            env[m.group(1)] = (val(m.group(2)) & 0xFFFF) | ((val(m.group(3)) & 0xFFFF) << 16)
            continue
        args = [a.strip() for a in rest.split(",")]
        d, src = args[0], [val(a) for a in args[1:]]
        if op == "mov.b32":
            r = src[0]
        elif op == "shr.b32":
            r = src[0] >> min(src[1], 32)
        elif op == "shl.b32":
            r = (src[0] << min(src[1], 32)) & M32
        elif op == "and.b32":
            r = src[0] & src[1]
        elif op == "shf.r.clamp.b32":                 # ({b, a} >> min(n, 32)) low word
            r = ((src[1] << 32 | src[0]) >> min(src[2], 32)) & M32
        elif op == "prmt.b32":
            r = _prmt(src[0], src[1], src[2])
        elif op == "lop3.b32":
            r = _lop3(src[0], src[1], src[2], src[3])
        elif op == "mul.lo.u32":
            r = (src[0] * src[1]) & M32
        elif op == "mul.hi.u32":
            r = (src[0] * src[1]) >> 32
        elif op == "mad.lo.u32":
            r = (src[0] * src[1] + src[2]) & M32
        elif op == "dp4a.u32.u32":
            a, b = src[0], src[1]
            r = (sum(((a >> (8 * i)) & 0xFF) * ((b >> (8 * i)) & 0xFF) for i in range(4)) + src[2]) & M32
        elif op == "add.rn.f16":
            r = _bits16(np.float64(_f16(src[0])) + np.float64(_f16(src[1])))   # exact sum, one rounding
        elif op == "fma.rn.f16x2":
            r = 0
            for h in range(2):
                a, b, c = (_f16(s >> (16 * h)) for s in src)
                r |= _bits16(np.float64(a) * np.float64(b) + np.float64(c)) << (16 * h)  # exact, one rounding
        else:
            raise NotImplementedError(f"ptx emulator: {op}")
        env[d] = r & M32
    return [env[f"${i}"] for i in range(n_out)]
