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
# Then refit.delta in the executors: `refit run --verify --json` with refit.delta on, 5 steps of
# --update adam:1e-5 on qwen2.5-0.5b, colocated on GPU 0 (peer access, CUDA IPC: delta_patch
# writes the engine's parameters) and, with 2 GPUs, trainer on GPU 0 and engine on GPU 1 with
# executor p2p (NCCL: size words then streams); each prints per step the pairs sent as a delta,
# the changed fraction, the wire bytes against the full refit and the refit seconds. Expected:
# step 1 full (0 pairs, wire = full), steps 2-5 every pair a delta (a cell that did not fails the
# script), about 9 % changed in bf16 (about 3 % of the codes and scales with FP8), wire about 5 % of
# full (p2p) / the changed elements' bytes (peer), every step verified.
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
# refit.delta through the executors: colocated peer on one GPU; p2p across two GPUs when present.
ngpu=$(nvidia-smi -L | wc -l)
# "staged": the peer cell with refit.staged (the bytes land in the engine's staging area, CUDA IPC;
# generation pauses only to copy it in; pause_s per step). "fp8peer": the peer cell with FP8
# weights (the trainer rank packs the codes and scales into segments of its own and patches the
# engine's parameters from them): steps 2-5 a delta of about 3 % of the codes and scales.
cells="peer staged fp8peer"
[ "$ngpu" -ge 2 ] && cells="peer staged fp8peer p2p"
for cell in $cells; do
  colocated=true executor=$cell staged=false precision=bf16
  [ "$cell" = p2p ] && colocated=false
  [ "$cell" = staged ] && executor=peer staged=true
  [ "$cell" = fp8peer ] && executor=peer precision=fp8
  c=$work/run-$cell.yaml
  printf 'model: qwen2.5-0.5b\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: float32}\ngeneration: {backend: sglang, colocated: %s, num_engines: 1, tp_size: 1}\nrefit: {timeout_s: 300, executor: %s, delta: on, staged: %s, target_precision: %s}\n' \
    "$colocated" "$executor" "$staged" "$precision" > "$c"
  timeout 900 "$R" run "$c" --steps 5 --verify --update adam:1e-5 --json "$out/run-$cell.json" \
    > "$out/run-$cell.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  note "== refit run qwen2.5-0.5b executor $cell refit.delta on rc=$rc"
  [ -s "$out/run-$cell.json" ] || status=1
  [ -s "$out/run-$cell.json" ] && { python3 - "$out/run-$cell.json" <<'PY' | tee -a "$summary" || status=1; }
import json, sys
r = json.load(open(sys.argv[1]))
d = r.get("delta", {}).get("steps", [])
print(f"{'step':>4} {'pairs':>5} {'changed':>8} {'wire_bytes':>12} {'full_bytes':>12} {'wire/full':>9} {'refit_s':>8} {'pause_s':>8} {'encode_s':>8} {'apply_s':>8}")
for s, t, p in zip(d, r["refit_seconds"], r["pause_seconds"]):
    print(f"{s['step']:>4} {s['pairs']:>5} {100 * s['changed_fraction']:>7.2f}% {s['wire_bytes']:>12} {s['full_bytes']:>12}"
          f" {s['wire_bytes'] / max(1, s['full_bytes']):>9.4f} {t:>8.3f} {p:>8.3f} {s['encode_seconds']:>8.3f} {s['apply_seconds']:>8.3f}")
print(f"verified: {r['verified']}")
# The run succeeded (every step verified: --verify), and every step after the first sent deltas.
late = [s for s in d if s["step"] > 1]
if not r.get("ok") or not r["verified"] or not late or any(s["pairs"] == 0 for s in late):
    print("FAILED: expected every step verified and steps 2 on sent as deltas")
    sys.exit(1)
PY
done
echo
echo "== summary ($out/summary.txt)"
cat "$summary"
exit $status
