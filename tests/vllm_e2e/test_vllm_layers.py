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
    from exl3rt.integrations.vllm.config import Exl3VllmConfig

    register()
    cfg = Exl3VllmConfig({"quant_method": "exl3", "mode": "checkpoint"})
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    return cfg


def _x(n: int) -> torch.Tensor:
    return torch.randn(3, n, generator=torch.Generator().manual_seed(9)).to(torch.float32)


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_rank_gets_its_input_blocks(monkeypatch, rank):
    from vllm.model_executor.layers.linear import RowParallelLinear

    _patch_tp(monkeypatch, rank, 2)
    layer = RowParallelLinear(512, 256, bias=False, quant_config=_config(), prefix="model.layers.0.mlp.down_proj",
                              params_dtype=torch.float32, reduce_results=False)
    stored = _codes(512, 256, 4, 1)
    for part, t in stored.items():
        getattr(layer, part).weight_loader(getattr(layer, part), t)
    layer.quant_method.process_weights_after_loading(layer)
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


def test_unaligned_tp_split_is_a_clear_error(monkeypatch):
    from vllm.model_executor.layers.linear import RowParallelLinear
    from exl3rt.integrations.vllm.shards import ShardError

    _patch_tp(monkeypatch, 1, 2)
    with pytest.raises(ShardError, match=r"down_proj.*\[192, 384\).*multiples of 128"):
        RowParallelLinear(384, 256, bias=False, quant_config=_config(), prefix="model.layers.0.mlp.down_proj",
                          params_dtype=torch.float32, reduce_results=False)
