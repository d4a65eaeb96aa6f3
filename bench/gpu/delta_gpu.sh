#!/usr/bin/env bash
# Delta refits on one GPU (docs/delta.md). First the CUDA kernels against the CPU loops, bit for
# bit (refit_tests DeltaGpu.*: the same streams, kept copies, digests and engine parameters at
# densities 0 to 1; corrupted streams and wrong bases refused naming the tensor;
# CudaKernels.GenerateMatchesWeightSource: --update adam:LR on the GPU). Then refit_delta_bench on
# qwen3-8b shapes (fp32 master -> bf16, FSDP2 world 1 -> TP 1, every trainer shard and engine
# parameter on this GPU) at adam:1e-6, 3e-6 and 1e-5, every engine element verified after every
# step. Its table compares
#   - the encode (read the master, cast, compare with the kept copy, update it, code the stream)
#     with a plain cast of the same tensors into a staging segment: target <= 2x ("enc/cast");
#   - the apply of the stream in place with the full apply of the same routes (the staging
#     segment scattered into the parameters): target <= 0.2x at about 3 % changed (adam:3e-6,
#     "app/full").
# One table last; logs in $REFIT_BENCH_OUT (default /tmp/refit-delta_gpu).
#
#   bash scripts/build.sh && bash bench/gpu/delta_gpu.sh
#
# On a GPU host without refit's build dependencies: REFIT_BUNDLE_WITH=delta bash bench/gpu/bundle.sh
# on the build host first (bench/gpu/bundle.sh). Environment: REFIT_DELTA_MODEL (qwen3-8b),
# REFIT_DELTA_STEPS (3), REFIT_DELTA_LRS ("1e-6 3e-6 1e-5"), REFIT_SKIP_TESTS=1 to skip the unit
# tests.
set -uo pipefail
source "$(dirname "$0")/common.sh"
: > "$summary"
cd "$root"
nvidia-smi -L | tee -a "$summary"
status=0

if [ "${REFIT_SKIP_TESTS:-0}" != 1 ]; then
  timeout 900 "$T" \
    --gtest_filter='DeltaGpu.*:CudaKernels.GenerateMatchesWeightSource:DeltaHost.*:DeltaFormat.*' \
    > "$out/unit.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  note "unit tests rc=$rc passed=$(grep -c '^\[       OK' "$out/unit.log")" \
       "failed=$(grep -c '^\[  FAILED  \] [A-Z]' "$out/unit.log")" \
       "skipped=$(grep -c '^\[  SKIPPED \] [A-Z]' "$out/unit.log")"
  grep -B2 -A12 "Failure" "$out/unit.log" | head -60
fi

model=${REFIT_DELTA_MODEL:-qwen3-8b}
steps=${REFIT_DELTA_STEPS:-3}
cfg=$work/delta.yaml
printf 'model: %s\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: float32}\ngeneration: {backend: vllm, colocated: true, num_engines: 1, tp_size: 1}\nrefit: {timeout_s: 300}\n' \
  "$model" > "$cfg"
for lr in ${REFIT_DELTA_LRS:-1e-6 3e-6 1e-5}; do
  timeout 900 "$D" "$cfg" --update "adam:$lr" --steps "$steps" > "$out/bench-$lr.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  note "== refit_delta_bench $model adam:$lr rc=$rc"
  grep -v '^$' "$out/bench-$lr.log" | tee -a "$summary"
done
echo
echo "== summary ($out/summary.txt)"
cat "$summary"
exit $status
