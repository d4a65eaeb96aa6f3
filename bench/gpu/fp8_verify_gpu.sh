#!/usr/bin/env bash
# --verify of an FP8 refit on the GPU (docs/fp8.md, "Checks"): the reference quantizer's kernels
# against the CPU quantizer (refit_tests CudaFp8Reference.*), then `refit run --verify --steps 1`
# of qwen3-8b on one GPU (bf16 trainer, colocated, vLLM protocol), in bf16 and in fp8, each timed
# end to end, and the ratio fp8 / bf16 (target: at most 2). Then one damaged fp8 refit, which must
# fail naming the tensor. Prints a table last; logs in $REFIT_BENCH_OUT (default
# /tmp/refit-fp8-verify).
#   bash scripts/build.sh && bash bench/gpu/fp8_verify_gpu.sh
# REFIT_FP8V_ROUNDS=N times each run N times, interleaved (default 3); the table shows medians.
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-fp8-verify
: > "$summary"
nvidia-smi -L | tee -a "$summary"
py=python3

if [ -x "$T" ]; then
  timeout 300 "$T" --gtest_filter='CudaFp8Reference.*:Fp8ReferenceMath.*' \
    > "$out/unit.log" 2>&1
  note "unit CudaFp8Reference/Fp8ReferenceMath rc=$? ($(grep -c '^\[       OK' "$out/unit.log") ok, $(grep -c '^\[  FAILED' "$out/unit.log") failed, $(grep -c '^\[  SKIPPED' "$out/unit.log") skipped)"
  grep -B2 -A8 "Failure" "$out/unit.log" | head -40 | tee -a "$summary"
fi

cfg() {  # target
  local f=$work/q8-$1.yaml
  printf 'model: qwen3-8b\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: bfloat16}\ngeneration: {backend: vllm, colocated: true, num_engines: 1, tp_size: 1}\nrefit: {target_precision: %s, timeout_s: 300}\n' "$1" > "$f"
  echo "$f"
}
timed() {  # name target [extra args]: one verified run, its wall time into $out/time-<name>.txt
  local name=$1 target=$2; shift 2
  local f; f=$(cfg "$target")
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout 600 "$R" run "$f" --steps 1 --verify --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  local secs; secs=$(awk "BEGIN {print $t1 - $t0}")
  echo "$rc $secs" >> "$out/time-${name%-*}.txt"
  note "$(printf '%-10s rc=%s %6.2f s  %s' "$name" "$rc" "$secs" \
    "$(grep -o '[0-9]* parameters verified bit-exact against the FP8 reference quantizer on the GPU' "$out/$name.log" | head -1)")"
}
for ((k = 1; k <= ${REFIT_FP8V_ROUNDS:-3}; ++k)); do
  timed "bf16-$k" bf16
  timed "fp8-$k" fp8
done

# A byte damaged in flight: verification on the GPU must name the parameter and the element.
f=$(cfg fp8)
timeout 600 "$R" run "$f" --steps 1 --verify --fault corrupt:0 > "$out/corrupt.log" 2>&1
rc=$?
note "corrupt:0 rc=$rc (want 1): $(grep -o 'verify: [^;]*;' "$out/corrupt.log" | head -1) $(grep -c 'reference quantizer of docs/fp8.md, on the GPU' "$out/corrupt.log") GPU mismatch line(s)"

echo "== table"
$py - "$out" <<'PY' | tee -a "$summary"
import statistics, sys
out = sys.argv[1]
med = {}
for name in ("bf16", "fp8"):
    rows = [l.split() for l in open(f"{out}/time-{name}.txt")]
    ok = [float(t) for rc, t in rows if rc == "0"]
    med[name] = statistics.median(ok) if ok else float("nan")
    print(f"{name:5} verified runs ok {len(ok)}/{len(rows)}  median {med[name]:7.2f} s  all: "
          + " ".join(f"{float(t):.2f}" for _, t in rows))
ratio = med["fp8"] / med["bf16"]
print(f"fp8 / bf16 = {ratio:.2f} (target <= 2: {'met' if ratio <= 2 else 'NOT met'})")
PY
echo "== summary"; cat "$summary"
