"""A float64 transformers model rebuilt from an EXL3 checkpoint: every stored linear (experts included) is
``format.reconstruct`` of its codes, every other tensor as stored. The truth that loaders are held to."""

from __future__ import annotations

import re

import torch

from exl3rt.format import Exl3Checkpoint

_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def float64_model(path):
    """The float64 model of the checkpoint at ``path`` and its :class:`Exl3Checkpoint`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = Exl3Checkpoint(path)
    cfg = AutoConfig.from_pretrained(str(path))
    del cfg.quantization_config
    # the grouped-matmul experts have no float64 kernel; the per-expert loop does
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").to(torch.float64).eval()
    params = dict(model.named_parameters())
    for name in ckpt.other_tensor_names():
        params[name].data.copy_(ckpt.tensor(name).to(torch.float64))
    for info in ckpt.linears():
        enc = ckpt.load_linear(info.name)
        m = _EXPERT.match(info.name)
        if m is not None and m["experts"] + ".gate_up_proj" in params:
            # transformers fuses a layer's experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
            e, proj, experts = int(m["e"]), m["proj"], m["experts"]
            if proj == "down_proj":
                target = params[experts + ".down_proj"].data[e]
            else:
                fused = params[experts + ".gate_up_proj"].data[e]
                half = fused.shape[0] // 2
                target = fused[:half] if proj == "gate_proj" else fused[half:]
            in_f, out_f = target.shape[1], target.shape[0]
            target.copy_(enc.reconstruct(trim=False).to(torch.float64)[:in_f, :out_f].T)
            assert enc.bias is None, f"{info.name}: expert biases are not rebuilt here"
            continue
        lin = model.get_submodule(info.name)
        w = enc.reconstruct(trim=False).to(torch.float64)[: lin.in_features, : lin.out_features]
        lin.weight.data.copy_(w.T)
        if enc.bias is not None:
            lin.bias.data.copy_(enc.bias[: lin.out_features].to(torch.float64))
    return model, ckpt


def rel_logits_error(model, path, ids) -> float:
    """‖logits(model) − logits(float64 checkpoint model)‖ / ‖·‖ on token rows ``ids``."""
    reference, _ = float64_model(path)
    with torch.no_grad():
        want = reference(ids).logits
        got = model(ids).logits.to(torch.float64)
    return float((got - want).norm() / want.norm())
