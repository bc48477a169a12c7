"""Tensor-parallel EXL3 MoE experts: rank bounds, exact slicing, rank-sliced checkpoints, gloo all-reduce.

Truth is independent of exl3rt.moe.tp: full weights from ``format.reconstruct`` in float64 and a
per-token, per-slot loop; rank splits against a brute-force deal of 128-blocks; slices against the
full trellis' tile sub-blocks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from exl3rt.format import EncodedLinear, decode, reconstruct, write_checkpoint
from exl3rt.format.bits import words16_per_tile
from exl3rt.moe import tiers_from_bitrates
from exl3rt.moe.rank_checkpoint import (RankCheckpointError, expected_tensors, load_rank_sliced, read_rank_metadata,
                                        save_rank_sliced)
from exl3rt.moe.tp import TPError, dense_experts, rank_bounds, slice_encoded, slice_expert, tp_moe_forward
from exl3rt.util import tensorfiles

H, I = 128, 512
PREFIX = "model.layers.3.mlp"


# ---- synthetic encoded experts ---------------------------------------------------------------------------
def vec(g, n, scale=1.0):
    """fp16 sign × scale vector (what EXL3 stores as suh / svh)."""
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (sign * (0.5 + torch.rand(n, generator=g)) * scale).to(torch.float16)


def linear(g, rows, cols, bits, codebook="mcg", suh=None, svh=None, name=""):
    """A random but valid EncodedLinear: any int16 trellis decodes, so no encoder run is needed."""
    tr = torch.randint(-32768, 32768, (rows // 16, cols // 16, words16_per_tile(bits)), generator=g,
                       dtype=torch.int32).to(torch.int16)
    return EncodedLinear(trellis=tr, suh=vec(g, rows, 0.1) if suh is None else suh,
                         svh=vec(g, cols) if svh is None else svh, codebook=codebook, name=name)


def expert(g, bits, codebook="mcg", gated=True, shared=None, hidden=H, inter=I):
    """``{proj: EncodedLinear}``; ``shared`` = hidden-side vectors {proj: tensor} reused by every expert."""
    shared = shared or {}
    ex = {"up_proj": linear(g, hidden, inter, bits, codebook, suh=shared.get("up_proj")),
          "down_proj": linear(g, inter, hidden, bits, codebook, svh=shared.get("down_proj"))}
    if gated:
        ex["gate_proj"] = linear(g, hidden, inter, bits, codebook, suh=shared.get("gate_proj"))
    return ex


def layer_experts(seed, bits, codebook="mcg", shared_h=False):
    g = torch.Generator().manual_seed(seed)
    shared = {"gate_proj": vec(g, H, 0.1), "up_proj": vec(g, H, 0.1), "down_proj": vec(g, H)} if shared_h else None
    return [expert(g, k, codebook, shared=shared) for k in bits]


def w64(lin):
    """Independent truth: the full weight from format.reconstruct in float64."""
    return reconstruct(lin.trellis, lin.suh, lin.svh, lin.codebook, dtype=torch.float64)


def expert64(ex, x):
    h = x @ w64(ex["up_proj"])
    if "gate_proj" in ex:
        h = F.silu(x @ w64(ex["gate_proj"])) * h
    else:
        h = F.silu(h)
    return h @ w64(ex["down_proj"])


def loop_moe64(x, ids, w, experts):
    """Per token, per slot: Σ w · expert(x) in float64 from full (unsliced) experts."""
    dense = [{p: w64(lin) for p, lin in ex.items()} for ex in experts]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            if not 0 <= int(ids[t, s]) < len(dense):
                continue  # expert-parallel sentinel: not this layer's expert
            d = dense[int(ids[t, s])]
            xt = x[t:t + 1].double()
            h = F.silu(xt @ d["gate_proj"]) * (xt @ d["up_proj"])
            out[t] += float(w[t, s]) * (h @ d["down_proj"])[0]
    return out


def routing(seed, tokens, num_experts, k):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    return x, ids, w


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# ---- rank bounds ---------------------------------------------------------------------------------------
def test_rank_bounds_deal_whole_blocks():
    for blocks in range(1, 10):
        inter = 128 * blocks
        for tp in range(1, blocks + 1):
            bounds = [rank_bounds(inter, tp, r) for r in range(tp)]
            # brute force: deal the blocks round robin, then give each rank a contiguous run of its count
            counts = [len(range(r, blocks, tp)) for r in range(tp)]
            assert [(b - a) // 128 for a, b in bounds] == counts
            assert bounds[0][0] == 0 and bounds[-1][1] == inter
            assert all(bounds[r][1] == bounds[r + 1][0] for r in range(tp - 1))
    assert rank_bounds(640, 2, 0) == (0, 384) and rank_bounds(640, 2, 1) == (384, 640)
    assert rank_bounds(1024, 2, 1, granularity=256) == (512, 1024)


@pytest.mark.parametrize("args, match", [
    ((200, 2, 0), "200 is not a positive multiple of 128"),
    ((0, 1, 0), "not a positive multiple"),
    ((512, 5, 0), "tp_size=5 exceeds the 4 blocks"),
    ((512, 2, 2), r"rank=2: must be in \[0, tp_size=2\)"),
    ((512, 0, 0), "tp_size=0"),
    ((512, 2, 0, 64), "granularity=64: must be a positive multiple of 128"),
])
def test_rank_bounds_errors(args, match):
    with pytest.raises(TPError, match=match):
        rank_bounds(*args)


# ---- slicing --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [0, 1])
def test_slice_encoded_is_a_tile_sub_block(dim):
    g = torch.Generator().manual_seed(dim)
    full = linear(g, 512, 384, 3, "mcg", name="w") if dim == 0 else linear(g, 384, 512, 4, "3inst", name="w")
    s = slice_encoded(full, dim, 128, 384)
    if dim == 0:
        assert torch.equal(s.trellis, full.trellis[8:24]) and torch.equal(s.suh, full.suh[128:384])
        assert torch.equal(s.svh, full.svh) and (s.in_features, s.out_features) == (256, 384)
    else:
        assert torch.equal(s.trellis, full.trellis[:, 8:24]) and torch.equal(s.svh, full.svh[128:384])
        assert torch.equal(s.suh, full.suh) and (s.in_features, s.out_features) == (384, 256)
    assert (s.bits, s.codebook, s.name) == (full.bits, full.codebook, "w")
    assert s.trellis.untyped_storage().nbytes() == s.trellis.numel() * 2  # owns its bytes, not a view
    # the decoded rotated-basis matrix is bit-exact, the weight is the float64 sub-block
    idx = (slice(128, 384), slice(None)) if dim == 0 else (slice(None), slice(128, 384))
    assert torch.equal(decode(s.trellis, s.bits, s.codebook), decode(full.trellis, full.bits, full.codebook)[idx])
    assert rel(w64(s), w64(full)[idx]) < 1e-13


def test_slice_encoded_errors():
    g = torch.Generator().manual_seed(0)
    full = linear(g, 256, 512, 2, name="e.up_proj")
    with pytest.raises(TPError, match=r"e.up_proj.trellis: slice \[64, 256\) .* aligned to 128"):
        slice_encoded(full, 1, 64, 256)
    with pytest.raises(TPError, match=r"slice \[256, 640\)"):
        slice_encoded(full, 1, 256, 640)
    with pytest.raises(TPError, match="dim=2"):
        slice_encoded(full, 2, 0, 128)
    padded = EncodedLinear(trellis=full.trellis, suh=full.suh, svh=full.svh, out_features=500, name="p")
    with pytest.raises(TPError, match="p.trellis: out_features=500 is padded to 512"):
        slice_encoded(padded, 1, 0, 256)


@pytest.mark.parametrize("codebook", ["mcg", "3inst"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_sum_over_ranks_is_the_expert(bits, codebook):
    g = torch.Generator().manual_seed(10 * bits + len(codebook))
    ex = expert(g, bits, codebook)
    x = torch.randn(5, H, generator=g, dtype=torch.float64)
    truth = expert64(ex, x)
    for tp in (2, 3):  # 3 ranks of 512 columns: 256, 128, 128 (uneven)
        parts = [slice_expert(ex, tp, r) for r in range(tp)]
        for r, part in enumerate(parts):  # bit-exact sub-blocks of the full trellis
            i0, i1 = rank_bounds(I, tp, r)
            assert torch.equal(part["gate_proj"].trellis, ex["gate_proj"].trellis[:, i0 // 16:i1 // 16])
            assert torch.equal(part["up_proj"].trellis, ex["up_proj"].trellis[:, i0 // 16:i1 // 16])
            assert torch.equal(part["down_proj"].trellis, ex["down_proj"].trellis[i0 // 16:i1 // 16])
            assert torch.equal(part["down_proj"].suh, ex["down_proj"].suh[i0:i1])
            assert part["up_proj"].suh is ex["up_proj"].suh and part["down_proj"].svh is ex["down_proj"].svh
        total = sum(d(x) for d in dense_experts(parts, dtype=torch.float64))
        assert rel(total, truth) < 1e-12


def test_sum_over_ranks_ungated():
    g = torch.Generator().manual_seed(5)
    ex = expert(g, 3, gated=False)
    x = torch.randn(3, H, generator=g, dtype=torch.float64)
    total = sum(d(x) for d in dense_experts([slice_expert(ex, 4, r) for r in range(4)], dtype=torch.float64))
    assert rel(total, expert64(ex, x)) < 1e-12


def test_slice_expert_checks_geometry():
    g = torch.Generator().manual_seed(1)
    ex = expert(g, 3)
    bad = dict(ex, down_proj=linear(g, 384, H, 3))
    with pytest.raises(TPError, match=r"e7.down_proj.trellis: codes a \[384, 128\] weight, expected \[512, 128\]"):
        slice_expert(bad, 2, 0, where="e7")
    with pytest.raises(TPError, match="e7.w2: not an expert projection"):
        slice_expert(dict(ex, w2=ex["down_proj"]), 2, 0, where="e7")
    biased = dict(ex, up_proj=EncodedLinear(ex["up_proj"].trellis, ex["up_proj"].suh, ex["up_proj"].svh,
                                            bias=torch.zeros(I, dtype=torch.float16)))
    with pytest.raises(TPError, match="e7.up_proj.bias"):
        slice_expert(biased, 2, 0, where="e7")


# ---- forward -----------------------------------------------------------------------------------------------
def test_forward_tp1_matches_loop_and_requires_a_group():
    experts = layer_experts(3, [3, 4, 3, 4])
    x, ids, w = routing(3, 6, 4, 2)
    ids[0, 0] = 4  # an out-of-range (expert-parallel sentinel) id contributes nothing
    truth = loop_moe64(x, ids, w, experts)
    assert rel(tp_moe_forward(x, ids, w, experts, reduce=False), truth) < 1e-12
    y32 = tp_moe_forward(x.float(), ids, w.float(), dense_experts(experts), reduce=False)
    assert y32.dtype == torch.float32 and rel(y32.double(), truth) < 1e-5
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        tp_moe_forward(x, ids, w, experts)


# ---- checkpoints -------------------------------------------------------------------------------------------
def test_save_load_roundtrip(tmp_path):
    bits = [3, 4, 4, 3, 3]
    for layout in ("per_expert", "shared_h"):
        experts = layer_experts(7, bits, shared_h=layout == "shared_h")
        other = layer_experts(8, [4, 4], codebook="3inst", shared_h=layout == "shared_h")
        path = save_rank_sliced(tmp_path / layout, {PREFIX: experts, "model.layers.4.mlp": other}, 2,
                                rotation_layout=layout, config={"architectures": ["X"]})
        meta = read_rank_metadata(path)
        assert (meta.tp_size, meta.rotation_layout) == (2, layout)
        assert meta.layers[PREFIX].bits_per_expert == tuple(bits)
        assert meta.layers["model.layers.4.mlp"].codebooks == ("3inst", "3inst")
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["architectures"] == ["X"] and cfg["quantization_config"]["quant_method"] == "exl3"
        names = set(tensorfiles.TensorFiles(path).names())
        has_shared = any(".shared_h." in n for n in names)
        assert has_shared == (layout == "shared_h")
        for rank in range(2):
            loaded = load_rank_sliced(path, rank, 2)
            for prefix, src in ((PREFIX, experts), ("model.layers.4.mlp", other)):
                lay = loaded[prefix]
                assert lay.bounds == rank_bounds(I, 2, rank) and len(lay.experts) == len(src)
                for e, ex in enumerate(src):
                    want = slice_expert(ex, 2, rank)
                    for p, lin in want.items():
                        got = lay.experts[e][p]
                        assert (got.bits, got.codebook) == (lin.bits, lin.codebook)
                        for f in ("trellis", "suh", "svh"):
                            assert torch.equal(getattr(got, f), getattr(lin, f)), (prefix, e, p, f)
            lay = loaded[PREFIX]
            tables = lay.rotation_tables()
            rows = 1 if layout == "shared_h" else len(bits)
            assert tables["gate_suh"].shape == (rows, H) and tables["down_svh"].shape == (rows, H)
            assert tables["up_svh"].shape == (len(bits), 256)
            if layout == "shared_h":  # loaded once, the same tensor for every expert
                assert all(ex["up_proj"].suh is lay.experts[0]["up_proj"].suh for ex in lay.experts)
            rot = lay.tier_rotations(tiers_from_bitrates(bits, layer=PREFIX))
            assert rot.broadcast_suh == rot.broadcast_svh == (layout == "shared_h")
            assert rot.intermediate.shape == (len(bits), 3 * 256)


class CountingHandle:
    """A safe_open handle that records every tensor whose data is read."""

    def __init__(self, handle, log):
        self._h, self._log = handle, log

    def get_tensor(self, name):
        self._log.append(name)
        return self._h.get_tensor(name)

    def __getattr__(self, attr):  # keys, get_slice (header only), metadata
        return getattr(self._h, attr)


def test_loader_reads_only_its_rank(tmp_path, monkeypatch):
    path = save_rank_sliced(tmp_path / "ck", {PREFIX: layer_experts(2, [3, 4, 3], shared_h=True)}, 3,
                            rotation_layout="shared_h",
                            max_shard_bytes=40_000)  # several shards
    assert len(list(path.glob("*.safetensors"))) > 2
    log: list[str] = []
    real = tensorfiles.safe_open
    monkeypatch.setattr(tensorfiles, "safe_open", lambda *a, **k: CountingHandle(real(*a, **k), log))
    load_rank_sliced(path, 1, 3)
    assert sorted(log) == sorted(expected_tensors(read_rank_metadata(path), PREFIX, 1))
    assert all(".rank1." in n for n in log) and len(log) == len(set(log))


def test_save_errors_leave_the_disk_alone(tmp_path):
    experts = layer_experts(4, [3, 4])
    out = tmp_path / "ck"
    with pytest.raises(RankCheckpointError, match=r"experts.1.gate_proj.suh: differs from .*experts.0.gate_proj.suh"
                                                 r".*use rotation_layout='per_expert'"):
        save_rank_sliced(out, {PREFIX: experts}, 2, rotation_layout="shared_h")
    with pytest.raises(RankCheckpointError, match="tp_size=8 exceeds the 4 blocks"):
        save_rank_sliced(out, {PREFIX: experts}, 8)
    g = torch.Generator().manual_seed(0)
    padded = dict(experts[0], down_proj=EncodedLinear(experts[0]["down_proj"].trellis, experts[0]["down_proj"].suh,
                                                      experts[0]["down_proj"].svh, in_features=500))
    with pytest.raises(RankCheckpointError, match="experts.1.down_proj: the intermediate side is padded"):
        save_rank_sliced(out, {PREFIX: [experts[0], padded]}, 2)
    with pytest.raises(RankCheckpointError, match=r"experts.1: projections differ in bitrate"):
        save_rank_sliced(out, {PREFIX: [experts[0], dict(experts[0], up_proj=linear(g, H, I, 2))]}, 2)
    with pytest.raises(RankCheckpointError, match="rotation_layout='shared'"):
        save_rank_sliced(out, {PREFIX: experts}, 2, rotation_layout="shared")
    assert not out.exists()
    out.mkdir()
    (out / "keep.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not empty \("):
        save_rank_sliced(out, {PREFIX: experts}, 2)
    assert sorted(p.name for p in out.iterdir()) == ["keep.safetensors"]


# ---- loader validation ---------------------------------------------------------------------------------------
def stored(path):
    tensors = {}
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A per-expert and a shared_h checkpoint (TP 2, experts K3/K4/K3 mcg), as tensors + metadata."""
    root = tmp_path_factory.mktemp("src")
    out = {}
    for layout in ("per_expert", "shared_h"):
        path = save_rank_sliced(root / layout, {PREFIX: layer_experts(6, [3, 4, 3], shared_h=layout == "shared_h")},
                                2, rotation_layout=layout)
        out[layout] = (stored(path), read_rank_metadata(path).to_json())
    return out


