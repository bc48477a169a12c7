"""Run a conversion plan: encode each linear, keep finished layers across crashes, write the checkpoint.

Finished layers are published one file each (atomically) under ``OUT/.exl3rt-work/layers/``
together with ``job.json`` (the settings and the source files' sizes and times). A rerun with the
same settings skips every layer already there and valid; different settings or a changed
source are refused rather than mixed. When all layers are done the EXL3 checkpoint is written
(shards, index, configs) with the source's side files beside it (tokenizer, generation config, chat
template: every top-level file that holds no weights, :func:`exl3rt.format.output.side_files`) and the work folder is
removed. A source weight the encoder refuses (NaN/inf values, a bad shape: :class:`EncodeError`)
ends the run and removes what this run created (the work folder, and OUT itself if the run made
it): fixing the source changes it, so the layers finished before could never be resumed.

A kill at any point is recovered by running the same command again: before ``config.json`` exists the
rerun resumes (temporaries of the killed run are swept, finished layers reused); once it exists the
checkpoint is complete and the rerun only finishes removing the work folder. One run at a time holds
``.exl3rt-work/lock``; a second run into the same OUT is refused. Every tensor name of the source is
checked (:mod:`exl3rt.util.names`) before anything is written: layer files are named after modules.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import filelock
import torch
from safetensors import safe_open

from .. import __version__
from ..cache.key import module_seed
from ..encode.errors import EncodeError
from ..encode.quantize import ENCODER_VERSION, quantize_weight
from ..format.checkpoint import CONFIG_NAME, INDEX_NAME, QCONFIG_NAME
from ..format.checkpoint_write import CheckpointWriter, card_source
from ..format.output import PARTIAL_NAME, WORK_DIR, check_location, check_output, is_layout_name, side_files
from ..format.encoded import EncodedLinear, padded_width
from ..format.errors import FormatError
from ..util.fs import atomic_path, atomic_write_text, sweep_temp_files, temp_target
from ..util.progress import Progress
from ..util.safetensors_io import write_safetensors
from ..util.tensorfiles import TensorFiles, natural_key
from .plan import ConversionPlan, LinearJob, plan_conversion

log = logging.getLogger("exl3rt.convert")

LOCK_NAME = "lock"
JOB_NAME = "job.json"


def _job_record(src: TensorFiles, plan: ConversionPlan, settings: dict[str, Any]) -> dict[str, Any]:
    files = sorted({src.info(n).file for n in src.names()})
    stats = [[f, (src.root / f).stat().st_size, (src.root / f).stat().st_mtime_ns] for f in files]
    return {"exl3rt": __version__, "encoder_version": ENCODER_VERSION, **settings,
            "layers": {j.name: [j.bits, j.codebook] for j in plan.linears}, "source": stats}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _load_layer(path: Path, job: LinearJob, digest: str) -> Optional[EncodedLinear]:
    """A finished layer from the work folder, or None if absent, foreign or invalid."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("job") != digest or meta.get("name") != job.name:
            return None
        lin = EncodedLinear.from_state_dict(tensors, job.name, in_features=job.in_features,
                                            out_features=job.out_features)
        if lin.bits != job.bits or lin.codebook != job.codebook:
            return None
        lin.info = json.loads(meta.get("info", "{}"))
        return lin
    except (FormatError, OSError, ValueError, RuntimeError) as exc:
        log.warning("%s: ignoring an unreadable finished layer (%s); encoding it again", path.name, exc)
        return None


def _source_weight(src: TensorFiles, job: LinearJob) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    w = src.tensor(job.weight).to(torch.float32).T.contiguous()  # HF [out, in] -> EXL3 [in, out]
    bias = None
    if job.bias:
        b = src.tensor(job.bias).to(torch.float16)
        bias = torch.zeros(padded_width(job.out_features), dtype=torch.float16)
        bias[: b.shape[0]] = b
    return w, bias


def layer_path(layers_dir: Path, name: str) -> Path:
    """Where a finished layer is kept; ``name`` was checked by the plan, this guards the join as well."""
    path = layers_dir / f"{name}.safetensors"
    if path.parent != layers_dir:
        raise EncodeError(f"{name}: not a module name that can name a file; refusing to write outside {layers_dir}")
    return path


def _lock_work(work: Path, out: Path) -> filelock.BaseFileLock:
    work.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(work / LOCK_NAME), timeout=0, mode=0o600)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise EncodeError(f"{out}: another exl3rt quantize is writing here (it holds {work / LOCK_NAME}); "
                          f"wait for it to finish, or choose another directory") from None
    return lock


