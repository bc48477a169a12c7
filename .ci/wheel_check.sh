#!/usr/bin/env bash
# CI step: what `pip install exl3rt` gives a new user on a CPU machine. The wheel is built from this checkout and
# installed into a clean virtual environment (torch's CPU build first, as the README says; nothing else beforehand),
# which then writes a checkpoint, encodes a tiny model and inspects both.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python3 -m venv "$WORK/build"
"$WORK/build/bin/pip" install --quiet --upgrade pip build
"$WORK/build/bin/python" -m build --wheel --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
python3 -m venv "$WORK/venv"
PIP="$WORK/venv/bin/pip"
"$PIP" install --quiet --upgrade pip
"$PIP" install --quiet torch==2.13.0            # the CPU build (local disk); the wheel's range then adds nothing
"$PIP" install --quiet "$WORK"/dist/exl3rt-*.whl
X="$WORK/venv/bin/exl3rt"
cd "$WORK"
# the documentation the README links to is installed beside it, and --help says where
"$X" --help > help.txt
grep -q "documentation: $WORK/venv/share/doc/exl3rt/README.md" help.txt || { tail -3 help.txt; exit 1; }
test -f "$WORK/venv/share/doc/exl3rt/docs/kernels.md"
"$X" example ex --seed 1
"$X" inspect ex
# a tiny Llama-shaped model written with safetensors alone (no transformers in this environment)
"$WORK/venv/bin/python" - <<'PY'
import json, os
import torch
from safetensors.torch import save_file
os.makedirs("tiny", exist_ok=True)
h, i, v, layers = 128, 256, 64, 2
cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=h, intermediate_size=i,
           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, vocab_size=v,
           tie_word_embeddings=False, torch_dtype="bfloat16")
json.dump(cfg, open("tiny/config.json", "w"))
g = torch.Generator().manual_seed(0)
t = {"model.embed_tokens.weight": torch.randn(v, h, generator=g), "lm_head.weight": torch.randn(v, h, generator=g),
     "model.norm.weight": torch.ones(h)}
for n in range(layers):
    p = f"model.layers.{n}."
    for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h // 2, h)), ("self_attn.v_proj", (h // 2, h)),
                        ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                        ("mlp.down_proj", (h, i))):
        t[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.05
    t[p + "input_layernorm.weight"] = torch.ones(h)
    t[p + "post_attention_layernorm.weight"] = torch.ones(h)
save_file({k: x.to(torch.bfloat16).contiguous() for k, x in t.items()}, "tiny/model.safetensors")
PY
EXL3RT_CACHE_DIR="$WORK/cache" "$X" quantize tiny tiny-exl3 --bits 3
"$X" inspect tiny-exl3
echo "wheel check: passed"
