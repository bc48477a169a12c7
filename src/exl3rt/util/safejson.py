"""JSON from untrusted files, parsed with bounds checked first.

``json.loads`` recurses once per nesting level, so a few hundred kilobytes of ``[[[[`` raise RecursionError
(or worse, exhaust the C stack in other parsers). :func:`loads_bounded` checks the size and the nesting depth
without recursion before ``json.loads`` sees the text: JSON strings are cut out with a regular expression
(brackets inside strings do not nest), then the brackets that remain are counted.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Union

MAX_DEPTH = 8  # cache entries nest 3 levels at most (header -> tensor -> shape)

# A JSON string, or an unterminated one up to the end (so that every match ends the scan: linear time).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth_exceeds(text: str, max_depth: int) -> bool:
    """True if ``text`` opens more than ``max_depth`` nested arrays/objects (strings ignored; no recursion)."""
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate object key {k[:40]!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads_bounded(text: Union[str, bytes], *, max_bytes: int, max_depth: int = MAX_DEPTH, strict: bool = True) -> Any:
    """``json.loads(text)`` for text from a file we do not trust; raises ValueError with a one-line reason.

    Rejected before parsing: more than ``max_bytes`` (characters for ``str``), nesting deeper than
    ``max_depth``. With ``strict`` (what we write ourselves, e.g. cache entries), also rejected: NaN/Infinity,
    duplicate object keys (another parser could pick the other value), numbers too large for a float;
    without it (a model's config.json, which Python's json writes with NaN) those parse as ``json.loads`` does.
    """
    if len(text) > max_bytes:
        raise ValueError(f"{len(text)} bytes of JSON, more than the limit of {max_bytes}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("not UTF-8") from None
    if json_depth_exceeds(text, max_depth):
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    try:
        if not strict:
            return json.loads(text)
        return json.loads(text, object_pairs_hook=_unique_pairs, parse_constant=_no_constant,
                          parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg}: character {exc.pos})") from None


__all__ = ["MAX_DEPTH", "json_depth_exceeds", "loads_bounded"]