def _remove_work(work: Path) -> None:
    """Remove the work folder: layers first, ``job.json`` last, so that a kill part-way leaves either the job
    record (the rerun finishes the removal) or nothing worth keeping."""
    shutil.rmtree(work / "layers", ignore_errors=True)
    for name in (JOB_NAME, LOCK_NAME):
        try:
            (work / name).unlink()
        except FileNotFoundError:
            pass
    shutil.rmtree(work, ignore_errors=True)


def _sweep(out: Path, work: Path, sides: frozenset[str]) -> None:
    """Temporaries and unnamed shards of a killed run (call with the work lock held); in OUT only those of files
    this run writes."""
    sweep_temp_files(out, owned=lambda t: is_layout_name(t) or bool(PARTIAL_NAME.fullmatch(t)) or t in sides)
    for d in (work, work / "layers"):
        sweep_temp_files(d)
    for part in out.iterdir():
        if PARTIAL_NAME.fullmatch(part.name) and part.is_file() and not part.is_symlink():
            part.unlink()


def _resumed_files(out: Path, sides: frozenset[str]) -> frozenset[str]:
    """Files in OUT that a killed run of this conversion published (it held OUT empty, or replaceable, when it
    began): checkpoint files and the source's side files. Empty unless OUT has a work folder with a job record."""
    if not (out / WORK_DIR / JOB_NAME).is_file():
        return frozenset()
    def ours(name: str) -> bool:
        return is_layout_name(name) or name in sides
    return frozenset(n for n in os.listdir(out) if ours(n) or ours(temp_target(n) or ""))


def convert_checkpoint(src_path: str | Path, out: str | Path, *, bits=4, codebook: str = "mcg", head_bits=6,
                       seed: int = 0, keep: tuple[str, ...] = (), overrides: tuple = (),
                       hessians: Optional[Callable[[str], Optional[torch.Tensor]]] = None,
                       calibration_id: Optional[str] = None, backend: str = "auto",
                       device: str | torch.device = "cpu", overwrite: bool = False, progress: bool = True,
                       max_shard_bytes: Optional[int] = None, cache: Any = None,
                       cache_only: bool = False, protect: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Convert the HF checkpoint at ``src_path`` to EXL3 in ``out``; returns a summary dict.

    ``hessians(name)`` gives a layer's ``XᵀX/n`` (calibrated mode) or None; ``calibration_id``
    identifies that data for resumption. ``cache`` (an :class:`~exl3rt.cache.EncodingCache`): each layer is
    read from it when it holds the layer's encoding, else encoded and published — the keys are those of online
    quantization, so a model encoded either way is a read for the other. ``cache_only``: export from the cache
    alone, encoding nothing: every layer (not already finished in OUT's work folder) must be in ``cache``,
    checked before OUT is touched; a missing one is an :class:`EncodeError` naming it.

    OUT (:mod:`exl3rt.format.output`) may not overlap the source, the cache's root or what ``protect`` names (what
    -> path), checked before anything is read; it must be new or empty unless ``overwrite`` (or a killed run of
    this conversion is resumed), and with ``overwrite`` only checkpoint files and files of an earlier exl3rt
    write are replaced or removed.
    """
    t0 = time.perf_counter()
    out = Path(out)
    protect = {"the source model": src_path, **({"the encoding cache": cache.root} if cache is not None else {}),
               **(protect or {})}
    check_location(out, protect)
    src = TensorFiles(src_path)
    if src.config is None:
        raise EncodeError(f"{src.path}: no config.json; exl3rt quantize needs a Hugging Face model directory")
    plan = plan_conversion(src, bits, codebook, head_bits=head_bits, keep=keep, overrides=overrides)
    settings = {"bits": bits, "codebook": codebook, "head_bits": head_bits, "seed": seed, "keep": list(keep),
                "overrides": [list(o) for o in overrides], "calibration": calibration_id}
    record = _job_record(src, plan, settings)
    digest = _digest(record)
    work = out / WORK_DIR
    sides = frozenset(p.name for p in side_files(src.root))
    if (out / CONFIG_NAME).exists() and not overwrite and work.is_dir() and _same_job(work / JOB_NAME, digest):
        return _finish_cleanup(out, work, plan, sides, t0)
    try:
        check_output(out, overwrite=overwrite, writes=sides, owned=_resumed_files(out, sides), protect=protect)
    except FormatError as exc:
        raise EncodeError(str(exc)) from None
    keys = _cached_keys(src, plan, cache, seed, hessians, work) if cache_only else None
    made_out, made_work = not out.exists(), not work.exists()
    lock = _lock_work(work, out)
    try:
        return _convert_locked(src, out, plan, record, digest, made_out=made_out, made_work=made_work,
                               overwrite=overwrite, sides=sides, protect=protect, seed=seed, hessians=hessians, calibration_id=calibration_id,
                               backend=backend, device=device, progress=progress,
                               max_shard_bytes=max_shard_bytes, t0=t0, lock=lock, cache=cache, keys=keys)
    finally:
        lock.release()


def _cache_key(cache: Any, src: TensorFiles, job: LinearJob, seed: int, hessian: Optional[torch.Tensor]) -> Any:
    """The online path's key of ``job``: the HF ``[out, in]`` weight's bytes as stored."""
    return cache.key_for_weight(src.tensor(job.weight), bits=job.bits, codebook=job.codebook,
                                seed=module_seed(job.name, seed), hessian=hessian, tp_size=1, tp_rank=0,
                                tp_bounds=None, out_scales=True)


def _cached_keys(src: TensorFiles, plan: ConversionPlan, cache: Any, seed: int,
                 hessians: Optional[Callable[[str], Optional[torch.Tensor]]], work: Path) -> dict[str, Any]:
    """Every layer's cache key for an export from the cache alone, checked to have an entry (layers already
    finished in ``work`` need none); raises EncodeError listing the missing ones before anything is written."""
    if cache is None:
        raise EncodeError("exporting from the encoding cache needs the cache: its mode is off "
                          "(drop --cache-mode off / EXL3RT_CACHE_MODE=off)")
    keys, missing = {}, []
    for job in plan.linears:
        if layer_path(work / "layers", job.name).exists():
            continue
        key = _cache_key(cache, src, job, seed, hessians(job.name) if hessians else None)
        keys[job.name] = key
        if not cache.path_for(key).exists():
            missing.append(f"{job.name} (K={job.bits})")
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise EncodeError(f"{len(missing)} of {len(plan.linears)} layers are not in the encoding cache at "
                          f"{cache.root}: {shown}. Encode them once (exl3rt quantize without --from-cache, or an "
                          f"online load with the same bits, codebook and seed), or point --cache-dir at the cache "
                          f"that holds them")
    return keys


def _same_job(job_file: Path, digest: str) -> bool:
    """True if the work folder's job is this one, or its record is already gone (removal was under way)."""
    try:
        return _digest(json.loads(job_file.read_text())) == digest
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False


