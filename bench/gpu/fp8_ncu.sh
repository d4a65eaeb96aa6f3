#!/usr/bin/env bash
# Nsight Compute on the FP8 quantize kernel (and the bf16 cast beside it) of a qwen3-8b bf16 -> fp8
# refit, colocated on one GPU: throughput against the GPU's peaks, occupancy, warp stalls.
# Needs Nsight Compute (ncu) on PATH and the permission to profile (root, or
# NVreg_RestrictProfilingToAdminUsers=0).
#   bash scripts/build.sh && bash bench/gpu/fp8_ncu.sh
# Writes ncu-quantize.txt and ncu-copy.txt into $REFIT_BENCH_OUT (default /tmp/refit-ncu); prints
# the headline metrics.
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-ncu
f=$work/b.yaml
printf 'model: qwen3-8b\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: bfloat16}\ngeneration: {backend: vllm, colocated: true, num_engines: 1, tp_size: 1}\nrefit: {target_precision: fp8, timeout_s: 600}\n' > "$f"
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats"
for k in quantize_kernel block_copy; do
  name=${k%%_*}
  # shellcheck disable=SC2086
  timeout 300 ncu --target-processes all -k "regex:$k" -c 1 $sections \
    "$R" bench "$f" --steps 1 > "$out/ncu-$name.txt" 2>&1
  echo "== $k (rc=$?)"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Configuration Size|Block Limit|Issued Warp|No Eligible|Stall|One or More Eligible|L2 Hit|Mem Busy|Max Bandwidth" "$out/ncu-$name.txt" | head -40
done
