#!/usr/bin/env bash
# The vLLM GPU stages on the offline GPU machine, from the checkout root, the bundle carried in .vgpu (build.sh
# makes it here; the device call names .vgpu in carry). Logs go to $OUT (the device call's result folder).
#   bash benchmarks/vllm_gpu/device.sh install smoke e2e
# install: unpack vLLM into /tmp/vsite (skipped when a warm machine has it) and check two of its kernels;
# smoke:   a tiny Llama, BF16 and online EXL3, eager and torch.compile + CUDA graphs (benchmarks/vllm_gpu/smoke.py);
# e2e:     the vLLM end-to-end tests (tests/vllm_e2e) on the GPU.
set -uo pipefail
OUT=${OUT:-/tmp/vllm-gpu-out}; mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache} PYTHONUNBUFFERED=1
status=0
for stage in "$@"; do
  echo "== $stage $(date +%T)"
  case $stage in
    install)
      if [ ! -f /tmp/vsite/env.sh ]; then
        mkdir -p /tmp/vgparts && cp .vgpu/c*/* /tmp/vgparts/ && cp "$here"/install.sh /tmp/vgparts/ \
          && bash /tmp/vgparts/install.sh > "$OUT/install.log" 2>&1 || status=1
        tail -8 "$OUT/install.log"
      fi ;;
    smoke)
      . /tmp/vsite/env.sh
      python3 "$here"/smoke.py --runs "${SMOKE_RUNS:-exl3:eager,bf16:eager,exl3:compile,bf16:compile}" \
        --timeout "${SMOKE_TIMEOUT:-150}" > "$OUT/smoke.log" 2>&1 || status=1
      grep -v " INFO \|^INFO" "$OUT/smoke.log" | tail -60 ;;
    e2e)
      . /tmp/vsite/env.sh
      python3 -m pytest -q -x -p no:cacheprovider tests/vllm_e2e ${E2E_ARGS:-} > "$OUT/e2e.log" 2>&1 || status=1
      tail -30 "$OUT/e2e.log" ;;
    *) echo "unknown stage $stage (install, smoke, e2e)"; status=2 ;;
  esac
done
exit $status