def rewrite(tmp_path, tensors, meta):
    return write_checkpoint(tmp_path / "bad", {}, tensors=tensors, quantization_config={"moe_tp": meta})


E0 = f"{PREFIX}.experts.0"
SH = f"{PREFIX}.experts.shared_h"


def _drop(name):
    return lambda t, m: t.pop(name)


def _add(name, value=None):
    return lambda t, m: t.__setitem__(name, torch.zeros(H, dtype=torch.float16) if value is None else value)


def _set_bits(t, m):
    m["layers"][PREFIX]["bits_per_expert"][0] = 4


def _undeclared(t, m):
    t["model.layers.9.mlp.experts.0.up_proj.rank0.trellis"] = t[f"{E0}.up_proj.rank0.trellis"].clone()


@pytest.mark.parametrize("layout, mutate, match", [
    ("per_expert", _drop(f"{E0}.down_proj.rank1.trellis"), f"{E0}.down_proj.rank1.trellis: missing"),
    ("shared_h", _drop(f"{SH}.up_proj.rank0.suh"), f"{SH}.up_proj.rank0.suh: missing"),
    ("per_expert", _drop(f"{E0}.up_proj.rank0.mcg"), f"{E0}.up_proj.rank0.mcg: missing"),
    ("per_expert", _add(f"{E0}.up_proj.rank0.scales"), f"{E0}.up_proj.rank0.scales: unknown field 'scales'"),
    ("per_expert", _add(f"{PREFIX}.experts.7.up_proj.rank0.suh"), "experts.7.up_proj.rank0.suh: expert 7 is outside"),
    ("per_expert", _add(f"{E0}.up_proj.rank2.suh"), "rank2.suh: rank 2 is outside tp_size=2"),
    ("per_expert", _add(f"{E0}.w1.rank0.suh"), r"w1.rank0.suh: projection 'w1' is not one of"),
    ("per_expert", _add(f"{SH}.up_proj.rank0.suh"),
     f"{SH}.up_proj.rank0.suh: a shared_h tensor in a checkpoint whose rotation_layout is 'per_expert'"),
    ("shared_h", _add(f"{E0}.gate_proj.rank1.suh"),
     f"{E0}.gate_proj.rank1.suh: a hidden-side rotation under an expert id in a shared_h checkpoint"),
    ("shared_h", _add(f"{E0}.down_proj.rank0.svh"), "down_proj.rank0.svh: a hidden-side rotation under an expert id"),
    ("shared_h", _add(f"{SH}.gate_proj.rank0.svh"), f"{SH}.gate_proj.rank0.svh: gate_proj shares its hidden-side 'suh"),
    ("shared_h", _add(f"{SH}.down_proj.rank1.suh"), f"{SH}.down_proj.rank1.suh: down_proj shares its hidden-side 'sv"),
    ("per_expert", _add(f"{E0}.up_proj.rank0.mul1", torch.tensor(0, dtype=torch.int32)),
     "up_proj.rank0.mul1: codebook marker for 'mul1'"),
    ("per_expert", _set_bits, rf"{E0}.down_proj.rank0.trellis: stored as I16 \[16, 8, 48\], expected I16 \[16, 8, 64"),
    ("per_expert", _undeclared, "layers.9.mlp.experts.0.up_proj.rank0.trellis: layer 'model.layers.9.mlp' is not decl"),
])
def test_loader_rejects_malformed(tmp_path, sources, layout, mutate, match):
    tensors, meta = sources[layout]
    tensors, meta = dict(tensors), json.loads(json.dumps(meta))
    mutate(tensors, meta)
    path = rewrite(tmp_path, tensors, meta)
    with pytest.raises(RankCheckpointError, match=match):
        load_rank_sliced(path, 0, 2)


