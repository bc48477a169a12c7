"""Names that come from files we did not write (tensor names, index entries, config fields).

Such a name may end up in a path (``exl3rt quantize`` keeps one file per finished layer, named after the
module) or in a module lookup, so it is checked before anything touches the disk: a module path is dot-
separated segments of ``[A-Za-z0-9_-]`` (no ``..``, no absolute path, no other separator), and a shard file
name in an index is one plain file name inside the model directory.
"""

from __future__ import annotations

import re
from typing import Optional

#: the output head's module name in Hugging Face causal-LM models
HEAD = "lm_head"
#: token/position embeddings (never quantized as linears)
EMBED_NAME = re.compile(r"(^|\.)(embed[a-z_]*|wte|wpe)(\.|$)")
#: MoE routers (kept dense: tiny, and their logits pick the experts)
ROUTER_NAME = re.compile(r"(^|\.)(gate|router)$")

#: the longest accepted name: with ``.safetensors`` and a temporary's affixes it stays below 255 bytes
MAX_NAME = 200

_MODULE_PATH = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def module_path_problem(name: object) -> Optional[str]:
    """Why ``name`` is not a safe module path (``model.layers.0.mlp.up_proj.weight``), or None if it is."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    if len(name) > MAX_NAME:
        return f"is {len(name)} characters long (at most {MAX_NAME})"
    if _MODULE_PATH.fullmatch(name):
        return None
    if name.startswith("/") or name.startswith("\\") or re.match(r"[A-Za-z]:", name):
        return "is an absolute path"
    if "/" in name or "\\" in name:
        return "contains a path separator"
    if ".." in name or name.startswith(".") or name.endswith("."):
        return "has an empty segment ('..', or a leading or trailing dot)"
    bad = sorted({c for c in name if not (c.isascii() and (c.isalnum() or c in "_-."))})
    return f"contains characters outside [A-Za-z0-9_.-]: {''.join(bad)!r}"


def file_name_problem(name: object) -> Optional[str]:
    """Why ``name`` is not one plain file name (``model-00001-of-00002.safetensors``), or None if it is."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name or len(name) > MAX_NAME:
        return "is empty" if not name else f"is {len(name)} characters long (at most {MAX_NAME})"
    if _FILE_NAME.fullmatch(name) and ".." not in name:
        return None
    if "/" in name or "\\" in name:
        return "is a path, not a file name in the model directory"
    return "is not a plain file name ([A-Za-z0-9_.-], no leading dot, no '..')"