def _finish_cleanup(out: Path, work: Path, plan: ConversionPlan, sides: frozenset[str], t0: float) -> dict[str, Any]:
    """OUT holds the finished checkpoint of this job (config.json is written last); a kill left the work folder."""
    lock = _lock_work(work, out)
    try:
        _sweep(out, work, sides)
        _remove_work(work)
    finally:
        lock.release()
    log.info("%s: the checkpoint was complete; removed the work folder a killed run left", out)
    return {"out": str(out), "linears": len(plan.linears), "encoded": 0, "reused": len(plan.linears), "copied": [],
            "weights": plan.total_weights, "seconds": time.perf_counter() - t0, "mean_proxy_err": None,
            "completed_before": True}


def _convert_locked(src: TensorFiles, out: Path, plan: ConversionPlan, record: dict[str, Any], digest: str, *,
                    made_out: bool, made_work: bool, overwrite: bool, sides: frozenset[str],
                    protect: dict[str, Any], seed: int,
                    hessians: Optional[Callable[[str], Optional[torch.Tensor]]], calibration_id: Optional[str],
                    backend: str, device: str | torch.device, progress: bool, max_shard_bytes: Optional[int],
                    t0: float, lock: filelock.BaseFileLock, cache: Any = None,
                    keys: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    work = out / WORK_DIR
    layers_dir = work / "layers"
    job_file = work / JOB_NAME
    if overwrite:
        # OUT stops looking like a checkpoint until this run's finish writes a new config.json
        for name in (CONFIG_NAME, INDEX_NAME, QCONFIG_NAME):
            try:
                (out / name).unlink()
            except FileNotFoundError:
                pass
    if job_file.exists():
        try:
            old_digest = _digest(json.loads(job_file.read_text()))
        except ValueError:
            old_digest = None    # torn by hand (we publish it atomically): nothing in it can be trusted
        if old_digest != digest:
            if not overwrite:
                raise EncodeError(
                    f"{out}: holds an unfinished conversion with different settings or a changed source; "
                    f"rerun with the same settings to resume, or pass --overwrite to start over"
                )
            shutil.rmtree(layers_dir, ignore_errors=True)
    _sweep(out, work, sides)
    layers_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(job_file, json.dumps(record, indent=2, sort_keys=True) + "\n")

    encoded, reused, hits, errs = 0, 0, 0, []
    padded = {j.name: padded_width(j.in_features) * padded_width(j.out_features) for j in plan.linears}
    bar = Progress(sum(padded.values()), "encoding", unit="w", enabled=progress)
    for job in plan.linears:
        path = layer_path(layers_dir, job.name)
        lin = _load_layer(path, job, digest)
        if lin is not None:
            reused += 1
            bar.update(padded[job.name], note=f"{job.name} (done before)")
        else:
            w, bias = _source_weight(src, job)
            h = hessians(job.name) if hessians else None

            def encode():
                if keys is not None:    # an export from the cache: its entry was there a moment ago
                    raise EncodeError(f"{job.name}: its encoding cache entry vanished or is invalid; run without "
                                      f"--from-cache to encode it")
                return quantize_weight(w.to(device), job.bits, job.codebook, hessian=h,
                                       seed=module_seed(job.name, seed), backend=backend, name=job.name,
                                       progress=lambda tiles: bar.update(256 * tiles))
            try:
                if cache is None:
                    lin = encode()
                else:
                    key = (keys or {}).get(job.name) or _cache_key(cache, src, job, seed, h)
                    res = cache.load_or_encode(key, encode, device="cpu", name=job.name)
                    lin = res.encoded
                    if res.hit:
                        hits += 1
                        bar.update(padded[job.name])
            except EncodeError:
                bar.close()
                if made_out or made_work:   # a resumed run's earlier work stays as it was
                    lock.release()
                    shutil.rmtree(out if made_out else work, ignore_errors=True)
                raise
            except KeyboardInterrupt as exc:
                bar.close()
                done = sum(1 for _ in layers_dir.glob("*.safetensors"))
                exc.add_note(f"{done} finished layer(s) are kept in {work}; run the same command again to resume")
                raise
            lin = lin.to("cpu")
            if bias is not None:
                lin.bias = bias
                lin.validate()
            meta = {"job": digest, "name": job.name, "info": json.dumps(lin.info)}
            with atomic_path(path) as tmp:
                write_safetensors(tmp, lin.state_dict(), metadata=meta)
            encoded += 1
            bar.update(0, note=f"{job.name} K={job.bits} err={lin.info.get('proxy_err', 0):.2e}")
        errs.append(float(lin.info.get("proxy_err", float("nan"))))
    bar.close()

    # OUT was checked at the start (empty, resumed, or --overwrite): its checkpoint files are this run's to replace
    kw = {"overwrite": True, "writes": sides, "owned": _resumed_files(out, sides), "protect": protect}
    if max_shard_bytes:
        kw["max_shard_bytes"] = max_shard_bytes
    entries: list[tuple[str, Optional[LinearJob]]] = [(f"{j.name}.weight", j) for j in plan.linears]
    entries += [(name, None) for name in plan.copies]
    with CheckpointWriter(out, **kw) as writer:
        for name, job in sorted(entries, key=lambda e: natural_key(e[0])):
            if job is None:
                writer.add_tensor(name, src.tensor(name))
                continue
            lin = _load_layer(layer_path(layers_dir, job.name), job, digest)
            if lin is None:
                raise EncodeError(f"{job.name}: finished layer vanished from {layers_dir}; rerun to re-encode it")
            writer.add_linear(job.name, lin)
        copied = []
        for side in side_files(src.root):          # copied by finish, before config.json marks it complete
            writer.add_file(side.name, side)
            copied.append(side.name)
        config = dict(src.config)
        qfields = {"calibration": {"id": calibration_id} if calibration_id else None, "seed": seed}
        writer.finish(config, quantization_config=qfields, source=card_source(config.get("_name_or_path"), src.root.name))
    _remove_work(work)
    finite = [e for e in errs if e == e]
    return {"out": str(out), "linears": len(plan.linears), "encoded": encoded - hits, "cache_hits": hits,
            "reused": reused, "copied": copied,
            "weights": plan.total_weights, "seconds": time.perf_counter() - t0,
            "mean_proxy_err": sum(finite) / len(finite) if finite else None}
