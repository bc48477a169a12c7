"""Where a checkpoint may be written, and which files in that directory a write may replace or remove.

Every writer of an EXL3 checkpoint (``exl3rt quantize``, ``save_pretrained`` / :func:`~exl3rt.runtime.export.
save_exl3`, ``exl3rt example``, rank-sliced checkpoints) asks :func:`check_output` before it reads or writes
anything; the rule (docs/format.md, "Output directories") is:

- **Location.** OUT may not be, lie inside, or contain a protected path: the source model, the encoding cache
  root. Symbolic links are resolved first.
- **Without overwrite** OUT is new or empty. Only what an interrupted exl3rt write leaves (its work folder, its
  ``*.partial`` shards, its temporaries) may be there; anything else is refused with the list of what is there.
- **With overwrite** (and in ``save_pretrained``, which replaces its own earlier files as transformers does) the
  write replaces or removes only *owned* files: those of exl3rt's checkpoint layout (:data:`LAYOUT_NAMES`,
  :data:`SHARD_NAME`) and those the previous exl3rt write listed in its manifest (``quantization_config.json``
  ``"files"``). A file this write would create that is not owned (e.g. a ``tokenizer.json`` exl3rt did not put
  there) is refused; every other file is left as it is. Weights of another layout (``model.safetensors``,
  ``pytorch_model.bin``, …) are refused too: a loader could read them instead of the EXL3 shards.

What a checkpoint carries over from its source directory is decided here too: :func:`side_files` (``exl3rt
quantize``: every top-level file that holds no weights) and :func:`tokenizer_files` (``save_pretrained``: the
tokenizer, so that the checkpoint runs on its own).
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Optional

from ..util.fs import temp_target
from ..util.names import file_name_problem
from ..util.tensorfiles import CONFIG_NAME, INDEX_NAME, TensorFileError, read_json
from .checkpoint import QCONFIG_NAME
from .errors import FormatError

#: the files of an EXL3 checkpoint as exl3rt writes it (beside the shards); a write replaces them whole
CARD_NAME = "README.md"
GENERATION_NAME = "generation_config.json"
LAYOUT_NAMES = frozenset({CONFIG_NAME, INDEX_NAME, QCONFIG_NAME, CARD_NAME, GENERATION_NAME})
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: a shard being written (renamed to its :data:`SHARD_NAME` when the checkpoint is finished)
PARTIAL_SUFFIX = ".safetensors.partial"
PARTIAL_NAME = re.compile(r"part-\d{5}" + re.escape(PARTIAL_SUFFIX))
#: ``exl3rt quantize``'s resumable work folder inside OUT
WORK_DIR = ".exl3rt-work"
#: the manifest: ``quantization_config.json[MANIFEST_KEY]`` lists every file the write published
MANIFEST_KEY = "files"

#: weights in other formats: never copied beside an EXL3 checkpoint, and refused in its directory
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz")


#: a model's tokenizer files (and chat template): what turns text into ids beside the weights
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model",
                      "chat_template*")


def side_files(src_dir: str | os.PathLike[str]) -> list[Path]:
    """The source directory's top-level files an EXL3 checkpoint carries over unchanged — tokenizer files, the
    generation config, a chat template, a README: every regular file except weights (by suffix), weight indexes
    (``*.index.json``), ``config.json`` and ``quantization_config.json`` (written anew) and hidden files."""
    return sorted(p for p in Path(src_dir).iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name not in (CONFIG_NAME, QCONFIG_NAME)
                  and not p.name.endswith((".index.json", *WEIGHT_SUFFIXES)))


def tokenizer_files(src_dir: str | os.PathLike[str]) -> list[Path]:
    """The tokenizer files among :func:`side_files` (:data:`TOKENIZER_PATTERNS`): what a checkpoint needs beside
    its weights to be run on text."""
    return [p for p in side_files(src_dir) if any(fnmatch.fnmatchcase(p.name, pat) for pat in TOKENIZER_PATTERNS)]


def is_layout_name(name: str) -> bool:
    """A file of exl3rt's checkpoint layout (shards, index, configs, model card, generation config)."""
    return name in LAYOUT_NAMES or bool(SHARD_NAME.fullmatch(name))


