"""Peer quantizers for the quality-per-bit benchmark (``bench_quality.py``).

Each peer is run through its own library with that library's documented defaults; nothing here
re-implements a peer, except the round-to-nearest baseline (``RTNLinear``), which is ours by design.
Every method quantizes only the decoder's linear layers (q/k/v/o/gate/up/down projections) and keeps
the embeddings and ``lm_head`` unquantized, as the EXL3 side does.

Compute dtype. Where a library stores its per-group metadata (scales, zeros) in the model's dtype,
the model is loaded the way that library's documentation loads it, so the stored bits are what a user
of that library gets, and the returned model has ``compute_dtype`` set:

* HQQ: ``AutoHQQHFModel.quantize_model``'s default ``compute_dtype=torch.float16`` (scale/zero are stored
  in it, and the whole model is cast to it);
* torchao int4, optimum-quanto and GPTQ (llmcompressor): the checkpoint's dtype, bf16 (transformers'
  default ``dtype="auto"``; torchao's int4 and llmcompressor's examples load bf16);
* bitsandbytes (absmax is fp32 whatever the model dtype), torchao int8 and RTN: float32.

Embeddings and lm_head stay unquantized but in that compute dtype (fp16 for HQQ, bf16 where bf16).

Group sizes: SmolLM2's hidden size, 576, is not a multiple of 128. HQQ and bitsandbytes group the
flattened weight, so any group size works; torchao skips (silently) and llmcompressor refuses a layer
whose in_features is not a multiple of the group, so their rows use group 64; optimum-quanto shrinks its
group to 96 there by itself; RTN ends such rows with a narrower group (576 = 4 x 128 + 64).

Import this file with ``sys.path`` set to ``benchmarks/``; the peer libraries are imported lazily.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

DECODER_LINEAR_RE = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$")

_PIP = {"hqq": "hqq", "bnb": "bitsandbytes", "torchao": "torchao", "quanto": "optimum-quanto",
        "gptq": "llmcompressor"}   # pip names
# llmcompressor 0.14.0.1 pins transformers<=5.17.0 (its GPTQ runs with 5.25 all the same, tried in a
# separate venv), so it is not installed beside the dev venv's transformers; the GPTQ peer runs where it is.
GPTQ_HINT = "pip install llmcompressor (in a separate venv: it pins transformers<=5.17)"
GPTQ_SEQ_LEN = 512     # calibration: up to GPTQ_SAMPLES chunks of GPTQ_SEQ_LEN tokens of calib_text
GPTQ_SAMPLES = 64


# ----------------------------------------------------------------------------------------------- configs

@dataclass(frozen=True)
class PeerConfig:
    method: str            # "hqq", "bnb", "torchao", "quanto", "rtn", "gptq"
    label: str             # table label
    bits: int              # nominal weight bits
    group_size: int | None  # None: per-row (int8) or library-chosen (quanto)
    needs_gpu: bool = False
    on_source_grid: bool = False   # the weights already lie on this method's grid (control row)
    variant: str = ""      # method-specific: "nf4"/"fp4"/"int8" for bnb, "int4"/"int8" otherwise

    def build(self, model_dir: str, device: str = "cpu", calib_text: str | None = None) -> nn.Module:
        """The quantized causal LM, in eval mode, on ``device``; ``model.compute_dtype`` tells its compute dtype."""
        builder = _BUILDERS[self.method]
        model = builder(self, str(model_dir), device, calib_text)
        model.eval()
        model.requires_grad_(False)
        model.peer_config = self
        return model


def all_configs() -> list[PeerConfig]:
    """The full grid, in table order."""
    cfgs = []
    for bits in (4, 3):
        for g in (64, 128):
            cfgs.append(PeerConfig("hqq", f"HQQ {bits}-bit g{g}", bits, g, variant=f"int{bits}"))
    cfgs += [
        PeerConfig("bnb", "bnb NF4", 4, 64, variant="nf4"),
        PeerConfig("bnb", "bnb FP4", 4, 64, variant="fp4"),
        PeerConfig("bnb", "bnb int8", 8, None, variant="int8"),
        # Group 64, not 128: torchao silently leaves a layer unquantized when in_features % group_size != 0,
        # and SmolLM2's hidden size is 576 = 4.5 x 128 (q/k/v/o/gate/up would stay bf16).
        PeerConfig("torchao", "torchao int4 g64", 4, 64, variant="int4"),
        PeerConfig("torchao", "torchao int8", 8, None, variant="int8"),
        # quanto picks the group itself: 128, or the largest multiple of 32 below it dividing in_features
        # (96 for SmolLM2's 576-wide layers).
        PeerConfig("quanto", "quanto int4", 4, None, variant="int4"),
        PeerConfig("quanto", "quanto int8", 8, None, variant="int8"),
        PeerConfig("rtn", "RTN int4 g128", 4, 128, variant="int4"),
        PeerConfig("rtn", "RTN int4 g32", 4, 32, on_source_grid=True, variant="int4"),
        # group 64 for the same reason as torchao (llmcompressor refuses 576 % 128 != 0 outright).
        PeerConfig("gptq", "GPTQ W4A16 g64", 4, 64, variant="int4"),
    ]
    return cfgs


def unavailable_reason(cfg: PeerConfig, device: str) -> str | None:
    """None when ``cfg`` can run on ``device`` here, else a one-line reason."""
    dev = torch.device(device)
    if cfg.method != "rtn" and not _installed(cfg.method):
        hint = GPTQ_HINT if cfg.method == "gptq" else f"pip install {_PIP[cfg.method]}"
        return f"{_PIP[cfg.method]} is not installed ({hint})"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if cfg.needs_gpu and dev.type != "cuda":
        return "needs a CUDA GPU"
    if dev.type not in ("cpu", "cuda"):
        return f"device {device!r} not supported by the peer adapters"
    return None


def _installed(method: str) -> bool:
    """The peer's distribution is installed (its metadata, not an import spec: an uninstall can leave an empty
    namespace folder, e.g. optimum/quanto, that still imports)."""
    try:
        importlib.metadata.version(_PIP[method])
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def not_runnable_here() -> list[tuple[str, str]]:
    """Peers that cannot run at all in this environment, with the reason."""
    out = []
    for cfg in all_configs():
        reason = unavailable_reason(cfg, "cpu")
        if reason is not None and (cfg.needs_gpu or "not installed" in reason):
            out.append((cfg.label, reason))
    return out


# ------------------------------------------------------------------------------------------ accounting

def decoder_linear_names(model: nn.Module) -> list[str]:
    """Qualified names of the decoder's q/k/v/o/gate/up/down projections."""
    return [n for n, _ in model.named_modules() if DECODER_LINEAR_RE.match(n)]


