"""The quality benchmark's peer adapters (benchmarks/quality_peers.py) on a tiny random Llama.

Every runnable peer is built, run, and its stored bits are checked against a per-method formula of that
library's documented storage; peers whose library is missing are skipped with the reason.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import quality_peers as qp  # noqa: E402
import tiny_models  # noqa: E402

HIDDEN, INTER, LAYERS = 128, 256, 1   # multiples of every group size in the grid (32, 64, 128)


# --------------------------------------------------------------------- expected storage, per method

def _quanto_group(in_features: int) -> int:
    # optimum-quanto's QModuleMixin: 128, minus 32 at a time while it does not divide in_features;
    # one group per row (per-axis) when in_features <= 128
    if in_features <= 128:
        return in_features
    g = 128
    while in_features % g and g > 32:
        g -= 32
    return g


def expected_bits(cfg: qp.PeerConfig, out_f: int, in_f: int) -> tuple[int, int]:
    """(bits of the method's documented storage for one out_f x in_f linear, slack in bits for small
    per-module metadata the formula leaves out)."""
    n = out_f * in_f
    small = 256 * 8
    if cfg.method == "hqq":
        # W_q packed (4-bit: 2 codes/byte; 3-bit: 10 codes per int32 along the (n/g) rows of the
        # (n/g, g) grouped weight, rows padded to a multiple of 10); fp16 scale + fp16 zero per group.
        groups = n // cfg.group_size
        codes = n * 4 if cfg.bits == 4 else math.ceil(groups / 10) * cfg.group_size * 32
        # plus the encoded meta (nbits, shape, ... as small tensors)
        return codes + groups * 32, small
    if cfg.method == "bnb":
        if cfg.variant == "int8":
            return n * 8 + out_f * 32 + 8, small        # int8 CB, fp32 SCB per row, weight_format byte
        # 2 codes/byte, fp32 absmax per block of 64, 16-entry fp32 quant_map; + the JSON quant_state blob
        return n * 4 + math.ceil(n / 64) * 32 + 16 * 32, 1024 * 8
    if cfg.method == "torchao":
        if cfg.variant == "int8":
            return n * 8 + out_f * (32 + 8), small      # int8, fp32 scale and int8 zero_point per row
        return n * 4 + (n // cfg.group_size) * 2 * 16, small   # packed int4, bf16 scale_and_zero per group
    if cfg.method == "quanto":
        if cfg.variant == "int8":
            return n * 8 + out_f * 16, small            # int8, bf16 scale per row (+ 2 bf16 scalars)
        return n * 4 + (n // _quanto_group(in_f)) * 2 * 16, small   # uint8-packed, bf16 scale + shift
    if cfg.method == "rtn":
        return n * 4 + out_f * math.ceil(in_f / cfg.group_size) * 32, 0   # fp16 scale + fp16 zero
    if cfg.method == "gptq":
        return n * 4 + (n // cfg.group_size) * 16, small   # 8 codes/int32, bf16 scale; symmetric: no zeros
    raise AssertionError(cfg.method)


# ----------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama_peers")
    return tiny_models.tiny_llama(path, hidden=HIDDEN, intermediate=INTER, layers=LAYERS, vocab=64, init_std=0.1)


@pytest.fixture(scope="module")
def reference_logits(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ids() -> torch.Tensor:
    return torch.randint(3, 64, (1, 24), generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------------------------- peers

def test_grid():
    cfgs = qp.all_configs()
    labels = [c.label for c in cfgs]
    assert len(set(labels)) == len(labels)
    assert {c.method for c in cfgs} == {"hqq", "bnb", "torchao", "quanto", "rtn", "gptq"}
    assert [c.label for c in cfgs if c.on_source_grid] == ["RTN int4 g32"]
    for c in cfgs:
        reason = qp.unavailable_reason(c, "cpu")
        assert reason is None or (isinstance(reason, str) and "\n" not in reason)
    for label, reason in qp.not_runnable_here():
        assert label in labels and reason


@pytest.mark.parametrize("cfg", qp.all_configs(), ids=lambda c: c.label)
def test_peer_builds_and_counts(cfg, tiny_dir, reference_logits):
    reason = qp.unavailable_reason(cfg, "cpu")
    if reason is not None:
        # the quality environment (.ci/quality_check.sh) installs every CPU peer but GPTQ (see GPTQ_HINT)
        if os.environ.get("EXL3RT_QUALITY_PEERS_REQUIRED") and cfg.method != "gptq" and not cfg.needs_gpu:
            pytest.fail(f"{cfg.label}: {reason}")
        pytest.skip(reason)
    torch.manual_seed(0)
    model = cfg.build(str(tiny_dir), "cpu", calib_text=tiny_models.calibration_text(600))
    assert not model.training
    assert isinstance(getattr(model, "compute_dtype", None), torch.dtype)

    # only the decoder linears are quantized: embeddings / lm_head stay plain floating-point tensors
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.is_floating_point()
    assert type(model.model.embed_tokens.weight) in (torch.Tensor, nn.Parameter)

    shapes = qp.decoder_linear_shapes(str(tiny_dir))
    names = qp.decoder_linear_names(model)
    assert sorted(names) == sorted(shapes) and len(names) == 7 * LAYERS
    total_core = 0
    for name in names:
        out_f, in_f = shapes[name]
        core, slack = expected_bits(cfg, out_f, in_f)
        got = qp.linear_storage_bits(model, [name])
        assert core <= got <= core + slack, (name, got, core, slack)
        total_core += core
    n = sum(o * i for o, i in shapes.values())
    bpw = qp.linear_storage_bits(model, names) / n
    assert bpw == pytest.approx(total_core / n, abs=0.05)
    assert bpw <= cfg.bits + 1.0

    # the forward after the count: bitsandbytes repacks Linear4bit for the CPU on its first forward
    # (bf16 absmax), which its state_dict then returns
    ids = _ids()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    assert logits.shape == (1, ids.shape[1], 64)
    assert torch.isfinite(logits).all()
    cos = nn.functional.cosine_similarity(logits.flatten(), reference_logits.flatten(), dim=0).item()
    assert cos > {8: 0.99, 4: 0.8}.get(cfg.bits, 0.5), cos


# ------------------------------------------------------------------------------- storage accounting

class _Fresh(nn.Module):
    """A module whose state_dict makes a new tensor each time (as quanto's does)."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "packed"] = torch.ones(100, dtype=torch.float32)


def test_linear_storage_bits_brute_force():
    from torch.testing._internal.two_tensor import TwoTensor

    base = torch.arange(64, dtype=torch.uint8)
    shared = torch.zeros(10, dtype=torch.float16)

    a = nn.Module()
    a.weight = nn.Parameter(torch.zeros(4, 8, dtype=torch.float16), requires_grad=False)   # 64 bytes
    a.register_buffer("lo", base[0:16])               # bytes 0..16 of base
    a.register_buffer("mid", base[8:24])              # overlaps lo: union 0..24
    a.register_buffer("strided", base[32:48:4])       # 4 elements spanning bytes 32..45 (13 bytes)
    a.register_buffer("tied", shared)                 # 20 bytes, also in module b
    a.register_buffer("pair", TwoTensor(torch.zeros(3, dtype=torch.float32), torch.zeros(3, dtype=torch.float32)))
    a.note = "not a tensor"

    b = nn.Module()
    b.register_buffer("tied", shared)
    b.register_buffer("qweight", torch.zeros(2, 3, dtype=torch.int32))   # 24 bytes
    b.bias = nn.Parameter(torch.zeros(5))                                  # 20 bytes

    root = nn.Module()
    root.a, root.b, root.c, root.d = a, b, _Fresh(), _Fresh()

    a_bytes = 64 + 24 + 13 + 20 + 12 + 12
    b_bytes = 20 + 24 + 20
    assert qp.linear_storage_bits(root, ["a"]) == 8 * a_bytes
    assert qp.linear_storage_bits(root, ["b"]) == 8 * b_bytes
    assert qp.linear_storage_bits(root, ["a", "b"]) == 8 * (a_bytes + b_bytes - 20)   # `shared` once
    assert qp.linear_storage_bits(root, ["a", "a"]) == 8 * a_bytes                    # a name twice: once
    assert qp.linear_storage_bits(root, ["c", "d"]) == 8 * 800                         # temporaries kept apart


def test_rtn_recovers_its_own_grid():
    """RTN g32 of weights already on an asymmetric 4-bit g32 grid with fp16 scale/min gives them back."""
    torch.manual_seed(0)
    out_f, in_f, g = 8, 96, 32
    q = torch.randint(0, 16, (out_f, in_f))
    q[:, ::g] = 0
    q[:, 1::g] = 15                      # every group spans the full code range
    scale = (torch.rand(out_f, in_f // g) * 0.01 + 0.001).half().float()
    zero = (torch.randn(out_f, in_f // g) * 0.02).half().float()
    w = q * scale.repeat_interleave(g, 1) + zero.repeat_interleave(g, 1)
    lin = nn.Linear(in_f, out_f, bias=False)
    lin.weight.data.copy_(w)
    rtn = qp.RTNLinear(lin, 4, g)
    assert torch.allclose(rtn.dequantize(), w, atol=1e-6, rtol=1e-3)
    lin = nn.Linear(80, 4, bias=False)
    ragged = qp.RTNLinear(lin, 4, 32)   # groups of 32 + 32 + 16
    assert ragged.scale.shape == (4, 3) and ragged.qweight.shape == (4, 40)
    step = ragged.scale.float().repeat_interleave(32, 1)[:, :80]
    assert ((ragged.dequantize() - lin.weight).abs() <= step / 2 + 1e-3).all()
