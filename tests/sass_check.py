"""SASS checks for kernels compiled for sm_90 without a GPU (Triton's bundled nvdisasm)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from typing import Optional


def _language_objects() -> list:
    """The modules and classes whose attributes Triton's interpreter patches while it runs a kernel: the
    language modules and every class defined in ``triton.language.core`` (tensor, dtype, descriptors)."""
    try:
        import triton.language as tl
    except ImportError:
        return []
    mods = [tl, tl.core, tl.math] + [m for m in (getattr(tl, "standard", None),) if m is not None]
    classes = [v for v in vars(tl.core).values() if isinstance(v, type) and v.__module__ == tl.core.__name__]
    return mods + classes


# taken when the test modules are collected, before any kernel runs in the interpreter
_LANGUAGE = [(o, dict(vars(o))) for o in _language_objects()]
_MISSING = object()


@contextlib.contextmanager
def unpatched_language():
    """``triton.language`` as it was imported, for a real compile in a process whose tests ran kernels in the
    interpreter. The interpreter swaps the language's functions for its own while a kernel runs and puts them
    back afterwards — but not after a ``@triton.jit`` function called as a device function (Triton 3.9,
    ``InterpretedFunction.__call__``), so a later compile would build through the interpreter's builder
    ("'value' object has no attribute 'dtype'"). Put back for the build, the found state restored after."""
    changed = []
    for obj, snap in _LANGUAGE:
        now = vars(obj)
        for name, value in snap.items():
            cur = now.get(name, _MISSING)
            if cur is not value:
                changed.append((obj, name, cur))
                setattr(obj, name, value)
    try:
        yield len(changed)
    finally:
        for obj, name, cur in reversed(changed):
            if cur is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, cur)


def sass_of(cubin: bytes) -> Optional[str]:
    """The SASS of ``cubin`` (``nvdisasm -c``), or None where Triton ships no nvdisasm."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True).stdout


_BUILD_TRITON = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(spec["module"]), spec["name"])
types = {**spec["args"], **{k: "constexpr" for k in spec["constexprs"]}}
sig = {n: types[n] for n in fn.arg_names if n in types}
k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=spec["constexprs"]),
                   target=GPUTarget("cuda", 90, 32), options=spec["options"])
sys.stdout.buffer.write(k.asm["cubin"])
"""


def build_sm90_triton(module: str, name: str, args: dict, constexprs: dict, **options) -> Optional[str]:
    """Compile the Triton kernel ``module.name`` for sm_90 with this machine's Triton (no GPU needed) and return
    its SASS (None without nvdisasm); ``args`` maps its runtime arguments to Triton type strings. The build runs
    in a fresh process without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit`` gives functions that
    cannot be compiled)."""
    import json
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    spec = json.dumps({"module": module, "name": name, "args": args, "constexprs": constexprs, "options": options})
    out = subprocess.run([sys.executable, "-c", _BUILD_TRITON, spec], capture_output=True, env=env, timeout=600)
    if out.returncode:
        raise RuntimeError(f"sm_90 build of {module}.{name} failed: {out.stderr.decode()[-2000:]}")
    return sass_of(out.stdout)


def build_sm90(fn, block_rows: int, args: dict, constexprs: dict, **options) -> Optional[str]:
    """Compile the Gluon kernel ``fn`` for sm_90 with this machine's Triton (no GPU needed) and return its SASS
    (None without nvdisasm). Its first argument is a TMA descriptor of fp16 x' in ``[block_rows, 64]`` boxes;
    ``args`` maps the other runtime arguments to Triton type strings."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from exl3rt.kernels import wgmma as wg
    desc = wg.TensorDescriptor.from_tensor(torch.empty(256, 1024, dtype=torch.float16), [block_rows, 64],
                                           wg.x_layout(block_rows))
    types = {"x_desc": mangle_type(desc), **args, **{k: "constexpr" for k in constexprs}}
    sig = {n: types[n] for n in fn.arg_names if n in types}           # in the kernel's argument order
    with unpatched_language():
        k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": wg.WARPS, **options})
    return sass_of(k.asm["cubin"])


def inflight_a_writes(sass: str) -> list[str]:
    """Instructions of the SASS's loops that write a register holding the A operand of a wgmma still in flight.

    Walks each loop containing HGMMAs twice (the second pass sees what the back edge carries): an HGMMA
    adds its A registers (4 from the named one) to the open group, ``gsb0`` commits it, ``WARPGROUP.DEPBAR.LE
    gsb0, n`` retires all but the newest n groups; any other instruction whose destination is in a group not
    yet retired is reported (stores write memory, not their first register)."""
    ins, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line)
        if m:
            ins.append(m.group(1))
    found = []
    for j, text in enumerate(ins):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", text)
        start = labels.get(m.group(1)) if m else None
        if start is None or start >= j or not any("HGMMA" in t for t in ins[start:j]):
            continue
        groups, open_ = [], set()
        for _ in range(2):
            for t in ins[start:j + 1]:
                if "HGMMA" in t:
                    a = re.search(r"HGMMA\S*\s+R\d+,\s*R(\d+)", t)
                    if a:
                        open_ |= {int(a.group(1)) + i for i in range(4)}
                    if "gsb0" in t:
                        groups, open_ = groups + [open_], set()
                    continue
                d = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d+)", t)
                if d:
                    keep = int(d.group(1))
                    groups = groups[len(groups) - keep:] if keep else []
                    continue
                w = re.match(r"(@!?U?P\w+\s+)?([A-Z0-9.]+)\s+R(\d+)", t)
                if w and not w.group(2).startswith(("ST", "RED", "ATOM")) and any(int(w.group(3)) in g for g in groups):
                    found.append(t)
    return found
