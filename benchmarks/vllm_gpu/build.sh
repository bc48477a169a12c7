#!/bin/bash
# Build a carry-able vLLM 0.26.0 bundle (CUDA 13, torch 2.11, stripped for sm_90) plus the Python 3.12 wheels the
# GPU machine lacks, as four xz chunks of ~13 MiB in $OUT_DIR/c1..c4 (default ./.vgpu; add it to .git/info/exclude).
# Run on a machine with pip access. PRUNE=0 keeps every GPU arch in the .so files (_C alone then ~53 MiB xz).
#   bash benchmarks/vllm_gpu/build.sh         -> .vgpu/c1 .. c4 (c4: vLLM's MoE ops, needed for BF16 MoE baselines)
# On the GPU machine (checkout root; .vgpu carried): bash benchmarks/vllm_gpu/device.sh install smoke
# (docs/vllm.md, "Testing on an offline GPU machine").
set -euo pipefail
H=$(cd "$(dirname "$0")" && pwd)
O=$(mkdir -p "${OUT_DIR:-$PWD/.vgpu}" && cd "${OUT_DIR:-$PWD/.vgpu}" && pwd)
W=${WORK:-/tmp/vgpu-build}; DEPS=${DEPS:-$W/whl312}; mkdir -p "$W" "$DEPS"
PLAT="--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
DL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT"
WHL=${WHL:-$(ls "$W"/vllm-0.26.0-*.whl 2>/dev/null | head -1 || true)}   # (none yet: downloaded below)
[ -n "$WHL" ] || { $DL -d "$W" vllm==0.26.0; WHL=$(ls "$W"/vllm-0.26.0-*.whl | head -1); }
for f in $(cat "$H/wheels.txt") typing_extensions-4.16.0-py3-none-any.whl; do
  [ -f "$DEPS/$f" ] && continue
  n=$(echo "$f" | cut -d- -f1); v=$(echo "$f" | cut -d- -f2); $DL -d "$DEPS" "$n==$v"
done
rm -rf "$W/full" "$W/stage" && mkdir -p "$W/full" "$W/stage"
(cd "$W/full" && python3 -m zipfile -e "$WHL" .)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/stage" --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --only-binary=:all: $PLAT $(sed "s#^#$DEPS/#" "$H/wheels.txt")
rm -rf "$W/stage/bin"
(cd "$W/full" && tar cf - --exclude __pycache__ --exclude ./vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so --exclude ./vllm/vllm-rs \
  --exclude './vllm/third_party/deep_gemm/_C.cpython-31[0134]-*' --exclude ./vllm/third_party/deep_gemm/include \
  --exclude ./vllm/third_party/fmha_sm100/cutlass --exclude ./vllm/third_party/fmha_sm100/csrc .) | tar xf - -C "$W/stage"
if [ "${PRUNE:-1}" = 1 ]; then
  for f in _C_stable_libtorch _moe_C_stable_libtorch _qutlass_C _flashmla_C _flashmla_extension_C; do
    python3 "$H/prune.py" "$W/stage/vllm/$f.abi3.so" "$W/p.so" && cat "$W/p.so" > "$W/stage/vllm/$f.abi3.so"; done
fi
cd "$W/stage"
tar cf - --sort=name --owner=0 --group=0 --numeric-owner --exclude ./vllm/_moe_C_stable_libtorch.abi3.so . | nice -n 19 xz -9e -T1 > "$W/core.tar.xz"
tar cf - --owner=0 --group=0 --numeric-owner ./vllm/_moe_C_stable_libtorch.abi3.so | nice -n 19 xz -9e -T1 > "$W/moe.tar.xz"
cd "$W" && rm -f core.tar.xz.part-* && split -n 3 core.tar.xz core.tar.xz.part- && cp moe.tar.xz moe.tar.xz.part-aa
rm -rf "$O"/c1 "$O"/c2 "$O"/c3 "$O"/c4 && mkdir -p "$O"/c1 "$O"/c2 "$O"/c3 "$O"/c4
(sha256sum core.tar.xz moe.tar.xz; sha256sum core.tar.xz.part-* moe.tar.xz.part-aa) > "$O/c1/SHA256SUMS"
cp core.tar.xz.part-aa "$O/c1/"; cp core.tar.xz.part-ab "$O/c2/"; cp core.tar.xz.part-ac "$O/c3/"; cp moe.tar.xz.part-aa "$O/c4/"
cp "$DEPS"/typing_extensions-4.16.0-py3-none-any.whl "$H/install.sh" "$H/smoke.py" "$O/c1/"
du -b "$O"/c?/ | awk '{printf "%s %.2f MiB\n", $2, $1/2^20}'
