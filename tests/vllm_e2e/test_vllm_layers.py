"""Real vLLM linear layers with the plugin, tensor-parallel rank r of N simulated (no process group).

As the vllm-bnb/gguf plugin tests do: the TP getters that vLLM's layers and parameters call are
monkeypatched, then the layer's own weight loaders get the full checkpoint tensors. Truth: the full
matrix reconstructed by exl3rt.format.reconstruct, multiplied and sliced by hand.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

from exl3rt.format.codebooks import MARKERS  # noqa: E402
from exl3rt.format.reconstruct import reconstruct  # noqa: E402


def _patch_tp(monkeypatch, rank: int, size: int) -> None:
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter

    for mod in (linear, parameter):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: size)


def _codes(in_f: int, out_f: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-32768, 32767, (in_f // 16, out_f // 16, 16 * k), generator=g, dtype=torch.int32).to(torch.int16)
    suh = ((torch.rand(in_f, generator=g) + 0.5) * torch.sign(torch.randn(in_f, generator=g))).to(torch.float16)
    svh = (torch.rand(out_f, generator=g) + 0.5).to(torch.float16)
    return {"trellis": t, "suh": suh, "svh": svh, "mcg": torch.tensor(MARKERS["mcg"], dtype=torch.int32)}


def _config():
    from exl3rt.integrations.vllm import register
    from exl3rt.integrations.vllm.quant_config import Exl3VllmConfig

    register()
    cfg = Exl3VllmConfig({"quant_method": "exl3", "mode": "checkpoint"})
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    return cfg


def _x(n: int) -> torch.Tensor:
    return torch.randn(3, n, generator=torch.Generator().manual_seed(9)).to(torch.float32)


def _row_parallel(cfg, in_f: int, out_f: int, k: int, seed: int, prefix: str = "model.layers.0.mlp.down_proj"):
    """A real vLLM RowParallelLinear of this (simulated) rank with the plugin, loaded from random stored codes
    of the whole [in_f, out_f] matrix, weights processed; returns it and the stored tensors."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    layer = RowParallelLinear(in_f, out_f, bias=False, quant_config=cfg, prefix=prefix, params_dtype=torch.float32,
                              reduce_results=False)
    stored = _codes(in_f, out_f, k, seed)
    for part, t in stored.items():
        getattr(layer, part).weight_loader(getattr(layer, part), t)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, stored


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_rank_gets_its_input_blocks(monkeypatch, rank):
    _patch_tp(monkeypatch, rank, 2)
    layer, stored = _row_parallel(_config(), 512, 256, 4, 1)
    assert layer.exl3[0].bits == 4 and layer.exl3[0].in_features == 256
    x = _x(256)
    w = reconstruct(stored["trellis"], stored["suh"], stored["svh"], "mcg")  # [512, 256]
    want = x @ w[rank * 256:(rank + 1) * 256]  # this rank's partial sum
    torch.testing.assert_close(layer.quant_method.apply(layer, x), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_qkv_rank_slices_with_per_shard_bitrates_and_replicated_kv(monkeypatch, rank):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    _patch_tp(monkeypatch, rank, 4)
    # 4 q heads of 128 (one per rank), 2 kv heads of 128: each kv head is replicated on 2 ranks
    layer = QKVParallelLinear(256, head_size=128, total_num_heads=4, total_num_kv_heads=2, bias=False,
                              quant_config=_config(), prefix="model.layers.0.self_attn.qkv_proj",
                              params_dtype=torch.float32)
    stored = {"q": _codes(256, 512, 3, 2), "k": _codes(256, 256, 4, 3), "v": _codes(256, 256, 5, 4)}
    for sid, parts in stored.items():
        for part, t in parts.items():
            getattr(layer, part).weight_loader(getattr(layer, part), t, sid)
    layer.quant_method.process_weights_after_loading(layer)
    assert [m.bits for m in layer.exl3] == [3, 4, 5]
    assert [m.name for m in layer.exl3] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    x = _x(256)
    full = {s: reconstruct(p["trellis"], p["suh"], p["svh"], "mcg") for s, p in stored.items()}
    kv = rank // 2  # 4 ranks share 2 kv heads: replicas = 2
    want = torch.cat([x @ full["q"][:, rank * 128:(rank + 1) * 128], x @ full["k"][:, kv * 128:(kv + 1) * 128],
                      x @ full["v"][:, kv * 128:(kv + 1) * 128]], dim=-1)
    torch.testing.assert_close(layer.quant_method.apply(layer, x), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_splits_inside_128_blocks_serve_the_covering_blocks(monkeypatch, rank):
    """TP 2 over 384 (three 128-blocks) gives each rank 192: not a valid EXL3 piece. The rank holds the covering
    blocks: row-parallel (down_proj) zero-pads its 192 input columns into them and returns its partial sum
    x_r · W[192r : 192r + 192]; column-parallel (gate/up) keeps its 192 output rows of each shard."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    _patch_tp(monkeypatch, rank, 2)
    down, stored = _row_parallel(_config(), 384, 256, 4, 1)
    assert down.exl3[0].in_features == 256 and down.exl3_windows[0][1] == (64 * rank, 192)
    x = _x(192)
    w = reconstruct(stored["trellis"], stored["suh"], stored["svh"], "mcg")   # [384, 256]
    torch.testing.assert_close(down.quant_method.apply(down, x), x @ w[192 * rank: 192 * (rank + 1)],
                               rtol=1e-5, atol=1e-4)

    cfg = _config()
    cfg.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    gu = MergedColumnParallelLinear(256, [384, 384], bias=False, quant_config=cfg,
                                    prefix="model.layers.0.mlp.gate_up_proj", params_dtype=torch.float32)
    stored = {0: _codes(256, 384, 3, 2), 1: _codes(256, 384, 4, 3)}
    for sid, parts in stored.items():
        for part, t in parts.items():
            getattr(gu, part).weight_loader(getattr(gu, part), t, sid)
    gu.quant_method.process_weights_after_loading(gu)
    assert [m.out_features for m in gu.exl3] == [256, 256] and [m.bits for m in gu.exl3] == [3, 4]
    x = _x(256)
    full = [reconstruct(p["trellis"], p["suh"], p["svh"], "mcg") for p in stored.values()]
    want = torch.cat([x @ f[:, 192 * rank: 192 * (rank + 1)] for f in full], dim=-1)
    torch.testing.assert_close(gu.quant_method.apply(gu, x), want, rtol=1e-5, atol=1e-4)


# ---- pre-quantized MoE experts: the checkpoint fused-MoE method, TP rank r of N simulated -----------------------
def _moe(tp_size: int, tp_rank: int, *, experts: int = 3, hidden: int = 128, inter: int = 256):
    """The FusedMoEConfig fields the plugin's MoE methods read (a stand-in: no vLLM config context needed)."""
    from types import SimpleNamespace

    return SimpleNamespace(tp_size=tp_size, tp_rank=tp_rank, intermediate_size=inter, hidden_dim_unpadded=hidden,
                           activation="silu", experts_per_token=2, max_num_tokens=64, num_logical_experts=experts,
                           has_bias=False, use_ep=False)


def _stored_moe(experts: int, hidden: int, inter: int, ks) -> list[dict]:
    out = []
    for e in range(experts):
        out.append({"gate_proj": _codes(hidden, inter, ks[e], 10 * e + 1),
                    "up_proj": _codes(hidden, inter, ks[e], 10 * e + 2),
                    "down_proj": _codes(inter, hidden, ks[e], 10 * e + 3)})
    for ex in out:  # small scales: a tame activation range
        for p in ex.values():
            p["svh"] = p["svh"] / 16
    return out


def _checkpoint_moe_layer(cfg, moe, stored, prefix="model.layers.0.mlp.experts"):
    """A layer with the plugin's checkpoint MoE method, loaded as vLLM's RoutedExperts.load_weights does: each
    per-expert tensor to parameter ``w13_<field>`` (gate: shard w1, up: w3) or ``w2_<field>`` with its expert id."""
    from torch import nn
    from exl3rt.integrations.vllm.moe_method import Exl3CheckpointMoEMethod

    method = Exl3CheckpointMoEMethod(cfg, prefix, moe)
    layer = nn.Module()
    method.create_weights(layer, num_experts=len(stored), hidden_size=moe.hidden_dim_unpadded,
                          intermediate_size_per_partition=moe.intermediate_size // moe.tp_size,
                          params_dtype=torch.float32)
    shard = {"gate_proj": ("w13", "w1"), "up_proj": ("w13", "w3"), "down_proj": ("w2", "w2")}
    for e, ex in enumerate(stored):
        for p, fields in ex.items():
            group, sid = shard[p]
            for f, t in fields.items():
                param = getattr(layer, f"{group}_{f}")
                assert param.weight_loader(param=param, loaded_weight=t, weight_name=f"{prefix}.{group}_{f}",
                                           shard_id=sid, expert_id=e, return_success=True) is True
    method.process_weights_after_loading(layer)
    return method, layer


def _moe_truth(stored, x, ids, w, i0=None, i1=None) -> torch.Tensor:
    """Σ_k w · down(silu(gate x) · up x) in float64 from the full reconstructions; ``[i0, i1)``: a rank's columns."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    mats = [{p: reconstruct(f["trellis"], f["suh"], f["svh"], "mcg").double() for p, f in ex.items()} for ex in stored]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            m = mats[int(ids[t, k])]
            g, u, d = m["gate_proj"], m["up_proj"], m["down_proj"]
            if i0 is not None:
                g, u, d = g[:, i0:i1], u[:, i0:i1], d[i0:i1]
            xt = x[t].double()
            out[t] += float(w[t, k]) * ((torch.nn.functional.silu(xt @ g) * (xt @ u)) @ d)
    return out


@pytest.mark.parametrize("inter,ks", [(256, (3, 4, 2)), (384, (4, 3, 4))])
def test_checkpoint_moe_method_rank_slices_sum_to_the_whole_layer(inter, ks):
    """Experts stored per expert at their own K, TP 2. I = 256: each rank keeps its 128-column block of every
    expert. I = 384: 192 columns per rank, not a valid EXL3 piece: the rank holds the 256 covering columns
    (gate/up rows, down columns), down's scales of the columns it does not own zeroed. Either way each rank's
    partial sum is the float64 truth of its own columns and the ranks' sum (vLLM's all-reduce) is the layer."""
    stored = _stored_moe(3, 128, inter, ks)
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(6, 128, generator=g)
    ids = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(6)]).to(torch.int32)
    w = torch.softmax(torch.randn(6, 2, generator=g), -1)
    total = torch.zeros(6, 128, dtype=torch.float64)
    per = inter // 2
    for rank in range(2):
        cfg = _config()
        method, layer = _checkpoint_moe_layer(cfg, _moe(2, rank, inter=inter), stored)
        assert [[m.bits for m in d.values()] for d in layer.exl3_experts] == [[k] * 3 for k in ks]
        assert layer.exl3_moe.path.startswith("runtime ")
        assert cfg.summary()["layers"] == {"model.layers.0.mlp.experts": "checkpoint"}
        assert not hasattr(layer, "w13_trellis")  # placeholders dropped once the codes are in
        if inter == 384:
            assert layer.exl3_slice.cover == ((0, 256) if rank == 0 else (128, 384))
            assert {d["down_proj"].in_features for d in layer.exl3_experts} == {256}
        y = method.apply(layer, x, w, ids).double()
        torch.testing.assert_close(y, _moe_truth(stored, x, ids, w, per * rank, per * (rank + 1)), rtol=2e-4, atol=2e-4)
        total += y
    torch.testing.assert_close(total, _moe_truth(stored, x, ids, w), rtol=2e-4, atol=2e-4)


def test_checkpoint_moe_rank_sliced_tp_mismatch_is_a_clear_error():
    from types import SimpleNamespace

    from exl3rt.moe.rank_checkpoint import LayerMeta, RankCheckpointError, RankMetadata

    cfg = _config()
    cfg.rank_meta = RankMetadata(2, "per_expert", {"model.layers.0.mlp": LayerMeta(3, 128, 256, True, (4,) * 3,
                                                                                   ("mcg",) * 3)})
    layer = SimpleNamespace(moe_config=_moe(4, 0))
    with pytest.raises(RankCheckpointError, match=r"rank-sliced for tensor_parallel_size=2, vLLM runs "
                                                  r"tensor_parallel_size=4.*--tensor-parallel-size 2"):
        cfg._checkpoint_moe_method(layer, "model.layers.0.mlp.experts")
    # vLLM's weight stream drops every rank's tensors (the method reads its own rank's from disk)
    mapper = cfg.get_checkpoint_weight_mapper()
    assert mapper.apply_list(["model.layers.0.mlp.experts.2.down_proj.rank1.trellis"]) == []
    assert mapper.apply_list(["model.layers.0.mlp.experts.shared_h.up_proj.rank0.suh"]) == []
    kept = "model.layers.0.mlp.experts.2.down_proj.trellis"
    assert mapper.apply_list([kept]) == [kept]    # apply_list: public in every supported vLLM


# ---- a quantized lm_head: vLLM's ParallelLMHead (vocab-parallel, padded per partition) --------------------------
def _patch_tp_head(monkeypatch, rank: int, size: int) -> None:
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe

    _patch_tp(monkeypatch, rank, size)
    monkeypatch.setattr(vpe, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(vpe, "get_tensor_model_parallel_world_size", lambda: size)


def _head_config(stored: set):
    cfg = _config()
    cfg.stored = set(stored)
    return cfg


@pytest.mark.parametrize("vocab,tp_size,rank", [(100, 1, 0), (500, 2, 0), (500, 2, 1), (300, 2, 0), (300, 2, 1),
                                                (700, 4, 1), (700, 4, 3)])
def test_head_rank_gets_its_vocab_rows_and_zero_padding(monkeypatch, vocab, tp_size, rank):
    """vocab 100 at TP 1: EXL3 rows padded to 128, vLLM's partition 128 wide (28 padding rows); vocab 500 at
    TP 2: 256 rows per rank, rank 1 holds [256, 500) plus 12 padding rows; splits inside 128-row blocks
    (300 at TP 2: 160 rows per rank; 700 at TP 4: 176) serve the covering blocks and keep the rank's rows."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from exl3rt.integrations.vllm.checkpoint_method import Exl3CheckpointHeadMethod

    _patch_tp_head(monkeypatch, rank, tp_size)
    layer = ParallelLMHead(vocab, 256, quant_config=_head_config({"lm_head"}), prefix="lm_head",
                           params_dtype=torch.float32)
    assert isinstance(layer.quant_method, Exl3CheckpointHeadMethod)
    stored = _codes(256, -(-vocab // 128) * 128, 6, 5)
    for part, t in stored.items():
        getattr(layer, part).weight_loader(getattr(layer, part), t)
    layer.quant_method.process_weights_after_loading(layer)
    idx = layer.shard_indices
    start, end, width = idx.org_vocab_start_index, idx.org_vocab_end_index, layer.num_embeddings_per_partition
    (lead, rows), _ = layer.exl3_windows[0]
    assert layer.exl3[0].bits == 6 and rows == end - start and width >= end - start
    assert (start - lead) % 128 == 0 and layer.exl3[0].out_features >= end - start + lead
    x = _x(256)
    w = reconstruct(stored["trellis"], stored["suh"], stored["svh"], "mcg")[:, :vocab]  # [hidden, vocab]
    got = layer.quant_method.apply(layer, x, bias=None)
    assert got.shape == (3, width)
    torch.testing.assert_close(got[:, :end - start], x @ w[:, start:end], rtol=1e-5, atol=1e-4)
    assert torch.equal(got[:, end - start:], torch.zeros(3, width - (end - start)))  # as vLLM's zero-filled rows


def test_head_bf16_in_an_exl3_checkpoint(monkeypatch):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    _patch_tp_head(monkeypatch, 1, 2)  # vocab 300: padded 320, 160 rows per rank
    layer = ParallelLMHead(300, 256, quant_config=_head_config({"model.layers.0.mlp.down_proj"}), prefix="lm_head",
                           params_dtype=torch.float32)
    assert isinstance(layer.quant_method, UnquantizedEmbeddingMethod)  # a BF16 head in an EXL3 checkpoint


def test_hf_to_vllm_mapper_renames_the_stored_linears(monkeypatch):
    """A model that renames its modules from the checkpoint's (``hf_to_vllm_mapper``, as multimodal wrappers
    do: ``model.`` -> ``language_model.model.``) still finds its stored EXL3 linears; the mapping is applied
    to the checkpoint's own names each time (idempotent), and the layer computes the stored matrix."""
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.models.utils import WeightsMapper
    from exl3rt.integrations.vllm.checkpoint_method import Exl3CheckpointLinearMethod

    _patch_tp(monkeypatch, 0, 1)
    prefix = "language_model.model.layers.0.mlp.down_proj"
    cfg = _config()
    cfg.stored = {"model.layers.0.mlp.down_proj", "lm_head"}
    unmapped = RowParallelLinear(256, 128, bias=False, quant_config=cfg, prefix=prefix, params_dtype=torch.float32)
    assert isinstance(unmapped.quant_method, UnquantizedLinearMethod)    # the checkpoint names it differently
    mapper = WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."})
    for _ in range(2):
        cfg.apply_vllm_mapper(mapper)
        assert cfg.stored == {prefix, "lm_head"}
    assert cfg.hf_name(prefix) == "model.layers.0.mlp.down_proj" and cfg.hf_name("lm_head") == "lm_head"
    layer, stored = _row_parallel(cfg, 256, 128, 3, 4, prefix)
    assert isinstance(layer.quant_method, Exl3CheckpointLinearMethod)
    x = _x(256)
    w = reconstruct(stored["trellis"], stored["suh"], stored["svh"], "mcg")
    torch.testing.assert_close(layer.quant_method.apply(layer, x), x @ w, rtol=1e-5, atol=1e-4)
