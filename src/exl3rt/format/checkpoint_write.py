"""Writing EXL3 checkpoints in exllamav3's layout, streamed and crash-safe.

Tensors are buffered into shards of at most ``max_shard_bytes`` (default 8192 MB, as exllamav3).
Each shard is written under a ``*.partial`` name, fsynced and renamed; :meth:`CheckpointWriter.finish`
gives the shards their final names ``model-0000i-of-0000N.safetensors``, copies the side files (tokenizer,
generation config, ...) and then writes ``model.safetensors.index.json``, ``quantization_config.json`` (with the
manifest: every file the write published), the model card and ``config.json`` atomically. A crash before
``finish`` leaves no index and no config, so nothing half-written looks like a checkpoint; the next writer into
the directory sweeps what the crashed one left (its partial shards and temporaries).

Which directory may be written, and what in it may be replaced or removed: :mod:`exl3rt.format.output`. One
writer at a time holds the directory (a lock on the directory itself).

What exllamav3 needs to load the result: int16 trellis, fp16 suh/svh (and bias), an int32 scalar
marker for mcg/mul1, HF module names, and ``quantization_config.quant_method == "exl3"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch

from .. import __version__
from ..util.fs import DirectoryLock, atomic_path, atomic_write_text, fsync_dir, sweep_temp_files
from ..util.names import file_name_problem
from ..util.safetensors_io import write_safetensors
from .bits import Bits
from .checkpoint import CONFIG_NAME, INDEX_NAME, QCONFIG_NAME, QUANT_METHOD
from .codebooks import MARKERS
from .encoded import EncodedLinear
from .errors import FormatError
from .output import (CARD_NAME, GENERATION_NAME, LAYOUT_NAMES, MANIFEST_KEY, PARTIAL_NAME, PARTIAL_SUFFIX, SHARD_NAME,
                     check_output, is_layout_name)

DEFAULT_SHARD_BYTES = 8192 * 2**20


class CheckpointWriter:
    """Stream linears and plain tensors into an EXL3 checkpoint directory.

    >>> with CheckpointWriter("out") as w:                   # doctest: +SKIP
    ...     w.add_linear("model.layers.0.mlp.up_proj", enc)
    ...     w.add_tensor("model.norm.weight", norm)
    ...     w.finish(base_config)
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 overwrite: bool = False, protect: Mapping[str, Any] = {}, writes: Iterable[str] = (),
                 owned: Iterable[str] = (), option: str = "overwrite=True"):
        """``overwrite``, ``protect`` (what -> path that OUT may not overlap, e.g. the source model), ``writes``
        (side files :meth:`add_file` / :meth:`add_text` will add) and ``owned`` (names the caller knows are its
        own) are :func:`exl3rt.format.output.check_output`'s; a refusal changes nothing on disk."""
        self.out_dir = Path(out_dir)
        self._check = dict(overwrite=overwrite, writes=tuple(writes), owned=tuple(owned), protect=dict(protect),
                           option=option)
        check_output(self.out_dir, **self._check)      # before anything is created
        made = not self.out_dir.exists()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._lock = DirectoryLock(self.out_dir)
        try:
            try:
                self._lock.acquire()
            except BlockingIOError:
                raise FormatError(f"{self.out_dir}: another exl3rt write into this directory is in progress; wait "
                                  f"for it to finish, or choose another directory") from None
            self._replaceable = check_output(self.out_dir, **self._check)   # as it is now that we hold it
        except BaseException:
            self._lock.release()
            if made:
                with contextlib.suppress(OSError):
                    self.out_dir.rmdir()
            raise
        self._sweep()
        self.max_shard_bytes = int(max_shard_bytes)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._parts: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self._linears: dict[str, tuple[Bits, str, dict[str, Any]]] = {}
        self._side: dict[str, Path | str] = {}
        self._total_bytes = 0
        self._finished = False

    def _sweep(self) -> None:
        """What a killed writer left here: partial shards, and temporaries of files a checkpoint write makes."""
        side = set(self._check["writes"]) | self._replaceable

        def ours(target: str) -> bool:
            return is_layout_name(target) or bool(PARTIAL_NAME.fullmatch(target)) or target in side
        sweep_temp_files(self.out_dir, owned=ours)
        for part in self.out_dir.iterdir():
            if PARTIAL_NAME.fullmatch(part.name) and part.is_file() and not part.is_symlink():
                part.unlink()

    # ---- adding --------------------------------------------------------------------------------
    def add_linear(self, name: str, linear: EncodedLinear) -> None:
        """Add one quantized linear under module key ``name`` (all its tensors go to one shard)."""
        tensors = linear.state_dict(name)
        self._add_group(tensors)
        storage = {k[len(name) + 1:]: {"shape": list(t.shape), "torch_dtype": str(t.dtype).replace("torch.", "")}
                   for k, t in tensors.items()}
        self._linears[name] = (linear.bits, linear.codebook, storage)

    def add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Add an unquantized tensor (embedding, norm, router, …) as it is."""
        self._add_group({name: tensor})

    def add_file(self, name: str, source: str | os.PathLike[str]) -> None:
        """Copy file ``source`` into the checkpoint as ``name`` (a tokenizer file, a chat template, ...) when it is
        finished; a ``README.md`` is kept inside the model card instead, under "Original model card"."""
        self._add_side(name, Path(source))

    def add_text(self, name: str, text: str) -> None:
        """Write ``text`` into the checkpoint as file ``name`` (e.g. ``generation_config.json``) when it is
        finished."""
        self._add_side(name, text)

    def _add_side(self, name: str, what: Path | str) -> None:
        if self._finished:
            raise FormatError("checkpoint writer: already finished")
        problem = file_name_problem(name)
        if problem or (name in LAYOUT_NAMES and name not in (CARD_NAME, GENERATION_NAME)) or SHARD_NAME.fullmatch(name):
            raise FormatError(f"{name!r}: not a side file a checkpoint can carry "
                              f"({problem or 'the checkpoint writes that file itself'})")
        if name not in self._replaceable and (self.out_dir / name).exists() and name not in self._check["writes"]:
            raise FormatError(f"{self.out_dir / name}: exists and exl3rt did not write it; move or delete it, or "
                              f"choose another directory")
        self._side[name] = what

    def _add_group(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._finished:
            raise FormatError("checkpoint writer: already finished")
        clash = self._names.intersection(tensors)
        if clash:
            raise FormatError(f"{sorted(clash)[0]}: added twice to the checkpoint")
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        for k, t in tensors.items():
            t = t.detach().to("cpu").contiguous()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # a view into a larger buffer: store only its own bytes
            self._pending[k] = t
        self._names.update(tensors)
        self._pending_bytes += size

    def _flush(self) -> None:
        if not self._pending:
            return
        part = self.out_dir / f"part-{len(self._parts) + 1:05d}{PARTIAL_SUFFIX}"
        with atomic_path(part) as tmp:
            write_safetensors(tmp, self._pending)
        self._parts.append((part, list(self._pending)))
        self._total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    # ---- finishing -------------------------------------------------------------------------------
    def quantization_config(self, head_name: str = "lm_head", **fields: Any) -> dict[str, Any]:
        """The ``quantization_config`` block for config.json, derived from the linears written.

        ``bits`` is the average K over all linears except ``head_name`` (rounded to 2 places, as
        exllamav3 reports it); ``head_bits`` is the head's K (16 = stored unquantized); ``bpw`` is what every
        quantized linear (the head included) really stores per weight: its codes, scales, bias and marker.
        """
        body = {k: v for k, v in self._linears.items() if k != head_name}
        weights = sum(_tile_count(v[2]) * 256 for v in body.values())
        tbits = sum(_tile_count(v[2]) * 256 * v[0] for v in body.values())
        codebooks = sorted({v[1] for v in self._linears.values()})
        qc: dict[str, Any] = {
            "quant_method": QUANT_METHOD,
            "version": __version__,
            "quantizer": "exl3rt",
            "bits": round(tbits / weights, 2) if weights else 0.0,
            "head_bits": self._linears[head_name][0] if head_name in self._linears else 16,
            "codebook": codebooks[0] if len(codebooks) == 1 else "mixed",
        }
        stored = sum(_storage_bits(v[2]) for v in self._linears.values())
        total = sum(_tile_count(v[2]) * 256 for v in self._linears.values())
        qc["bpw"] = round(stored / total, 4) if total else 0.0
        qc.update(fields)
        return qc

    def finish(self, config: Optional[dict[str, Any]] = None, *, quantization_config: Optional[dict[str, Any]] = None,
               head_name: str = "lm_head", source: Optional[str] = None) -> Path:
        """Name the shards, write the index, ``quantization_config.json``, the model card and ``config.json``;
        return the directory.

        ``config`` is the model's Hugging Face config (architectures, sizes, …); its
        ``quantization_config`` is replaced by ours (fields in ``quantization_config`` override). The model card
        (``README.md``, :func:`model_card`) names ``source``; a README already in the directory (the source's,
        carried over) follows it under "Original model card".
        """
        self._flush()
        self._finished = True
        if not self._parts:
            raise FormatError(f"{self.out_dir}: nothing was written")
        n = len(self._parts)
        weight_map: dict[str, str] = {}
        for i, (part, names) in enumerate(self._parts, start=1):
            final = self.out_dir / (f"model-{i:05d}-of-{n:05d}.safetensors")
            os.replace(part, final)
            weight_map.update({name: final.name for name in names})
        shards = set(weight_map.values())
        card_source_text = self._side.pop(CARD_NAME, None)
        written = shards | set(self._side) | {INDEX_NAME, QCONFIG_NAME, CARD_NAME, CONFIG_NAME}
        # what an earlier checkpoint here had and this one does not (only files this write may replace)
        for old in sorted(self._replaceable - written):
            path = self.out_dir / old
            if path.is_file() or path.is_symlink():
                path.unlink()
        fsync_dir(self.out_dir)
        for name, what in self._side.items():
            with atomic_path(self.out_dir / name) as tmp:
                if isinstance(what, Path):
                    shutil.copyfile(what, tmp)
                else:
                    tmp.write_text(what, encoding="utf8")
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(self.out_dir / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        qc = self.quantization_config(head_name, **(quantization_config or {}))
        side = dict(qc)
        side[MANIFEST_KEY] = sorted(written)
        side["tensor_storage"] = {
            name: {"stored_tensors": storage, "quant_format": "exl3", "bits_per_weight": bits,
                   **({f"{cb}_multiplier": MARKERS[cb] & 0xFFFFFFFF} if cb in MARKERS else {})}
            for name, (bits, cb, storage) in self._linears.items()
        }
        atomic_write_text(self.out_dir / QCONFIG_NAME, json.dumps(side, indent=2) + "\n")
        card = model_card(qc, {k: (v[0], v[1], _tile_count(v[2]) * 256) for k, v in self._linears.items()},
                          source=source, architecture=(config or {}).get("architectures", [None])[0])
        original = self._original_card(card_source_text)
        if original:
            card += ORIGINAL_CARD + original
        atomic_write_text(self.out_dir / CARD_NAME, card)
        cfg = dict(config or {})
        cfg["quantization_config"] = qc
        if head_name in self._linears:
            cfg["tie_word_embeddings"] = False  # the head is stored separately, quantized
        atomic_write_text(self.out_dir / CONFIG_NAME, json.dumps(cfg, indent=2) + "\n")
        self._lock.release()
        return self.out_dir

    def _original_card(self, carried: Optional[Path | str]) -> Optional[str]:
        """The model card that ours carries under "Original model card": the one added (the source's), else a
        card already in the directory that is not ours, else the original section of our own earlier card."""
        if isinstance(carried, Path):
            return carried.read_text(errors="replace")
        if isinstance(carried, str):
            return carried
        readme = self.out_dir / CARD_NAME
        if not readme.is_file() or readme.is_symlink():
            return None
        text = readme.read_text(errors="replace")
        if not text.startswith(CARD_MARK):
            return text
        return text.split(ORIGINAL_CARD, 1)[1] if ORIGINAL_CARD in text else None

    def abort(self) -> None:
        """Remove shards written so far (partial names only; a finished checkpoint is never touched)."""
        for part, _ in self._parts:
            if part.name.endswith(PARTIAL_SUFFIX) and part.exists():
                part.unlink()
        self._parts.clear()
        self._pending.clear()
        self._lock.release()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and not self._finished:
            self.abort()
        self._lock.release()


def _tile_count(storage: dict[str, Any]) -> int:
    shape = storage["trellis"]["shape"]
    return int(shape[0]) * int(shape[1])


def _storage_bits(storage: dict[str, Any]) -> int:
    bits = 0
    for t in storage.values():
        n = 1
        for d in t["shape"]:
            n *= int(d)
        bits += n * torch.empty(0, dtype=getattr(torch, t["torch_dtype"])).element_size() * 8
    return bits


def card_source(name_or_path: Any, fallback: Optional[str] = None) -> Optional[str]:
    """What a model card names as the source: a Hub name as it is, a local path by its last part (never a local
    absolute path); ``fallback`` when there is no name."""
    name = str(name_or_path or "").rstrip("/")
    if not name:
        return fallback
    return os.path.basename(name) if os.path.isabs(name) or name.startswith(".") else name


CARD_MARK = "<!-- written by exl3rt -->"
ORIGINAL_CARD = "\n---\n\n## Original model card\n\n"
_INDEX = re.compile(r"\.\d+(?=\.|$)")


def model_card(qc: dict[str, Any], linears: dict[str, tuple], *, source: Optional[str] = None,
               architecture: Optional[str] = None) -> str:
    """A Hugging Face model card (markdown) for an EXL3 checkpoint: the source, the exl3rt version, the codebook,
    the average K and bits per weight, and K per module (layer and expert indices folded: ``model.layers.*.mlp.
    down_proj``). ``linears``: name -> (K, codebook, weights)."""
    groups: dict[str, dict[Any, list[int]]] = {}
    for name, (k, _, n) in linears.items():
        g = groups.setdefault(_INDEX.sub(".*", name), {})
        g.setdefault(k, [0, 0])
        g[k][0] += 1
        g[k][1] += n
    rows = []
    for pattern in sorted(groups):
        ks = ", ".join(f"K{k:g}: {c} ({w / 1e6:.1f} M weights)" for k, (c, w) in
                       sorted(groups[pattern].items(), key=lambda kv: float(kv[0])))
        rows.append(f"| `{pattern}` | {ks} |")
    head = qc.get("head_bits", 16)
    lines = [CARD_MARK, "---", "tags:", "- exl3", "- exl3rt", "- quantized"]
    if source:
        lines.append(f"base_model: {source}")
    lines += ["---", "", f"# {Path(str(source)).name if source else 'EXL3 model'} — EXL3 {qc.get('bits')} bits", "",
              f"EXL3 trellis codes (the ExLlamaV3 format) written by exl3rt {qc.get('version')}"
              + (f" from `{source}`" if source else "") + ".", "",
              "| | |", "|---|---|",
              *([f"| architecture | {architecture} |"] if architecture else []),
              f"| average K (bits per weight of the codes, head excluded) | {qc.get('bits')} |",
              f"| bits per weight stored (codes, scales, biases of every quantized linear) | {qc.get('bpw')} |",
              f"| head | {'unquantized' if head == 16 else f'K{head:g}'} |",
              f"| codebook | {qc.get('codebook')} |",
              f"| quantized linears | {len(linears)} |", "",
              "K per module (per-tensor detail in `quantization_config.json`):", "",
              "| module | K |", "|---|---|", *rows, "",
              "Runs in exllamav3, in transformers through exl3rt (`import exl3rt.integrations.transformers`, then "
              "`from_pretrained`) and in vLLM with the exl3rt plugin (`--quantization exl3`).", ""]
    return "\n".join(lines)


def write_checkpoint(out_dir: str | os.PathLike[str], linears: dict[str, EncodedLinear],
                     tensors: Optional[dict[str, torch.Tensor]] = None, config: Optional[dict[str, Any]] = None,
                     **kwargs: Any) -> Path:
    """Write a whole checkpoint at once (see :class:`CheckpointWriter` for the streamed form).

    Keyword arguments go to :class:`CheckpointWriter` (``max_shard_bytes``, ``overwrite``) or to
    :meth:`CheckpointWriter.finish` (``quantization_config``, ``head_name``).
    """
    finish_kw = {k: kwargs.pop(k) for k in ("quantization_config", "head_name") if k in kwargs}
    with CheckpointWriter(out_dir, **kwargs) as w:
        for name, lin in linears.items():
            w.add_linear(name, lin)
        for name, t in (tensors or {}).items():
            w.add_tensor(name, t)
        return w.finish(config, **finish_kw)
