"""The vLLM plugin's vLLM-free parts (run in the main CI venv, which has no vLLM).

Truth: full-matrix reconstruction (format.reconstruct) for TP pieces; the CacheKey fields for keys.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from exl3rt.format.reconstruct import reconstruct
from exl3rt.integrations.vllm.settings import guess_mode, online_config
from exl3rt.integrations.vllm.shards import (WHOLE, ShardError, check_block_aligned, column_shards, row_shard,
                                             shard_names)
from exl3rt.integrations.vllm.slicing import rank_piece
from exl3rt.runtime.config import Exl3ConfigError


def test_importing_exl3rt_and_the_plugin_package_does_not_import_vllm():
    code = ("import sys, exl3rt, exl3rt.integrations.vllm, exl3rt.integrations.vllm.shards, "
            "exl3rt.integrations.vllm.slicing, exl3rt.integrations.vllm.settings, exl3rt.integrations.vllm.moe_experts; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_register_without_vllm_names_the_missing_package():
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    from exl3rt.integrations.vllm import register

    with pytest.raises(ImportError, match="vllm"):
        register()


def test_shard_names_follow_packed_modules_mapping():
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert shard_names("model.layers.3.self_attn.qkv_proj", packed) == [
        "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.v_proj"]
    assert shard_names("model.layers.3.mlp.down_proj", packed) is None


def test_column_shards_tp1_are_whole_and_keep_plain_keys():
    specs = column_shards(["q", "k", "v"], ["q", "k", "v"], [512, 128, 128], [512, 128, 128], [0, 0, 0], 512, 1, 0)
    assert [s.bounds for s in specs] == [WHOLE] * 3
    assert [s.out_offset for s in specs] == [0, 512, 640]
    assert all(s.key_tp == (1, 0, None) for s in specs)


def test_column_shards_rank_bounds_with_replicated_kv_heads():
    # 8 q heads, 1 kv head of 128, TP 4: q rows [r*256, (r+1)*256), k/v replicated (whole) on every rank
    specs = column_shards(["q", "k", "v"], ["q", "k", "v"], [1024, 128, 128], [256, 128, 128], [2, 0, 0], 512, 4, 2)
    assert specs[0].bounds == (512, 768, 0, 512) and specs[0].key_tp == (4, 2, (512, 768, 0, 512))
    assert specs[1].is_whole and specs[2].is_whole
    assert [s.out_offset for s in specs] == [0, 256, 384]


def test_row_shard_bounds_and_block_alignment_errors():
    spec = row_shard("model.layers.0.mlp.down_proj", 256, 512, 256, 2, 1)
    assert spec.bounds == (0, 256, 256, 512)
    check_block_aligned(spec, "model.layers.0.mlp.down_proj")
    bad = row_shard("model.layers.0.mlp.down_proj", 256, 400, 200, 2, 1)
    with pytest.raises(ShardError, match=r"down_proj.*input columns \[200, 400\).*multiples of 128"):
        check_block_aligned(bad, "model.layers.0.mlp.down_proj")


def _random_codes(in_p: int, out_p: int, k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32767, (in_p // 16, out_p // 16, 16 * k), generator=g, dtype=torch.int32).to(torch.int16)
    suh = (torch.rand(in_p, generator=g) + 0.5).to(torch.float16) * torch.sign(torch.randn(in_p, generator=g)).to(torch.float16)
    svh = (torch.rand(out_p, generator=g) + 0.5).to(torch.float16)
    return trellis, suh, svh


@pytest.mark.parametrize("split", ["rows", "cols"])
def test_rank_piece_equals_the_block_of_the_full_reconstruction(split):
    trellis, suh, svh = _random_codes(256, 384)
    # float64: the piece and the full matrix go through matmuls of different shapes, whose BLAS kernels (and so
    # rounding) differ between CPUs; in float64 both are within 1e-12 of the exact block
    full = reconstruct(trellis, suh, svh, "mcg", dtype=torch.float64)  # [in, out] = [256, 384]
    if split == "rows":  # column-parallel: rank 1 of 3 holds output rows [128, 256) of the HF [out, in]
        spec = column_shards(["x"], [None], [384], [128], [1], 256, 3, 1)[0]
        want = full[:, 128:256]
    else:  # row-parallel: rank 1 of 2 holds input columns [128, 256)
        spec = row_shard("x", 384, 256, 128, 2, 1)
        want = full[128:256, :]
    piece = reconstruct(rank_piece("trellis", trellis, spec), rank_piece("suh", suh, spec),
                        rank_piece("svh", svh, spec), "mcg", dtype=torch.float64)
    torch.testing.assert_close(piece, want, rtol=1e-12, atol=1e-12)


def test_online_settings_from_dict_env_and_errors(monkeypatch):
    monkeypatch.setenv("EXL3RT_VLLM_BITS", "3")
    assert online_config({"quant_method": "exl3"}).bits == 3
    assert online_config({"quant_method": "exl3", "bits": 5}).bits == 5      # the dict wins
    monkeypatch.setenv("EXL3RT_VLLM_BITS", "9")
    from exl3rt.env import EnvError

    with pytest.raises(EnvError, match="EXL3RT_VLLM_BITS='9'"):
        online_config({})
    monkeypatch.delenv("EXL3RT_VLLM_BITS")
    with pytest.raises(Exl3ConfigError, match="unknown field.*'bitz'"):
        online_config({"quant_method": "exl3", "bitz": 4})
    assert guess_mode({"quant_method": "exl3", "bits": 4}) == "online"
    assert guess_mode({"quant_method": "exl3", "bits": 4.0, "head_bits": 6, "version": "0.3"}) == "checkpoint"
    with pytest.raises(Exl3ConfigError, match="mode='both'"):
        guess_mode({"mode": "both"})


def test_online_encoder_rank_local_keys(tmp_path, monkeypatch):
    from exl3rt.runtime.config import Exl3Config
    from exl3rt.runtime.online import OnlineEncoder

    seen = []

    def fake_load_or_encode(key, encode, *, device, name):
        seen.append(key)
        raise RuntimeError("stop")

    enc = OnlineEncoder(Exl3Config(bits=4, cache_dir=str(tmp_path), progress=False))
    monkeypatch.setattr(enc.cache, "load_or_encode", fake_load_or_encode)
    w = torch.randn(256, 128, dtype=torch.bfloat16)
    for tp in (None, (2, 1, (128, 256, 0, 128))):
        with pytest.raises(RuntimeError, match="stop"):
            enc.encode("model.layers.0.self_attn.q_proj", w[128:] if tp else w, 4, tp=tp)
    whole, piece = seen
    assert (whole.tp_size, whole.tp_rank, whole.tp_bounds) == (1, 0, (0, 0, 0, 0))
    assert (piece.tp_size, piece.tp_rank, piece.tp_bounds) == (2, 1, (128, 256, 0, 128))
    assert (piece.out_features, piece.in_features) == (128, 128) and piece.digest() != whole.digest()


# ---- MoE experts (integrations/vllm/moe_experts.py) ----------------------------------------------------------
def _expert_linears(h: int, i: int, k: int, seed: int, gated: bool = True) -> dict:
    from exl3rt.format.encoded import EncodedLinear
    from exl3rt.runtime.linear import Exl3Linear

    out = {}
    for j, (p, (fin, fout)) in enumerate((("gate_proj", (h, i)), ("up_proj", (h, i)), ("down_proj", (i, h)))):
        if p == "gate_proj" and not gated:
            continue
        t, suh, svh = _random_codes(fin, fout, k, seed * 10 + j)
        enc = EncodedLinear(trellis=t, suh=suh / 64, svh=svh / 64, codebook="mcg", in_features=fin, out_features=fout)
        out[p] = Exl3Linear.from_encoded(enc, name=f"experts.{seed}.{p}")
    return out


class _Scope:
    """An owner scope (a model or config in real use)."""


def _moe_runner(experts, *, top_k=2, max_batched=64, moe_runtime=None, warmed=None, cache=None, scope=None):
    from exl3rt.integrations.vllm.moe_experts import Exl3VllmMoE
    from exl3rt.moe import MoERuntimeCache, MoESettings, Owner, reference_launch_factory

    h = experts[0]["up_proj"].in_features
    i = experts[0]["up_proj"].out_features
    return Exl3VllmMoE("model.layers.0.mlp.experts", experts, hidden=h, intermediate=i, top_k=top_k,
                       settings=MoESettings(max_batched=max_batched, max_decode_m=4),
                       cache=cache or MoERuntimeCache(reference_launch_factory),
                       owner=Owner.of(scope or _Scope()),
                       moe_runtime=moe_runtime, warmed=warmed)


def _routes(t: int, e: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int64)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return ids, w


def test_expert_slice_bounds_keys_and_block_errors():
    from exl3rt.integrations.vllm.moe_experts import expert_slice
    from exl3rt.moe import rank_bounds

    whole = expert_slice("m.experts", 128, 768, 1, 0)
    assert whole.is_whole and whole.tp("gate_proj") is None and whole.tp("down_proj") is None
    sl = expert_slice("m.experts", 128, 768, 3, 2, require_blocks=True)   # 256 per rank: the 128-block split
    assert (sl.i0, sl.i1) == (512, 768) == rank_bounds(768, 3, 2)
    assert sl.tp("up_proj") == (3, 2, (512, 768, 0, 128))               # rows of the HF [I, H] weight
    assert sl.tp("down_proj") == (3, 2, (0, 128, 512, 768))             # columns of the HF [H, I] weight
    odd = expert_slice("m.experts", 128, 768, 4, 1)                     # 192 per rank: online encodes it
    assert (odd.i0, odd.i1) == (192, 384) and not odd.block_aligned
    assert odd.cover is None and (odd.served, odd.width) == ((192, 384), 192)
    cov = expert_slice("m.experts", 128, 768, 4, 1, require_blocks=True)   # pre-quantized: the covering blocks
    assert (cov.i0, cov.i1, cov.cover, cov.width, cov.local) == (192, 384, (128, 384), 256, 192)
    with pytest.raises(ShardError, match="does not split evenly over 5"):
        expert_slice("m.experts", 128, 768, 5, 0)


def test_expert_bits_follow_the_transformers_precedence():
    from exl3rt.integrations.vllm.moe_experts import expert_bits
    from exl3rt.runtime.config import Exl3Config
    from exl3rt.runtime.router_stats import TopRouted

    name = "model.layers.0.mlp.experts"
    cfg = Exl3Config(bits=3, bits_for={"*.experts.*.down_proj": 5},
                     expert_bits={"model.layers.*.mlp.experts": {"default": 4, "experts": {2: 6}}})
    bits = expert_bits(cfg, name, 4)
    assert bits[0] == {"gate_proj": 4, "up_proj": 4, "down_proj": 4}   # the expert default wins over bits_for
    assert bits[2] == {"gate_proj": 6, "up_proj": 6, "down_proj": 6}
    assert expert_bits(Exl3Config(bits=3, bits_for={"*.down_proj": 5}), name, 2)[1]["down_proj"] == 5
    assert expert_bits(Exl3Config(ignore=["*.mlp.experts"]), name, 4) is None
    assert expert_bits(Exl3Config(ignore=["*.experts.*"]), name, 4) is None
    with pytest.raises(ShardError, match=r"experts.1.gate_proj.*ignore all of them"):
        expert_bits(Exl3Config(ignore=["*.experts.1.*"]), name, 4)
    with pytest.raises(Exl3ConfigError, match="router statistics"):
        expert_bits(Exl3Config(expert_bits_rule=TopRouted(high=4, low=3, fraction=0.25, tokens=64)), name, 4)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_moe_runtime_equals_the_per_route_loop_plans_once_and_warms(ids_dtype):
    from exl3rt.integrations.vllm.moe_experts import VllmExpert
    from exl3rt.moe.tp import moe_partial

    experts = [VllmExpert(_expert_linears(128, 256, k, e), expert=e) for e, k in enumerate((3, 4, 3, 4))]
    warmed: set[int] = set()
    scope = _Scope()
    runner = _moe_runner(experts, warmed=warmed, scope=scope)
    assert runner.path == "runtime ((3, 2), (4, 2))"
    x = torch.randn(150, 128, generator=torch.Generator().manual_seed(1))   # > max_batched=64: chunks
    ids, w = _routes(150, 4, 2)
    want = moe_partial(x, ids, w, experts).to(x.dtype)
    torch.testing.assert_close(runner(x, ids.to(ids_dtype), w), want, rtol=1e-4, atol=1e-4)
    assert runner.layer.planned and len(runner.layer.runtimes()) == 1      # ids run as int32: one runtime
    assert runner.warmed > 0 and len(warmed) == 1
    assert runner.launch_kinds() == {"decode": "ReferenceLaunch", "prefill": "ReferenceLaunch"}
    torch.testing.assert_close(runner(x[:3], ids[:3], w[:3]), want[:3], rtol=1e-4, atol=1e-4)  # decode plan
    # a second layer with the same key shares the runtime: planned, not warmed again
    other = _moe_runner(experts, warmed=warmed, cache=runner.layer.cache, scope=scope)
    assert other.plan(x.device, x.dtype) == 0 and other.layer.runtimes() == runner.layer.runtimes()


def test_moe_mixed_k_expert_falls_back_to_the_loop_or_raises():
    from exl3rt.integrations.vllm.moe_experts import VllmExpert
    from exl3rt.moe.tp import moe_partial
    from exl3rt.runtime.policy import PolicyError

    mixed = _expert_linears(128, 128, 3, 0)
    mixed["down_proj"] = _expert_linears(128, 128, 5, 9)["down_proj"]
    experts = [VllmExpert(mixed, expert=0), VllmExpert(_expert_linears(128, 128, 3, 1), expert=1)]
    runner = _moe_runner(experts, top_k=1)
    assert runner.layer is None and runner.path.startswith("loop: expert 0 mixes bitrates")
    x = torch.randn(5, 128)
    ids, w = _routes(5, 2, 1)
    torch.testing.assert_close(runner(x, ids, w), moe_partial(x, ids, w, experts).to(x.dtype))
    with pytest.raises(PolicyError, match="expert 0 mixes bitrates"):
        _moe_runner(experts, top_k=1, moe_runtime=True)
    never = _moe_runner([experts[1], experts[1]], top_k=1, moe_runtime=False)
    assert never.path == "loop: Exl3Config.moe_runtime=False"


def test_moe_reference_path_refuses_cuda_graph_capture(monkeypatch):
    import exl3rt.integrations.vllm.moe_experts as ex

    runner = _moe_runner([ex.VllmExpert(_expert_linears(128, 128, 3, e), expert=e) for e in range(2)], top_k=1)
    x = torch.randn(2, 128)
    ids, w = _routes(2, 2, 1)
    runner(x, ids, w)                                   # the eager pass plans
    monkeypatch.setattr(ex, "is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph.*enforce_eager=True"):
        runner(x, ids, w)


def test_tp_rank_partials_sum_to_the_whole_expert():
    """Rank r of 2 holds intermediate columns [128r, 128(r+1)) of every expert (vLLM's split, equal to
    exl3rt.moe.rank_bounds); the sum of the ranks' outputs (vLLM's all-reduce) is the whole layer."""
    from exl3rt.format.encoded import EncodedLinear
    from exl3rt.integrations.vllm.moe_experts import VllmExpert, expert_slice
    from exl3rt.moe import slice_encoded
    from exl3rt.runtime.linear import Exl3Linear

    full = [_expert_linears(128, 256, 4, e) for e in range(3)]
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(3))
    ids, w = _routes(7, 3, 2, seed=4)
    want = _moe_runner([VllmExpert(f, expert=e) for e, f in enumerate(full)])(x, ids, w)
    total = torch.zeros_like(x)
    for rank in range(2):
        sl = expert_slice("m.experts", 128, 256, 2, rank, require_blocks=True)
        experts = []
        for e, f in enumerate(full):
            lin = {}
            for p, m in f.items():
                enc = EncodedLinear(trellis=m.trellis, suh=m.suh, svh=m.svh, codebook=m.codebook,
                                    in_features=m.in_features, out_features=m.out_features)
                lin[p] = Exl3Linear.from_encoded(slice_encoded(enc, 0 if p == "down_proj" else 1, sl.i0, sl.i1))
            experts.append(VllmExpert(lin, expert=e))
        total += _moe_runner(experts)(x, ids, w)
    torch.testing.assert_close(total, want, rtol=1e-3, atol=1e-3)


def test_online_encoder_rank_local_expert_keys(tmp_path, monkeypatch):
    from exl3rt.integrations.vllm.moe_experts import expert_slice
    from exl3rt.runtime.config import Exl3Config
    from exl3rt.runtime.online import OnlineEncoder

    seen = []

    def fake_load_or_encode(key, encode, *, device, name):
        seen.append((name, key))
        raise RuntimeError("stop")

    enc = OnlineEncoder(Exl3Config(bits=4, cache_dir=str(tmp_path), progress=False))
    monkeypatch.setattr(enc.cache, "load_or_encode", fake_load_or_encode)
    gate, down = torch.randn(256, 128, dtype=torch.bfloat16), torch.randn(128, 256, dtype=torch.bfloat16)
    for tp_size, rank in ((1, 0), (2, 1)):
        sl = expert_slice("model.layers.0.mlp.experts", 128, 256, tp_size, rank)
        for p, piece in (("gate_proj", gate[sl.i0:sl.i1]), ("down_proj", down[:, sl.i0:sl.i1])):
            with pytest.raises(RuntimeError, match="stop"):
                enc.encode(f"model.layers.0.mlp.experts.3.{p}", piece, 4, tp=sl.tp(p))
    (n0, g1), (_, d1), (_, g2), (_, d2) = seen
    assert n0 == "model.layers.0.mlp.experts.3.gate_proj"
    assert (g1.tp_size, g1.tp_rank, g1.tp_bounds) == (1, 0, (0, 0, 0, 0))    # TP=1: the transformers path's key
    assert (g2.tp_size, g2.tp_rank, g2.tp_bounds) == (2, 1, (128, 256, 0, 128))
    assert (d2.tp_size, d2.tp_rank, d2.tp_bounds) == (2, 1, (0, 128, 128, 256))
    assert (d2.out_features, d2.in_features) == (128, 128) and d2.digest() != d1.digest()


# ---- pre-quantized experts: stored codes per expert, this rank's 128-block slice ------------------------------
def _stored_expert(h: int, i: int, k: int, seed: int) -> dict:
    """Stored tensors of one gated expert as a checkpoint holds them (``{proj: {field: tensor}}``)."""
    from exl3rt.format.codebooks import MARKERS

    out = {}
    for j, (p, (fin, fout)) in enumerate((("gate_proj", (h, i)), ("up_proj", (h, i)), ("down_proj", (i, h)))):
        t, suh, svh = _random_codes(fin, fout, k, seed * 10 + j)
        out[p] = {"trellis": t, "suh": suh, "svh": svh, "mcg": torch.tensor(MARKERS["mcg"], dtype=torch.int32)}
    return out


def _collect(prefix: str, stored: list, sl):
    """A StoredExperts fed every tensor of ``stored`` (one ``{proj: {field: tensor}}`` per expert) as vLLM's
    expert loader hands them over."""
    from exl3rt.integrations.vllm.moe_experts import GATED, StoredExperts

    col = StoredExperts(prefix, len(stored), GATED, sl)
    for e, ex in enumerate(stored):
        for p, fields in ex.items():
            for f, t in fields.items():
                col.add(e, p, f, t)
    return col


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
def test_stored_experts_rank_slices_equal_the_hand_sliced_reconstruction(tp_size):
    """Experts at K 2/3/4 (different trellis widths), loaded tensor by tensor as vLLM's expert loader hands
    them over: each rank's matrices are the 128-block slice of the full reconstruction (gate/up: output
    columns [c0, c1), down: input rows [c0, c1)), and their K is the stored one. At TP 4 (192 columns per
    rank) [c0, c1) covers the rank's [i0, i1) with whole blocks and down's rows outside [i0, i1) are zero."""
    from exl3rt.integrations.vllm.moe_experts import expert_slice

    h, i, ks = 128, 768, (3, 2, 4)
    stored = [_stored_expert(h, i, k, e) for e, k in enumerate(ks)]
    for rank in range(tp_size):
        sl = expert_slice("model.layers.0.mlp.experts", h, i, tp_size, rank, require_blocks=True)
        enc = _collect("model.layers.0.mlp.experts", stored, sl).encoded()
        for e, ex in enumerate(stored):
            for p, fields in ex.items():
                got = enc[e][p]
                assert got.bits == ks[e] and got.codebook == "mcg"
                assert got.name == f"model.layers.0.mlp.experts.{e}.{p}"
                full = reconstruct(fields["trellis"], fields["suh"], fields["svh"], "mcg")   # [in, out]
                c0, c1 = sl.served
                want = full[c0:c1].clone() if p == "down_proj" else full[:, c0:c1]
                if p == "down_proj":
                    want[: sl.i0 - c0] = 0
                    want[sl.i1 - c0:] = 0
                assert (got.in_features, got.out_features) == tuple(want.shape)
                # float rounding of the Hadamards differs with the width: equal to fp32 noise, not bit for bit
                torch.testing.assert_close(got.reconstruct(), want, rtol=1e-4, atol=1e-5)
                t0, t1 = c0 // 16, c1 // 16   # and the codes are the stored tile sub-block, nothing re-encoded
                sub = fields["trellis"][t0:t1] if p == "down_proj" else fields["trellis"][:, t0:t1]
                assert torch.equal(got.trellis, sub)


def test_stored_experts_errors_name_the_tensor_and_the_fix():
    from exl3rt.format.errors import FormatError
    from exl3rt.integrations.vllm.moe_experts import GATED, StoredExperts, expert_slice

    sl = expert_slice("model.layers.2.mlp.experts", 128, 256, 1, 0)
    col = StoredExperts("model.layers.2.mlp.experts", 2, GATED, sl)
    ex = _stored_expert(128, 256, 4, 0)
    for p, fields in ex.items():
        for f, t in fields.items():
            col.add(0, p, f, t)
    with pytest.raises(FormatError, match=r"model\.layers\.2\.mlp\.experts\.1\.gate_proj\.trellis: not in the "
                                          r"checkpoint \(3 expert matrices.*store every expert"):
        col.encoded()
    with pytest.raises(FormatError, match=r"experts\.5\.up_proj\.bias: expert 5.*does not match the model config"):
        col.add(5, "up_proj", "bias", torch.zeros(256))
    with pytest.raises(FormatError, match=r"experts\.1\.up_proj\.bias: not an EXL3 tensor"):
        col.add(1, "up_proj", "bias", torch.zeros(256))
    # 256 columns over 4 ranks is 64 each: not a 128-block cut; the rank serves the covering block
    assert expert_slice("model.layers.2.mlp.experts", 128, 256, 4, 1, require_blocks=True).cover == (0, 128)


def test_rank_sliced_checkpoint_gives_the_same_codes_as_slicing_stored_experts(tmp_path):
    """A rank-sliced checkpoint (exl3rt.moe.rank_checkpoint, TP 2) read rank-locally gives, per rank, exactly the
    codes the per-expert loader cuts from the whole experts; a rank layer for another slice is refused."""
    from exl3rt.format.encoded import EncodedLinear
    from exl3rt.integrations.vllm.moe_experts import GATED, expert_slice, rank_layer_experts
    from exl3rt.moe.rank_checkpoint import load_rank_sliced, save_rank_sliced

    h, i, ks = 128, 256, (4, 3)
    stored = [_stored_expert(h, i, k, e) for e, k in enumerate(ks)]
    full = [{p: EncodedLinear.from_state_dict(f, p) for p, f in ex.items()} for ex in stored]
    save_rank_sliced(tmp_path / "ck", {"model.layers.0.mlp": full}, 2)
    for rank in range(2):
        sl = expert_slice("model.layers.0.mlp.experts", h, i, 2, rank, require_blocks=True)
        want = _collect("model.layers.0.mlp.experts", stored, sl).encoded()
        layer = load_rank_sliced(tmp_path / "ck", rank, 2)["model.layers.0.mlp"]
        got = rank_layer_experts(layer, sl, GATED)
        for e in range(len(ks)):
            for p in GATED:
                assert got[e][p].name == want[e][p].name == f"model.layers.0.mlp.experts.{e}.{p}"
                for f in ("trellis", "suh", "svh"):
                    assert torch.equal(getattr(got[e][p], f), getattr(want[e][p], f)), (rank, e, p, f)
        other = expert_slice("model.layers.0.mlp.experts", h, i, 2, 1 - rank, require_blocks=True)
        with pytest.raises(ShardError, match=r"rank-sliced checkpoint gives rank .* of 2.*vLLM gives rank"):
            rank_layer_experts(layer, other, GATED)


# ---- a quantized lm_head (vLLM's ParallelLMHead: vocab-parallel, padded per partition) ---------------------------
def _vllm_vocab_rows(vocab: int, tp_size: int, rank: int, pad_to: int = 64) -> tuple[int, int, int]:
    """vLLM's split of a head (vocab_parallel_embedding._get_indices, no added vocab): the rank's real rows
    ``[start, end)`` and its partition width (the padded vocab over ``tp_size``)."""
    padded = -(-vocab // pad_to) * pad_to
    per = padded // tp_size
    return min(rank * per, vocab), min((rank + 1) * per, vocab), per


@pytest.mark.parametrize("vocab,tp_size", [(300, 1), (500, 2), (1000, 4), (512, 2), (300, 2), (700, 4)])
def test_head_rank_pieces_equal_the_hand_sliced_reconstruction(vocab, tp_size):
    """Each rank's piece (the 128-row blocks covering its vocab rows, :func:`block_cover`), trimmed to its rows,
    equals those rows of the whole head; the ranks together give the whole head. Splits on 128 rows
    (500/2, 1000/4, 512/2) and inside blocks (300/2: 160 rows per rank; 700/4: 176)."""
    from exl3rt.format.encoded import EncodedLinear, padded_width
    from exl3rt.integrations.vllm.shards import block_cover, head_shard

    hidden = 256
    trellis, suh, svh = _random_codes(hidden, padded_width(vocab), k=6, seed=vocab)
    full = reconstruct(trellis, suh, svh, "mcg", dtype=torch.float64)[:, :vocab]  # [hidden, vocab]
    got = []
    for rank in range(tp_size):
        start, end, per = _vllm_vocab_rows(vocab, tp_size, rank)
        spec, (lead, rows), (i_lead, cols) = block_cover(head_shard("lm_head", vocab, hidden, start, end, tp_size, rank))
        check_block_aligned(spec, "lm_head")
        assert rows == end - start and (i_lead, cols) == (0, hidden)
        r0, r1 = (0, vocab) if spec.is_whole else spec.bounds[:2]
        assert r0 % 128 == 0 and (r1 % 128 == 0 or r1 == vocab) and r0 <= start < end <= r1 and lead == start - r0
        assert r1 - r0 - (end - start) < 256 and (spec.is_whole == (tp_size == 1))
        enc = EncodedLinear(trellis=rank_piece("trellis", trellis, spec), suh=rank_piece("suh", suh, spec),
                            svh=rank_piece("svh", svh, spec), codebook="mcg", in_features=spec.in_features,
                            out_features=spec.out_features, name=spec.name)
        piece = enc.reconstruct(dtype=torch.float64)[:, lead: lead + end - start]
        torch.testing.assert_close(piece, full[:, start:end], rtol=0, atol=1e-12)  # float64 summation order
        got.append(piece)
    torch.testing.assert_close(torch.cat(got, dim=1), full, rtol=0, atol=1e-12)


def test_head_misaligned_split_and_empty_rank():
    from exl3rt.integrations.vllm.shards import block_cover, head_shard

    start, end, _ = _vllm_vocab_rows(300, 2, 1)  # padded 320, 160 rows per rank
    spec = head_shard("lm_head", 300, 256, start, end, 2, 1)
    with pytest.raises(ShardError, match=r"lm_head.*rank 1 output rows \[160, 300\) of 300.*multiples of 128"):
        check_block_aligned(spec, "lm_head")   # the exact rows are not a valid piece ...
    cover, (lead, rows), _ = block_cover(spec)
    assert cover.bounds == (128, 300, 0, 256) and (lead, rows) == (32, 140)   # ... the covering blocks are
    assert head_shard("lm_head", 300, 256, 300, 300, 4, 3) is None  # a rank past the vocab holds no row
    with pytest.raises(ShardError, match=r"lm_head: rank 1 of 2 would hold vocab rows \[256, 400\) of a 300-row"):
        head_shard("lm_head", 300, 256, 256, 400, 2, 1)
    # a linear ending at its logical end is fine; one ending mid-block is not
    from exl3rt.integrations.vllm.shards import ShardSpec

    check_block_aligned(ShardSpec("x", None, 0, 172, 256, 300, 256, 2, 1, (128, 300, 0, 256)), "x")
    with pytest.raises(ShardError, match=r"x \(x\).*output rows \[128, 200\) of 300"):
        check_block_aligned(ShardSpec("x", None, 0, 72, 256, 300, 256, 2, 1, (128, 200, 0, 256)), "x")


def test_head_apply_pads_the_partition_with_zero_logits():
    from torch import nn

    from exl3rt.format.encoded import EncodedLinear
    from exl3rt.integrations.vllm.forward import exl3_head_apply
    from exl3rt.runtime.linear import Exl3Linear

    vocab, hidden, width = 100, 128, 128  # vLLM pads 100 to 128 (pad 64): 28 padded rows
    trellis, suh, svh = _random_codes(hidden, 128, k=6, seed=1)
    enc = EncodedLinear(trellis=trellis, suh=suh, svh=svh, codebook="mcg", in_features=hidden, out_features=vocab,
                        name="lm_head")
    layer = nn.Module()
    layer.exl3 = nn.ModuleList([Exl3Linear.from_encoded(enc, name="lm_head")])
    x = torch.randn(3, hidden, dtype=torch.float32)
    y = exl3_head_apply(layer, x, width)
    want = x.double() @ enc.reconstruct(dtype=torch.float64)
    assert y.shape == (3, width) and y.dtype == torch.float32
    torch.testing.assert_close(y[:, :vocab].double(), want, rtol=1e-4, atol=1e-3)
    assert torch.equal(y[:, vocab:], torch.zeros(3, width - vocab))
    bias = torch.arange(width, dtype=torch.float32)
    torch.testing.assert_close(exl3_head_apply(layer, x, width, bias), y + bias)
    empty = nn.Module()
    empty.exl3 = nn.ModuleList()
    assert torch.equal(exl3_head_apply(empty, x, 64), torch.zeros(3, 64))  # a rank past the vocab: all padding


def test_dense_weight_is_the_layers_product_in_vllms_layout():
    """``dense_weight`` (what the CPU serves through vLLM's own GEMM): for q/k/v-like shards with rank windows (input
    columns and output rows inside covered 128-blocks) ``x · denseᵀ`` equals ``exl3_apply`` and the float64
    reconstruction; a head's padded rows are zero; each linear's kept copy is dropped; no dense weight where a
    linear keeps none (its forward decodes per call, or runs the CUDA kernels)."""
    from torch import nn

    from exl3rt.format.encoded import EncodedLinear
    from exl3rt.integrations.vllm.forward import dense_weight, exl3_apply, exl3_head_apply
    from exl3rt.runtime.linear import Exl3Linear

    shapes = [(256, 256), (256, 128), (256, 384)]
    windows = [((0, 256), (32, 200)), ((16, 100), (32, 200)), ((128, 200), (32, 200))]   # (out lead, n), (in lead, n)
    mods, want = [], []
    for j, ((i, o), ((ol, on), (il, inn))) in enumerate(zip(shapes, windows)):
        trellis, suh, svh = _random_codes(i, o, k=4, seed=10 + j)
        enc = EncodedLinear(trellis=trellis, suh=suh, svh=svh, codebook="mcg", in_features=i, out_features=o,
                            name=f"l{j}")
        mods.append(Exl3Linear.from_encoded(enc, name=f"l{j}"))
        want.append(enc.reconstruct(dtype=torch.float64)[il: il + inn, ol: ol + on])
    layer = nn.Module()
    layer.exl3 = nn.ModuleList(mods)
    layer.exl3_windows = windows
    x = torch.randn(5, 200, dtype=torch.float64)
    ref = x @ torch.cat(want, dim=1)
    y = exl3_apply(layer, x.float())
    dense = dense_weight(layer, torch.float32)
    assert dense.shape == (256 + 100 + 200, 200) and dense.is_contiguous()
    assert all(m._w_cache is None for m in mods)
    got = torch.nn.functional.linear(x.float(), dense)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got, y, rtol=1e-5, atol=1e-4)
    padded = dense_weight(layer, torch.float32, rows=600)
    assert padded.shape == (600, 200) and torch.equal(padded[:556], dense) and not padded[556:].any()
    # a layer serving it (as use_dense_gemm leaves one, here with F.linear for vLLM's GEMM): the shared forwards run
    # the one GEMM, the bias added once, and a head's padded rows give logit 0
    head = nn.Module()
    head.exl3 = layer.exl3
    head.weight, head.cpu_linear, head.exl3_dense = padded, torch.nn.functional.linear, True
    bias = torch.arange(600, dtype=torch.float32)
    got = exl3_head_apply(head, x.float(), 600, bias)
    torch.testing.assert_close(got[:, :556].double(), ref + bias[:556].double(), rtol=1e-4, atol=1e-3)
    assert torch.equal(got[:, 556:], bias[556:].expand(5, -1))
    torch.testing.assert_close(exl3_apply(head, x.float()).double(), torch.nn.functional.pad(ref, (0, 44)),
                               rtol=1e-4, atol=1e-3)
    for m in mods:
        m.dequant_cache = False               # decodes per call: nothing kept to serve densely
    assert dense_weight(layer, torch.float32) is None
    empty = nn.Module()
    empty.exl3 = nn.ModuleList()
    assert dense_weight(empty, torch.float32) is None


def test_head_is_exl3_from_files_or_quantization_config():
    from exl3rt.integrations.vllm.settings import head_is_exl3

    assert head_is_exl3("lm_head", {"lm_head", "model.layers.0.mlp.down_proj"}, {})
    assert not head_is_exl3("lm_head", {"model.layers.0.mlp.down_proj"}, {"head_bits": 6})  # the files win
    assert head_is_exl3("lm_head", None, {"head_bits": 6})
    assert not head_is_exl3("lm_head", None, {"head_bits": 16}) and not head_is_exl3("lm_head", None, {})


def test_vllm_layers_warm_each_kernel_key_once(monkeypatch):
    """The plugin's dense methods warm their layers' kernels at load (before vLLM's profile run and CUDA-graph
    capture): one ``kernels.prewarm`` per distinct (shape, K, codebook, dtype) in the process, none off CUDA."""
    from torch import nn
    from exl3rt.format.encoded import EncodedLinear
    from exl3rt.integrations.vllm.forward import warm_layer_kernels
    from exl3rt.kernels import linear as kl
    from exl3rt.runtime.linear import Exl3Linear

    def lin(in_f, out_f, k, seed):
        tr, suh, svh = _random_codes(-(-in_f // 128) * 128, -(-out_f // 128) * 128, k, seed)
        return Exl3Linear.from_encoded(EncodedLinear(trellis=tr, suh=suh, svh=svh, codebook="mcg",
                                                     in_features=in_f, out_features=out_f))
    qkv, o = nn.Module(), nn.Module()
    qkv.exl3 = nn.ModuleList([lin(256, 256, 3, 1), lin(256, 128, 3, 2), lin(256, 128, 3, 3)])
    o.exl3 = nn.ModuleList([lin(256, 256, 3, 4)])
    done: set = set()
    assert warm_layer_kernels(qkv, torch.bfloat16, done) == 0 and not done      # CPU: reference forward
    calls = []
    monkeypatch.setattr(Exl3Linear, "_on_kernel_device", lambda self: True)
    monkeypatch.setattr(kl, "prewarm", lambda shapes, **kw: calls.append((list(shapes), kw["dtype"])) or 3)
    assert warm_layer_kernels(qkv, torch.bfloat16, done) == 6                     # q (256x256), k = v (256x128)
    assert warm_layer_kernels(o, torch.bfloat16, done) == 0                       # o: the same key as q
    assert warm_layer_kernels(o, torch.float16, done) == 3
    assert calls == [([(256, 256, 3, "mcg")], torch.bfloat16), ([(256, 128, 3, "mcg")], torch.bfloat16),
                     ([(256, 256, 3, "mcg")], torch.float16)]


@pytest.mark.parametrize("bounds", [(0, 300, 160, 384), (128, 300, 0, 512), (64, 200, 200, 330), (0, 300, 0, 512)])
def test_block_cover_pieces_give_the_rank_its_block_of_the_product(bounds):
    """Any split (here rows/columns not on 128-blocks): the covering piece of the stored codes, fed the rank's
    input zero-padded into its column window, gives — in its row window — exactly x_r · W[c0:c1, r0:r1]
    (W the whole reconstruction, float64)."""
    from exl3rt.format.encoded import EncodedLinear
    from exl3rt.integrations.vllm.shards import ShardSpec, block_cover

    full_out, full_in = 300, 512
    r0, r1, c0, c1 = bounds
    trellis, suh, svh = _random_codes(full_in, 384, k=4, seed=sum(bounds))
    w = reconstruct(trellis, suh, svh, "mcg", dtype=torch.float64)[:, :full_out]      # [in, out]
    spec = ShardSpec("x", None, 0, r1 - r0, c1 - c0, full_out, full_in, 2, 1, bounds)
    cover, (o_lead, o_n), (i_lead, i_n) = block_cover(spec)
    check_block_aligned(cover, "x")
    assert (o_n, i_n) == (r1 - r0, c1 - c0) and o_lead < 128 and i_lead < 128
    enc = EncodedLinear(trellis=rank_piece("trellis", trellis, cover), suh=rank_piece("suh", suh, cover),
                        svh=rank_piece("svh", svh, cover), codebook="mcg", in_features=cover.in_features,
                        out_features=cover.out_features)
    x = torch.randn(3, c1 - c0, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xp = torch.nn.functional.pad(x, (i_lead, cover.in_features - i_lead - i_n))
    got = (xp @ enc.reconstruct(dtype=torch.float64))[:, o_lead: o_lead + o_n]
    torch.testing.assert_close(got, x @ w[c0:c1, r0:r1], rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", ["whole", "rank windows", "narrow shard"])
def test_a_layers_shards_run_as_one_fused_call(case, monkeypatch):
    """``fuse_layer`` (on CUDA in serving; the CPU path of the same op here): q/k/v-like shards of one K run as one
    ``fused_linear`` call whose columns (rank windows inside them) equal the float64 reconstruction and the unfused
    forward; with every shard whole and 128-aligned the op's output is returned as it is. Input windows (a
    row-parallel split) are not fused."""
    from torch import nn

    import exl3rt.integrations.vllm.forward as fwd
    from exl3rt.format.encoded import EncodedLinear
    from exl3rt.runtime.linear import Exl3Linear

    outs = {"whole": [256, 128, 128], "rank windows": [256, 128, 384], "narrow shard": [256, 100, 128]}[case]
    windows = [((0, 256), (0, 256)), ((16, 100), (0, 256)), ((128, 200), (0, 256))] if case == "rank windows" else None
    mods, want = [], []
    for j, o in enumerate(outs):
        trellis, suh, svh = _random_codes(256, -(-o // 128) * 128, k=3, seed=30 + j)
        enc = EncodedLinear(trellis=trellis, suh=suh, svh=svh, codebook="mcg", in_features=256, out_features=o,
                            name=f"s{j}")
        mods.append(Exl3Linear.from_encoded(enc, name=f"s{j}", dequant_cache=False))
        w = enc.reconstruct(dtype=torch.float64)[:, :o]
        if windows is not None:
            (ol, on), _ = windows[j]
            w = w[:, ol: ol + on]
        want.append(w)
    layer = nn.Module()
    layer.exl3 = nn.ModuleList(mods)
    if windows is not None:
        layer.exl3_windows = windows
    x = torch.randn(3, 256, dtype=torch.float64)
    unfused = fwd.exl3_apply(layer, x.float())
    calls = []
    real = fwd.call_fused_linear
    monkeypatch.setattr(fwd, "call_fused_linear", lambda *a: calls.append(1) or real(*a))
    assert fwd.fuse_layer(layer, devices=("cpu",)) and layer.exl3_group is not None
    bias = torch.arange(unfused.shape[-1], dtype=torch.float32)
    y = fwd.exl3_apply(layer, x.float(), bias)
    assert len(calls) == 1
    torch.testing.assert_close(y.double() - bias.double(), x @ torch.cat(want, dim=1), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(y - bias, unfused, rtol=1e-5, atol=1e-4)
    if case == "whole":
        assert fwd.exl3_apply(layer, x.float()).shape == (3, 512)
    row_parallel = nn.Module()
    row_parallel.exl3 = nn.ModuleList([Exl3Linear.from_encoded(EncodedLinear(*_random_codes(256, 128, k=3, seed=j),
                                                                             codebook="mcg", in_features=256,
                                                                             out_features=128)) for j in (1, 2)])
    row_parallel.exl3_windows = [((0, 128), (32, 200))] * 2
    assert not fwd.fuse_layer(row_parallel, devices=("cpu",))
