#!/usr/bin/env bash
# The copy kernels on one GPU, outside the runtime: the CUDA unit tests of the kernels, then per
# shape zero_copy_bench (the peer path's one launch, an engine that pulls, CUDA-IPC buckets, and the
# floor: a device-to-device copy and one flat cast, each verified bit-exact) and the idealised
# PyTorch colocated copy (bench/baselines/torch_colocated.py, torch in python3). One table last
# (docs/gpu.md); logs and results.json in $REFIT_BENCH_OUT (default /tmp/refit-kernels_gpu).
#
#   bash scripts/build.sh && bash bench/gpu/kernels_gpu.sh
#
# Builds the zero_copy_bench target in the build tree first (REFIT_BUILD, default ./build), or
# takes it from a bundle (REFIT_BUNDLE_WITH=kernels bash bench/gpu/bundle.sh).
# Environment: REFIT_BENCH_STEPS (5), REFIT_BENCH_SHAPES ("qwen3-8b:float32
# qwen3-30b-a3b:bfloat16"), REFIT_SKIP_TORCH=1 to skip the baseline, REFIT_SKIP_TESTS=1 to skip
# the unit tests.
set -uo pipefail
source "$(dirname "$0")/common.sh"
: > "$summary"
steps=${REFIT_BENCH_STEPS:-5}
shapes=${REFIT_BENCH_SHAPES:-"qwen3-8b:float32 qwen3-30b-a3b:bfloat16"}
cd "$root"

{ nvidia-smi; nvcc --version; python3 -c 'import torch; print("torch", torch.__version__)'; } \
  > "$out/machine.txt" 2>&1

if [ -n "${build:-}" ]; then  # the build tree: build the benchmark there
  echo "== build zero_copy_bench"
  if ! cmake --build "$build" --target zero_copy_bench > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"
    note "build failed (build.log)"
    exit 1
  fi
elif [ ! -x "$Z" ]; then
  note "the bundle has no zero_copy_bench: REFIT_BUNDLE_WITH=kernels bash bench/gpu/bundle.sh"
  exit 1
fi

status=0
# The copy kernels' variants first: a variant that fails (or hangs) its bit-exactness tests is
# left out of the benchmark instead of sinking the run.
if ! timeout 90 "$T" --gtest_filter='CudaKernels.FlatConvert*:CudaKernels.BlockCopy*' \
     > "$out/tests.log" 2>&1; then
  note "copy kernel variants failed their tests: benchmarking without the bulk engine"
  grep -A8 'Failure' "$out/tests.log" | head -30
  export REFIT_BENCH_BULK=0
  status=1
fi
if [ "${REFIT_SKIP_TESTS:-0}" != 1 ]; then
  echo "== CUDA unit tests"
  # NCCL separately, with a short leash: a wedged NCCL abort must not eat the whole run.
  timeout 150 "$T" --gtest_filter='Cuda*:-CudaNccl.*:CudaKernels.FlatConvert*:CudaKernels.BlockCopy*' \
    >> "$out/tests.log" 2>&1
  rc1=$?
  timeout 120 "$T" --gtest_filter='CudaNccl.*' >> "$out/tests.log" 2>&1
  rc2=$?
  grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \]|tests from .* ran' "$out/tests.log"
  note "cuda unit tests: rc=$rc1/$rc2"
  if [ $rc1 -ne 0 ] || [ $rc2 -ne 0 ]; then
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
  timeout 300 "$Z" --model "$model" --trainer-dtype "$dtype" --steps "$steps" \
    --json "$work/bench-$model.json" >> "$out/bench.log" 2>&1
  rc=$?
  tail -3 "$out/bench.log"
  [ $rc -eq 0 ] && bench_json+=("$work/bench-$model.json") || { note "bench $model failed (rc $rc)"; status=1; }
  if [ "${REFIT_SKIP_TORCH:-0}" != 1 ]; then
    echo "== torch baseline $model"
    "$Z" --model "$model" --dump-layout "$work/layout-$model.json" &&
      timeout 300 python3 bench/baselines/torch_colocated.py --layout "$work/layout-$model.json" \
        --trainer-dtype "$dtype" --steps "$steps" --json "$work/torch-$model.json" >> "$out/torch.log" 2>&1
    rc=$?
    tail -2 "$out/torch.log"
    [ $rc -eq 0 ] && torch_json+=("$work/torch-$model.json") || { note "torch baseline $model failed (rc $rc)"; status=1; }
  fi
done

shopt -s nullglob  # no JSON when every benchmark failed
python3 - "$out/results.json" "$work"/*.json <<'PY'
import json, sys
json.dump({p.rsplit("/", 1)[-1]: json.load(open(p)) for p in sys.argv[2:]}, open(sys.argv[1], "w"), indent=1)
PY
echo "== table"
python3 bench/gpu/table.py "${bench_json[@]}" --torch "${torch_json[@]}" | tee -a "$summary"
exit $status
