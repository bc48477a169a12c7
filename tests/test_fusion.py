"""Fused sibling linears (``exl3rt.runtime.fusion``, ``torch.ops.exl3rt.fused_linear``): each member gives its own
layer's output, one fused call per group and forward (eager and under torch.compile), and the model's names,
state_dict and export are those of the unfused layers."""

import pytest
import torch

from exl3rt.format.random import random_linear
from exl3rt.kernels import ops
from exl3rt.runtime import Exl3Linear, fuse_linears, unfuse_linears
from exl3rt.runtime.fusion import gated_shapes, is_gated
from exl3rt.runtime.surgery import replace_module

pytest.importorskip("transformers")


def fused_args(in_f, widths, bits, dtype, lead=(3,), seed=0):
    encs = [random_linear(in_f, w, bits, seed=seed + i) for i, w in enumerate(widths)]
    x = torch.randn(*lead, in_f, generator=torch.Generator().manual_seed(seed)).to(dtype)
    trellis = torch.cat([e.trellis for e in encs], dim=1)
    suh = torch.stack([e.suh for e in encs])
    svh = torch.cat([e.svh for e in encs])
    starts = [sum(e.svh.numel() for e in encs[:i]) for i in range(len(encs))]
    return encs, starts, (x, trellis, suh, svh, encs[0].codebook, starts[1:])


@pytest.mark.parametrize("in_f,widths,bits,dtype,lead", [
    (128, (256, 128, 128), 4, torch.float32, (3,)),
    (200, (130, 72), 3, torch.float32, (2, 5)),
    (128, (128, 128), 2, torch.bfloat16, (1,)),
])
def test_fused_linear_op_passes_opcheck_and_gives_each_layer_its_product(in_f, widths, bits, dtype, lead):
    encs, starts, args = fused_args(in_f, widths, bits, dtype, lead)
    torch.library.opcheck(torch.ops.exl3rt.fused_linear.default, args)
    y = torch.ops.exl3rt.fused_linear(*args)
    assert y.shape == (*lead, sum(e.svh.numel() for e in encs)) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for e, a, w in zip(encs, starts, widths):
        ref = args[0].double() @ e.reconstruct(dtype=torch.float64)[:in_f, :w]
        assert float((y[..., a:a + w].double() - ref).norm() / ref.norm()) < tol


def random_llama(layers=2, k_bits=4, seed=0):
    """A tiny Llama whose decoder linears are random EXL3 layers (k_proj at ``k_bits``, the rest at K4); attention
    with biases."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=200, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, initializer_range=0.5,
                      attention_bias=True)
    model = LlamaForCausalLM(cfg).eval()
    for i, (name, lin) in enumerate([(n, m) for n, m in model.named_modules()
                                     if isinstance(m, torch.nn.Linear) and "layers" in n]):
        bits = k_bits if name.endswith("k_proj") else 4
        enc = random_linear(lin.in_features, lin.out_features, bits, seed=i)
        bias = torch.randn(lin.out_features) if lin.bias is not None else None
        replace_module(model, name, Exl3Linear.from_encoded(enc, bias, name=name, dequant_cache=False))
    return model


def count_calls(monkeypatch, name="fused_linear_impl"):
    """A list that grows by one per call of ``exl3rt.kernels.ops.<name>`` (an op's implementation)."""
    calls = []
    real = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a: calls.append(1) or real(*a))
    return calls


def test_fused_members_give_the_unfused_logits_with_one_call_per_group(monkeypatch):
    model = random_llama()
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    assert fuse_linears(model, devices=("cpu",)) == 4          # q/k/v and gate/up in each of 2 layers
    q = model.model.layers[0].self_attn.q_proj
    assert q._fused is not None and not q.trellis.is_contiguous()
    calls = count_calls(monkeypatch)
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
    assert len(calls) == 4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the model still reads and writes as the unfused one: same names, same values, same codes exported
    fused_sd = model.state_dict()
    assert list(fused_sd) == list(sd) and all(torch.equal(fused_sd[k], sd[k]) for k in sd)
    assert torch.equal(q.encoded().trellis, sd["model.layers.0.self_attn.q_proj.trellis"])
    assert q.encoded().trellis.is_contiguous()
    # a member called alone, on its own input, gives its own product
    x = torch.randn(2, 128)
    k = model.model.layers[1].self_attn.k_proj
    ref = x.double() @ k.encoded().reconstruct(dtype=torch.float64)[:128, :k.out_features] + k.bias.double()
    torch.testing.assert_close(k(x).double(), ref, rtol=1e-5, atol=1e-5)
    # a state_dict load writes through the views into the fused codes
    sd2 = {n: (v.flip(0) if n.endswith("k_proj.trellis") else v) for n, v in sd.items()}
    model.load_state_dict(sd2)
    with torch.no_grad():
        changed = model(ids, use_cache=False).logits
    assert not torch.allclose(changed, want)
    model.load_state_dict(sd)
    assert unfuse_linears(model) == 4 and q._fused is None and q.trellis.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
    # a biased member whose buffer is replaced behind the group's back leaves it, bias added once
    fuse_linears(model, devices=("cpu",))
    v = model.model.layers[0].self_attn.v_proj
    v.svh = v.svh.clone()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
    assert v._fused is None and q._fused is None


