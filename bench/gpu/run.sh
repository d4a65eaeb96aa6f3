#!/usr/bin/env bash
# The GPU check of refit, on the device machine (one H200): builds the standalone GPU targets
# (bench/gpu/CMakeLists.txt: no gloo/zmq/yaml-cpp needed), runs the CUDA unit tests, the
# zero-copy / bucketed-IPC benchmark and the PyTorch baseline on the same shapes, and prints one
# table last. Logs and JSON go to $OUT (or the first argument).
#
#   bench/gpu/prepare_deps.sh                        # here, once: fills .carry/deps
#   run(command="bash bench/gpu/run.sh", carry=[".carry/deps"])
#
# Environment: REFIT_DEPS_DIR (default .carry/deps), REFIT_GPU_BUILD (default build-gpu),
# REFIT_BENCH_STEPS (5), REFIT_BENCH_SHAPES ("qwen3-8b:float32 qwen3-30b-a3b:bfloat16"),
# REFIT_SKIP_TORCH=1 to skip the baseline, REFIT_SKIP_TESTS=1 to skip the unit tests,
# REFIT_BENCH_BULK=0 to leave the bulk-copy-engine kernel variant out of the benchmark.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=$PATH:/usr/local/cuda/bin
  export CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
fi
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-${OUT:-/tmp/refit-gpu}}
work=$(mktemp -d)  # per-shape JSON (the device returns at most 8 files from $OUT)
mkdir -p "$out"
deps=${REFIT_DEPS_DIR:-$root/.carry/deps}
build=${REFIT_GPU_BUILD:-$root/build-gpu}
steps=${REFIT_BENCH_STEPS:-5}
shapes=${REFIT_BENCH_SHAPES:-"qwen3-8b:float32 qwen3-30b-a3b:bfloat16"}
cd "$root"

{ nvidia-smi; nvcc --version; cmake --version; python3 -c 'import torch; print("torch", torch.__version__)'; } \
  > "$out/machine.txt" 2>&1

echo "== build ($(nproc) cores)"
start=$(date +%s)
if ! { cmake -S bench/gpu -B "$build" -G Ninja -DREFIT_DEPS_DIR="$deps" -DCMAKE_POLICY_VERSION_MINIMUM=3.5 &&
       ninja -C "$build" refit_gpu_tests zero_copy_bench; } > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  echo "build failed (full log: build.log)"
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s"

status=0
# The copy kernels' variants first, on a short leash: a variant that fails (or hangs) its
# bit-exactness tests is left out of the benchmark instead of sinking the run.
if ! timeout 90 "$build/refit_gpu_tests" --gtest_filter='CudaKernels.FlatConvert*:CudaKernels.BlockCopy*' \
     > "$out/tests.log" 2>&1; then
  echo "copy kernel variants failed their tests: benchmarking without the bulk engine"
  grep -A8 'Failure' "$out/tests.log" | head -30
  export REFIT_BENCH_BULK=0
  status=1
fi
if [ "${REFIT_SKIP_TESTS:-0}" != 1 ]; then
  echo "== CUDA unit tests"
  # NCCL separately, with a short leash: a wedged NCCL abort must not eat the whole run.
  timeout 150 "$build/refit_gpu_tests" \
    --gtest_filter='-CudaNccl.*:CudaKernels.FlatConvert*:CudaKernels.BlockCopy*' >> "$out/tests.log" 2>&1
  rc1=$?
  timeout 120 "$build/refit_gpu_tests" --gtest_filter='CudaNccl.*' >> "$out/tests.log" 2>&1
  rc2=$?
  grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \]|tests from .* ran' "$out/tests.log"
  if [ $rc1 -ne 0 ] || [ $rc2 -ne 0 ]; then
    echo "unit tests failed (rc $rc1/$rc2):"
    grep -B2 -A12 'Failure\|FAILED \]' "$out/tests.log" | head -60
    status=1
  fi
fi

bench_json=()
torch_json=()
for shape in $shapes; do
  model=${shape%%:*}
  dtype=${shape##*:}
  echo "== bench $model ($dtype trainer)"
  timeout 300 "$build/zero_copy_bench" --model "$model" --trainer-dtype "$dtype" --steps "$steps" \
    --json "$work/bench-$model.json" >> "$out/bench.log" 2>&1
  rc=$?
  tail -3 "$out/bench.log"
  [ $rc -eq 0 ] && bench_json+=("$work/bench-$model.json") || { echo "bench failed (rc $rc)"; status=1; }
  if [ "${REFIT_SKIP_TORCH:-0}" != 1 ]; then
    echo "== torch baseline $model"
    "$build/zero_copy_bench" --model "$model" --dump-layout "/tmp/layout-$model.json" &&
      timeout 300 python3 bench/baselines/torch_colocated.py --layout "/tmp/layout-$model.json" \
        --trainer-dtype "$dtype" --steps "$steps" --json "$work/torch-$model.json" >> "$out/torch.log" 2>&1
    rc=$?
    tail -2 "$out/torch.log"
    [ $rc -eq 0 ] && torch_json+=("$work/torch-$model.json") || { echo "torch baseline failed (rc $rc)"; status=1; }
  fi
done

python3 - "$out/results.json" "$work"/*.json <<'PY'
import json, sys
json.dump({p.rsplit("/", 1)[-1]: json.load(open(p)) for p in sys.argv[2:]}, open(sys.argv[1], "w"), indent=1)
PY
echo "== table"
python3 bench/gpu/table.py "${bench_json[@]}" --torch "${torch_json[@]}" | tee "$out/table.md"
exit $status