def is_transient_name(name: str) -> bool:
    """What an interrupted exl3rt write leaves: its work folder, partial shards and atomic temporaries."""
    if name == WORK_DIR or PARTIAL_NAME.fullmatch(name):
        return True
    target = temp_target(name)
    return target is not None and (is_layout_name(target) or bool(PARTIAL_NAME.fullmatch(target)))


def is_foreign_weights(name: str) -> bool:
    """Weights or a weight index of another layout (a loader may read them instead of ours)."""
    if SHARD_NAME.fullmatch(name) or name == INDEX_NAME:
        return False
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


def manifest(out: Path) -> frozenset[str]:
    """The files an earlier exl3rt write into ``out`` listed as its own (empty when there is none, or when the
    record is not exl3rt's or cannot be read: nothing is owned on a guess)."""
    path = out / QCONFIG_NAME
    if not path.is_file() or path.is_symlink():
        return frozenset()
    try:
        qc = read_json(path)
    except (TensorFileError, OSError):
        return frozenset()
    files = qc.get(MANIFEST_KEY)
    if qc.get("quantizer") != "exl3rt" or not isinstance(files, list):
        return frozenset()
    return frozenset(f for f in files if isinstance(f, str) and file_name_problem(f) is None)


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(path)))


def check_location(out: str | os.PathLike[str], protect: Mapping[str, Optional[str | os.PathLike[str]]]) -> None:
    """Refuse an OUT that is, lies inside, or contains one of ``protect`` (what -> path; None entries skipped)."""
    o = _resolved(Path(out))
    for what, path in protect.items():
        if path is None:
            continue
        p = _resolved(Path(path))
        if o == p:
            how = f"is {what} ({p})"
        elif p in o.parents:
            how = f"lies inside {what} ({p})"
        elif o in p.parents:
            how = f"contains {what} ({p})"
        else:
            continue
        raise FormatError(f"{out}: the output directory {how}; writing there could replace or delete files that "
                          f"are not this checkpoint's: choose a directory outside it")


def _listing(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output(out: str | os.PathLike[str], *, overwrite: bool, writes: Iterable[str] = (),
                 owned: Iterable[str] = (), protect: Mapping[str, Optional[str | os.PathLike[str]]] = {},
                 option: str = "--overwrite") -> frozenset[str]:
    """Check that a checkpoint may be written into ``out`` (the module docstring's rule); return the names already
    there that the write may replace or remove. Nothing is read but directory entries and the manifest; nothing is
    written. ``writes``: files the write creates besides its layout (side files such as a tokenizer). ``owned``:
    names the caller knows are its own (a resumed run's side files). ``option``: how the caller spells overwrite."""
    out = Path(out)
    check_location(out, protect)
    if out.exists() and not out.is_dir():
        raise FormatError(f"{out}: exists and is not a directory")
    if not out.is_dir():
        return frozenset()
    present = sorted(e.name for e in os.scandir(out) if not is_transient_name(e.name))
    if not overwrite:
        foreign = [n for n in present if n not in set(owned)]
        if foreign:
            raise FormatError(f"{out}: not empty ({_listing(foreign)}); choose a new or empty directory, or pass "
                              f"{option} to replace the EXL3 checkpoint files there (other files are kept)")
        return frozenset(present)
    mine = manifest(out) | frozenset(owned)
    replaceable = {n for n in present if is_layout_name(n) or n in mine}
    weights = [n for n in present if is_foreign_weights(n) and n not in replaceable]
    if weights:
        raise FormatError(f"{out}: holds weights of another layout ({_listing(weights)}), which a loader could read "
                          f"instead of the EXL3 checkpoint; move or delete them, or choose another directory")
    clash = sorted(n for n in set(writes) if n in present and n not in replaceable)
    if clash:
        raise FormatError(f"{out}: the checkpoint would replace {_listing(clash)}, which exl3rt did not write; move "
                          f"or delete them, or choose another directory")
    return frozenset(replaceable)