def test_siblings_of_different_k_stay_unfused_and_moves_dissolve_groups():
    model = random_llama(k_bits=3)
    assert fuse_linears(model, devices=("cpu",)) == 2            # gate/up only: k_proj has another K
    assert model.model.layers[0].self_attn.q_proj._fused is None
    assert fuse_linears(model) == 0                              # nothing on CUDA here
    mlp = model.model.layers[0].mlp
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    model.to(torch.float64).to(torch.float32)                  # a move: each member gets its own buffers back
    assert mlp.gate_proj._fused is None and mlp.up_proj.trellis.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
    # a buffer replaced behind the group's back: that member leaves the group and still gives its own product
    fuse_linears(model, devices=("cpu",))
    up = mlp.up_proj
    up.trellis = up.trellis.clone()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
    assert up._fused is None


def test_gated_mlps_run_as_one_call_and_stay_apart_where_they_cannot(monkeypatch):
    """A Llama MLP whose gate/up are fused runs as one ``exl3rt::gated_mlp`` call (the unfused logits, one call per
    layer); unfusing gives it its own forward back; a hooked member or another activation keeps an MLP apart; a
    group that ends (a buffer replaced) sends the MLP back to its own forward, still right."""
    model = random_llama()
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    fuse_linears(model, devices=("cpu",))
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(is_gated(m) for m in mlps)
    g = mlps[0].gate_proj
    assert gated_shapes(model) == [((128, 256, 128, 4.0, "mcg", 4.0, "mcg"), g.trellis.device)]
    calls = count_calls(monkeypatch, "gated_mlp_impl")
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
    assert len(calls) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unfuse_linears(model)
    assert not any(is_gated(m) for m in mlps) and "forward" not in mlps[0].__dict__
    hook = mlps[0].down_proj.register_forward_hook(lambda *a: None)
    mlps[1].act_fn = torch.nn.GELU()
    fuse_linears(model, devices=("cpu",))
    assert not is_gated(mlps[0]) and not is_gated(mlps[1]) and mlps[1].gate_proj._fused is not None
    hook.remove()
    mlps[1].act_fn = torch.nn.SiLU()
    unfuse_linears(model)
    fuse_linears(model, devices=("cpu",))
    assert all(is_gated(m) for m in mlps)
    mlps[1].up_proj.svh = mlps[1].up_proj.svh.clone()     # behind the group's back
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1 and mlps[1].gate_proj._fused is None
    # a layer replaced by its dense equivalent (plain nn.Linear): that MLP runs its own forward, still right
    for name in ("gate_proj", "up_proj", "down_proj"):
        unfuse_linears(model)
        fuse_linears(model, devices=("cpu",))
        assert all(is_gated(m) for m in mlps)
        old = getattr(mlps[0], name)
        dense = torch.nn.Linear(old.in_features, old.out_features, bias=False)
        with torch.no_grad():
            dense.weight.copy_(old.dequantized_weight(torch.float32).t())
        setattr(mlps[0], name, dense)
        calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
        assert len(calls) == 1, name       # the other layer's MLP only
        # prewarm's shapes come from the MLPs whose layers are still EXL3 (the other layer's)
        assert gated_shapes(model) == [((128, 256, 128, 4.0, "mcg", 4.0, "mcg"), old.trellis.device)]
        setattr(mlps[0], name, old)


def test_a_fused_model_compiles_fullgraph_with_one_fused_op_per_group(monkeypatch):
    model = random_llama()
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    fuse_linears(model, devices=("cpu",))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        compiled(ids, use_cache=False)
        calls = count_calls(monkeypatch)
        gated = count_calls(monkeypatch, "gated_mlp_impl")
        got = compiled(ids, use_cache=False).logits
    assert len(calls) == 4 and len(gated) == 2       # q/k/v fused, and each MLP one gated call (its gate/up inside)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels run on a GPU")
def test_on_a_gpu_fused_groups_give_the_unfused_logits_eager_and_compiled():
    model = random_llama().cuda().half()
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]], device="cuda")
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.float()
        assert fuse_linears(model) == 4 and all(is_gated(layer.mlp) for layer in model.model.layers)
        got = model(ids, use_cache=False).logits.float()
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            comp = compiled(ids, use_cache=False).logits.float()
    for y in (got, comp):
        assert float((y - want).norm() / want.norm()) < 1e-2
