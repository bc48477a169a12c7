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
            "exl3rt.integrations.vllm.slicing, exl3rt.integrations.vllm.settings; "
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
    full = reconstruct(trellis, suh, svh, "mcg")  # [in, out] = [256, 384]
    if split == "rows":  # column-parallel: rank 1 of 3 holds output rows [128, 256) of the HF [out, in]
        spec = column_shards(["x"], [None], [384], [128], [1], 256, 3, 1)[0]
        want = full[:, 128:256]
    else:  # row-parallel: rank 1 of 2 holds input columns [128, 256)
        spec = row_shard("x", 384, 256, 128, 2, 1)
        want = full[128:256, :]
    piece = reconstruct(rank_piece("trellis", trellis, spec), rank_piece("suh", suh, spec),
                        rank_piece("svh", svh, spec), "mcg")
    torch.testing.assert_close(piece, want, rtol=0, atol=0)


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