def decoder_linear_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """``{module name: (out_features, in_features)}`` of the decoder linears, read from the safetensors headers."""
    shapes = {}
    for st in sorted(Path(model_dir).glob("*.safetensors")):
        with open(st, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, meta in header.items():
            if key.endswith(".weight") and DECODER_LINEAR_RE.match(key[:-len(".weight")]):
                shapes[key[:-len(".weight")]] = tuple(meta["shape"])
    return shapes


def _leaf_tensors(t: torch.Tensor):
    """The plain tensors that hold ``t``'s data: the inner tensors of a wrapper subclass (torchao, quanto),
    recursively, or ``t`` itself."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if inner is not None:
                yield from _leaf_tensors(inner)
    else:
        yield t


def linear_storage_bits(model: nn.Module, names: Iterable[str]) -> int:
    """Total stored bits of the modules ``names``, counted the same way for every method.

    Every tensor of each module's ``state_dict`` is counted: weights, packed codes, scales, zeros,
    bitsandbytes' absmax and 16-entry quant_map, bitsandbytes' ``quant_state`` (a JSON description of the
    4-bit format, serialized as a uint8 tensor: not numeric data, but it is stored with the checkpoint),
    Linear8bitLt's one-byte ``weight_format`` tag, HQQ's small metadata tensors (nbits, shape... when it
    encodes its state dict), and any bias. Wrapper tensor subclasses (torchao, quanto) are opened through
    ``__tensor_flatten__`` down to the plain tensors holding the packed bytes. Non-tensor entries are not
    data and are skipped. Several tensors sharing one storage count the union of the byte ranges they
    reference, once.

    Count on a freshly built model, before its first forward: on a CPU with AVX512-BF16, bitsandbytes
    repacks each Linear4bit on its first forward into a CPU layout whose absmax is bf16 (and its state_dict
    then returns that, 4.25 bits per weight instead of the stored format's 4.5).
    """
    spans: dict[tuple, list[tuple[int, int]]] = {}
    loose = 0
    alive = []   # some state_dicts build tensors on the fly (quanto): keep them, or a freed one's address is reused
    for name in names:
        module = model.get_submodule(name)
        for value in module.state_dict(keep_vars=True).values():
            if not isinstance(value, torch.Tensor):
                continue
            for leaf in _leaf_tensors(value):
                alive.append(leaf)
                loose += _add_span(spans, leaf)
    total = loose
    for ranges in spans.values():
        ranges.sort()
        end = -1
        for lo, hi in ranges:
            if hi > end:
                total += hi - max(lo, end)
                end = hi
    return 8 * total


def _add_span(spans: dict, t: torch.Tensor) -> int:
    """Record the byte range of ``t`` in its storage; returns bytes to count directly when it has no storage."""
    t = t.detach()
    if t.numel() == 0:
        return 0
    nbytes = t.element_size()
    if t.device.type == "meta":
        return t.numel() * nbytes
    storage = t.untyped_storage()
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    lo = t.storage_offset() * nbytes
    key = (t.device.type, t.device.index, storage.data_ptr(), storage.nbytes())
    spans.setdefault(key, []).append((lo, lo + extent * nbytes))
    return 0


# ----------------------------------------------------------------------------------------------- loading

def _load_hf(model_dir: str, dtype: torch.dtype, device: str | None = None, **kwargs) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    if device is not None:
        model = model.to(device)
    return model.eval()


def _decoder_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and DECODER_LINEAR_RE.match(fqn) is not None


# ------------------------------------------------------------------------------------------------- HQQ

def _build_hqq(cfg: PeerConfig, model_dir: str, device: str, calib_text: str | None) -> nn.Module:
    # hqq's own API (not transformers' HqqConfig). BaseQuantizeConfig's defaults: axis=1, optimize=True
    # (the half-quadratic solver), round_zero only for 4 bits; W_q packed (4-bit: 2 per byte; 3-bit: 10 per
    # int32), scale and zero kept in compute_dtype, which is quantize_model's default float16.
    from hqq.core.quantize import BaseQuantizeConfig
    from hqq.models.hf.base import AutoHQQHFModel

    model = _load_hf(model_dir, torch.float32)
    qcfg = BaseQuantizeConfig(nbits=cfg.bits, group_size=cfg.group_size)
    compute_dtype = torch.float16
    # lm_head is in hqq's default ignore list (_IGNORE_LINEAR); embeddings are not linear layers.
    AutoHQQHFModel.quantize_model(model, quant_config=qcfg, compute_dtype=compute_dtype, device=device)
    model.compute_dtype = compute_dtype
    return model


# -------------------------------------------------------------------------------------------- bitsandbytes

def _build_bnb(cfg: PeerConfig, model_dir: str, device: str, calib_text: str | None) -> nn.Module:
    # transformers' BitsAndBytesConfig with its defaults: blocksize 64 (bitsandbytes' Params4bit default),
    # no double quant, bnb_4bit_compute_dtype float32, llm_int8_threshold 6.0 (outlier decomposition).
    # transformers keeps the output embedding (lm_head) unquantized on its own. Note LLM.int8 is not
    # weight-only: it also rounds the activations to int8 (fp16 for columns above the threshold), and on
    # the CPU, 4-bit layers switch to bf16 absmax on their first forward (see linear_storage_bits).
    from transformers import BitsAndBytesConfig

    if cfg.variant == "int8":
        qcfg = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.variant)
    model = _load_hf(model_dir, torch.float32, quantization_config=qcfg, device_map=device)
    model.compute_dtype = torch.float32
    return model


# -------------------------------------------------------------------------------------------------- torchao

def _build_torchao(cfg: PeerConfig, model_dir: str, device: str, calib_text: str | None) -> nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    if cfg.variant == "int8":
        dtype = torch.float32
        qcfg = Int8WeightOnlyConfig()   # per-row symmetric int8, scale in the model dtype
    else:
        dtype = torch.bfloat16          # torchao's int4 examples load bf16; scale/zero are stored in it
        if torch.device(device).type == "cpu":
            # torchao 0.18: the CPU layout (Int4OpaqueTensor, PyTorch's _weight_int4pack_mm_for_cpu) is
            # the prototype config; Int4WeightOnlyConfig's formats are CUDA ones.
            try:
                from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig as Int4Cpu
                qcfg = Int4Cpu(group_size=cfg.group_size)
            except ImportError:   # torchao <= 0.14: Int4WeightOnlyConfig(int4_packing_format="opaque")
                from torchao.quantization import Int4WeightOnlyConfig
                qcfg = Int4WeightOnlyConfig(group_size=cfg.group_size, int4_packing_format="opaque")
        else:
            from torchao.quantization import Int4WeightOnlyConfig
            if importlib.util.find_spec("mslk") is not None:
                qcfg = Int4WeightOnlyConfig(group_size=cfg.group_size)   # default "plain" format (mslk kernels)
            else:   # tinygemm, shipped with PyTorch itself
                qcfg = Int4WeightOnlyConfig(group_size=cfg.group_size, int4_packing_format="tile_packed_to_4d")
    model = _load_hf(model_dir, dtype, device)
    quantize_(model, qcfg, filter_fn=_decoder_filter)
    model.compute_dtype = dtype
    return model


# ---------------------------------------------------------------------------------------------- quanto

def _build_quanto(cfg: PeerConfig, model_dir: str, device: str, calib_text: str | None) -> nn.Module:
    # quantize(model, weights=qint4/qint8) + freeze, as quanto's README; lm_head excluded. qint4: groups of
    # 128 along in_features (or fewer, see all_configs), uint8-packed codes, scale and shift in the model
    # dtype; qint8: per-row symmetric scale.
    from optimum.quanto import freeze, qint4, qint8, quantize

    dtype = torch.bfloat16   # the checkpoint's dtype (transformers' default dtype="auto")
    model = _load_hf(model_dir, dtype, device)
    quantize(model, weights=qint4 if cfg.bits == 4 else qint8, exclude=["lm_head"])
    freeze(model)
    model.compute_dtype = dtype
    return model


# ------------------------------------------------------------------------------------------------- RTN

class RTNLinear(nn.Module):
    """Round-to-nearest baseline: asymmetric min/max per group of ``group_size`` input columns, code
    ``q = round((w - zero) / scale)`` in [0, 2^bits - 1], ``w ~ q * scale + zero`` with ``scale`` and ``zero``
    (the group minimum, as GGUF's Q4_1) stored as fp16; 4-bit codes packed two per byte. A row whose width
    is not a multiple of ``group_size`` ends with a narrower group."""

    def __init__(self, linear: nn.Linear, bits: int = 4, group_size: int = 128):
        super().__init__()
        assert bits == 4, "packing is two 4-bit codes per byte"
        w = linear.weight.detach().float()
        out_f, in_f = w.shape
        assert in_f % 2 == 0
        self.in_features, self.out_features, self.group_size, self.bits = in_f, out_f, group_size, bits
        ng = math.ceil(in_f / group_size)
        pad = ng * group_size - in_f
        wp = torch.cat([w, w[:, -1:].expand(out_f, pad)], 1) if pad else w   # edge copy: min/max unchanged
        g = wp.view(out_f, ng, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        qmax = 2 ** bits - 1
        scale = ((hi - lo) / qmax).clamp_min(1e-8).half()
        zero = lo.half()
        q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, qmax)
        q = q.view(out_f, -1)[:, :in_f].to(torch.uint8)
        self.register_buffer("qweight", q[:, 0::2] | (q[:, 1::2] << 4))
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = torch.stack([self.qweight & 15, self.qweight >> 4], -1).view(self.out_features, self.in_features)
        s = self.scale.to(dtype).repeat_interleave(self.group_size, 1)[:, :self.in_features]
        z = self.zero.to(dtype).repeat_interleave(self.group_size, 1)[:, :self.in_features]
        return q.to(dtype) * s + z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantize(x.dtype), self.bias)


def _build_rtn(cfg: PeerConfig, model_dir: str, device: str, calib_text: str | None) -> nn.Module:
    model = _load_hf(model_dir, torch.float32, device)
    for name in decoder_linear_names(model):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, RTNLinear(model.get_submodule(name), cfg.bits, cfg.group_size))
    model.compute_dtype = torch.float32
    return model


# ------------------------------------------------------------------------------------------------ GPTQ

def _build_gptq(cfg: PeerConfig, model_dir: str, device: str, calib_text: str | None) -> nn.Module:
    # llmcompressor's documented flow: oneshot(model, dataset, recipe=GPTQModifier(targets="Linear",
    # scheme="W4A16", ignore=["lm_head"])) with GPTQModifier's defaults (block_size 128, dampening_frac 0.01,
    # actorder "static"); the W4A16 preset is symmetric int4, groups of 128 along in_features (group 64 here:
    # llmcompressor refuses in_features % group_size != 0, and SmolLM2's 576 = 4.5 x 128). The model is
    # then saved compressed (pack-quantized: 8 codes per int32, scale in the model dtype) and loaded back
    # through transformers' compressed-tensors integration, which is how a GPTQ checkpoint is run, so the
    # packed tensors are what the model holds. bf16: llmcompressor's examples load dtype="auto".
    import tempfile

    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not calib_text:
        raise ValueError("GPTQ needs calibration text (calib_text)")
    dtype = torch.bfloat16
    model = _load_hf(model_dir, dtype)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(calib_text).input_ids
    seq = min(GPTQ_SEQ_LEN, len(ids))
    chunks = [ids[i:i + seq] for i in range(0, len(ids) - seq + 1, seq)][:GPTQ_SAMPLES]
    ds = Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * seq for _ in chunks]})
    if cfg.group_size == 128:
        recipe = GPTQModifier(targets="Linear", scheme=f"W{cfg.bits}A16", ignore=["lm_head"])
    else:   # the preset's weight args with another group size
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(num_bits=cfg.bits, type="int", symmetric=True, strategy="group",
                                   group_size=cfg.group_size)
        recipe = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                              ignore=["lm_head"])
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=seq, num_calibration_samples=len(chunks))
    with tempfile.TemporaryDirectory(prefix="gptq-peer-") as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        del model
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, device_map=device)
    model.compute_dtype = dtype
    return model


_BUILDERS = {"hqq": _build_hqq, "bnb": _build_bnb, "torchao": _build_torchao, "quanto": _build_quanto,
             "rtn": _build_rtn, "gptq": _build_gptq}
