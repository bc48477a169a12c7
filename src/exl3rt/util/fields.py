"""Strict dataclass construction from dicts (JSON configs): a misspelt key is an error, never ignored."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def unknown_fields(cls: type, data: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(keys of ``data`` that are not fields of dataclass ``cls``, the valid field names), both sorted."""
    names = {f.name for f in dataclasses.fields(cls)}
    return sorted(set(data) - names), sorted(names)