def test_loader_checks_metadata_and_tp(tmp_path, sources):
    tensors, meta = sources["per_expert"]
    path = rewrite(tmp_path, tensors, meta)
    with pytest.raises(RankCheckpointError, match=r"sliced for tp_size=2, the runtime runs tp_size=4.*"
                                                  r"tensor_parallel_size=2 or re-slice"):
        load_rank_sliced(path, 0, 4)
    with pytest.raises(RankCheckpointError, match=r"rank=2: must be in \[0, tp_size=2\)"):
        load_rank_sliced(path, 2, 2)
    other = tmp_path / "nometa"
    write_checkpoint(other, {}, tensors=tensors)
    with pytest.raises(RankCheckpointError, match="moe_tp: missing or not an object"):
        load_rank_sliced(other, 0, 2)
    bad = json.loads(json.dumps(meta))
    bad["rotation_layout"] = "shared_h_v1"
    with pytest.raises(RankCheckpointError, match="rotation_layout='shared_h_v1'"):
        load_rank_sliced(rewrite(tmp_path / "x", tensors, bad), 0, 2)
    with pytest.raises(RankCheckpointError, match="no such file or directory"):
        load_rank_sliced(tmp_path / "absent", 0, 2)


# ---- two processes, gloo ---------------------------------------------------------------------------------------
def _gloo_worker(rank, init, paths, x, ids, w, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        results = {}
        for layout, path in paths.items():
            layer = load_rank_sliced(path, rank, 2)[PREFIX]
            for dtype in (torch.float64, torch.float32):
                experts = dense_experts(layer.experts, dtype=dtype)
                results[f"{layout}.{dtype}"] = tp_moe_forward(x.to(dtype), ids, w.to(dtype), experts)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_gloo_two_ranks_equal_tp1(tmp_path):
    import torch.multiprocessing as mp

    bits = [3, 4, 4, 3, 4, 3]  # mixed bitrates across experts
    x, ids, w = routing(11, 9, len(bits), 3)
    paths, truth = {}, {}
    for layout in ("per_expert", "shared_h"):
        experts = layer_experts(12, bits, shared_h=layout == "shared_h")
        paths[layout] = str(save_rank_sliced(tmp_path / layout, {PREFIX: experts}, 2, rotation_layout=layout))
        truth[layout] = loop_moe64(x, ids, w, experts)
    mp.spawn(_gloo_worker, args=(f"file://{tmp_path / 'init'}", paths, x, ids, w, str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key in res[0]:
        assert torch.equal(res[0][key], res[1][key]), key  # the all-reduce gives every rank the same sum
    for layout in paths:
        assert rel(res[0][f"{layout}.torch.float64"], truth[layout]) < 1e-10
        y32 = res[0][f"{layout}.torch.float32"]
        assert y32.dtype == torch.float32 and rel(y32.double(), truth[layout]) < 1e-5
