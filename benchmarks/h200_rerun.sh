#!/usr/bin/env bash
# The closing rerun on the device machine after a kernel or runtime change, one stage per device call (each call
# may run 10 minutes; run them back to back while the machine is warm). Carry .whl (blake3 and gguf wheels for
# Python 3.12) and, for the golden tests, out/golden. Results land in $OUT.
#
#   STAGE=tests  the GPU tests of the gated MLP, the launch plans, the fusion and the custom ops (~3 minutes)
#   STAGE=kernels the GPU tests of the kernels and the MoE launches, file by file (each compiles many
#                specializations: together they take more than one call, so FILES= picks some)
#   STAGE=linear bench_linear.py's grid at K 2/4/6 (three layers, rows 1/4/16/64/256/2048) and bench_moe.py
#   STAGE=model  bench_model.py: the 8B-shaped model's graph, compiled and decode rows at K2/K4, then eager
#                interleaved with BF16 (host-sensitive: read the ratios, not the milliseconds)
#   STAGE=host   bench_host.py: the host's time per part of an eager one-token forward, BF16 beside EXL3
#   STAGE=tp     (nvidia-h200-x2) check_tp_layers.py and check_moe_tp_nccl.py over NCCL on two GPUs
#   STAGE=vllm   the plugin in vLLM's CUDA build: install, smoke, the e2e suite (benchmarks/vllm_gpu/device.sh; carry
#                .vgpu, the bundle benchmarks/vllm_gpu/build.sh makes, instead of .whl; the first call of a fresh
#                machine fits install and smoke, a second the e2e suite)
set -euo pipefail
export PYTHONUNBUFFERED=1
if [ "${STAGE:-}" = vllm ]; then        # its own environment (vLLM's bundle), not the wheels below
    EXL3RT_GOLDEN_DIR=$PWD/out/golden exec bash benchmarks/vllm_gpu/device.sh install smoke e2e
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
export EXL3RT_GOLDEN_DIR=$PWD/out/golden
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L
case "${STAGE:?set STAGE to tests, kernels, linear, model, host, tp or vllm}" in
tests)
    python3 -m pytest -q --noconftest -x tests/test_gated_mlp.py tests/test_launch_plans.py tests/test_fusion.py \
        tests/test_custom_ops.py 2>&1 | tail -8 | tee "$OUT/tests.txt" ;;
kernels)
    for f in ${FILES:-test_lane_decode test_moe_kernel test_moe_wgmma test_wgmma test_kernels}; do
        echo "== $f"; timeout 280 python3 -m pytest -q --noconftest -x "tests/$f.py" 2>&1 | tail -3 | tee -a "$OUT/tests.txt"
    done ;;
linear)
    python3 benchmarks/bench_linear.py --bits 2 4 6 --iters 100 --out "$OUT/linear_cuda.json" 2>&1 | tail -45
    python3 benchmarks/bench_moe.py --inter 2048 --rows 1 8 32 512 --out "$OUT/moe_cuda.json" 2>&1 | tail -12 ;;
model)
    python3 benchmarks/bench_model.py --bits 2 4 --modes graph compiled --prefill 0 --iters 30 2>&1 | tail -20
    python3 benchmarks/bench_model.py --bits 4 --interleave --rounds 6 --decode 0 --prefill 0 2>&1 | tail -12
    cp benchmarks/results/model_llama8b*.json "$OUT/" ;;
host)
    python3 benchmarks/bench_host.py --cprofile --json "$OUT/host_llama8b.json" 2>&1 | grep -v Warning | tail -100 ;;
tp)
    python3 benchmarks/check_tp_layers.py --json "$OUT/tp_layers.json" 2>&1 | tail -12
    python3 benchmarks/check_moe_tp_nccl.py --json "$OUT/moe_tp_nccl.json" 2>&1 | tail -6 ;;
*)
    echo "unknown STAGE=$STAGE" >&2; exit 2 ;;
esac
