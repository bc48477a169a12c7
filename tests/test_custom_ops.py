"""The custom ops (torch.ops.exl3rt.linear / moe): opcheck, float64 truth, and whole tiny models under
torch.compile(fullgraph=True) on the CPU giving the eager model's greedy tokens without decoding in the graph."""

import pytest
import torch

from exl3rt.format.random import random_linear
from exl3rt.kernels import ops
from exl3rt.moe import op as moe_op

pytest.importorskip("transformers")

from tiny_models import tiny_llama, tiny_qwen_moe  # noqa: E402


def linear_args(in_f, out_f, bits, dtype, lead=(3,), weight=False, seed=0):
    enc = random_linear(in_f, out_f, bits, seed=seed)
    x = torch.randn(*lead, in_f, generator=torch.Generator().manual_seed(seed)).to(dtype)
    w = enc.reconstruct(dtype=torch.float32)[:in_f, :out_f].to(dtype).contiguous() if weight else None
    return enc, (x, enc.trellis, enc.suh, enc.svh, w, enc.codebook, out_f)


@pytest.mark.parametrize("in_f,out_f,bits,dtype,lead,weight", [
    (128, 256, 4, torch.float32, (3,), False),
    (200, 72, 3, torch.float32, (2, 5), True),
    (128, 128, 2, torch.bfloat16, (1,), True),
    (136, 130, 6, torch.float16, (4,), False),
])
def test_linear_op_passes_opcheck_and_matches_float64(in_f, out_f, bits, dtype, lead, weight):
    enc, args = linear_args(in_f, out_f, bits, dtype, lead, weight)
    torch.library.opcheck(torch.ops.exl3rt.linear.default, args)
    y = torch.ops.exl3rt.linear(*args)
    assert y.shape == (*lead, out_f) and y.dtype == dtype
    ref = args[0].double() @ enc.reconstruct(dtype=torch.float64)[:in_f, :out_f]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert float((y.double() - ref).norm() / ref.norm()) < tol


class SumOfExperts:
    """A stand-in MoE layer: expert e scales x by (e + 1); the op must return exactly what it computes."""

    def moe_forward(self, x, ids, w):
        return (x[:, None, :] * (ids.to(x.dtype)[..., None] + 1) * w[..., None]).sum(1)


def test_moe_op_passes_opcheck_and_calls_its_layer():
    layer = SumOfExperts()
    handle = moe_op.register(layer)
    x = torch.randn(5, 16)
    ids = torch.randint(0, 4, (5, 2))
    w = torch.rand(5, 2)
    torch.library.opcheck(torch.ops.exl3rt.moe.default, (x, ids, w, handle))
    want = sum(x * (ids[:, j, None].float() + 1) * w[:, j, None] for j in range(2))
    torch.testing.assert_close(torch.ops.exl3rt.moe(x, ids, w, handle), want)
    del layer
    with pytest.raises(RuntimeError, match="no live MoE layer"):
        torch.ops.exl3rt.moe(x, ids, w, handle)


# ---- whole models under torch.compile ---------------------------------------------------------------------

def greedy(model, ids, steps):
    for _ in range(steps):
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


def quantized(src, cache, **kwargs):
    import exl3rt
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    exl3rt.quantize_model(model, exl3rt.Exl3Config(bits=4, cache_dir=str(cache), progress=False, **kwargs),
                          progress=False)
    return model


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_tiny_model_compiles_fullgraph_and_gives_the_eager_tokens(kind, tmp_path, monkeypatch):
    import exl3rt

    if kind == "dense":
        src = tiny_llama(tmp_path / "m", init_std=0.5)
    else:
        src = tiny_qwen_moe(tmp_path / "m", init_std=0.5)
    model = quantized(src, tmp_path / "cache")
    if kind == "moe":
        assert any(type(m).__name__ == "Exl3MoE" for m in model.modules())
    prompt = torch.tensor([[1, 5, 9, 12, 3, 7, 21, 30]])
    want = greedy(model, prompt, 4)
    assert len(set(want[0, prompt.shape[1]:].tolist())) >= 2, "a degenerate continuation checks little"

    for m in model.modules():
        if isinstance(m, exl3rt.Exl3Linear):
            m.clear_dequant_cache()
            m.prepare(torch.float32)
    decodes = []
    real = ops.reconstruct
    monkeypatch.setattr(ops, "reconstruct", lambda *a, **k: decodes.append(1) or real(*a, **k))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    got = greedy(compiled, prompt, 4)
    assert torch.equal(got, want)
    assert decodes == []          # prepared: the compiled model multiplies by the kept weights
