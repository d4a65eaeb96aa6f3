#!/usr/bin/env bash
# Refits that fail in flight on GPUs (docs/runtime.md, "A refit that fails in flight"): a trainer
# or engine rank stalls, alive, for 1.5 x refit.timeout_s in step 2 of 3; every rank fails that
# refit, aborts its NCCL communicators (or stops writing over CUDA IPC), forms the groups anew,
# and step 3 of the same session verifies bit-exact. With 2 GPUs: NCCL and NVLink cells (trainer
# on GPU 0, engine on GPU 1) and colocated world 2 -> TP 2; with 1 GPU: colocated world 1 -> TP 1.
# One table last; logs in $REFIT_BENCH_OUT (default /tmp/refit-recovery_gpu): summary.txt,
# <cell>.log.
#   bash scripts/build.sh && bash bench/gpu/recovery_gpu.sh
# Environment: REFIT_RG_TIMEOUT (refit.timeout_s of every cell, default 5).
set -uo pipefail
source "$(dirname "$0")/common.sh"
: > "$summary"
timeout_s=${REFIT_RG_TIMEOUT:-5}
nvidia-smi -L | tee -a "$summary"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')

# cfg NAME WORLD COLOCATED TP EXECUTOR [REFIT_KEYS]
cfg() {
  local f=$work/$1.yaml
  {
    echo "model: tiny-qwen3"
    echo "device: cuda"
    echo "policy: {backend: fsdp2, world_size: $2, dtype: float32}"
    echo "generation: {backend: sglang, colocated: $3, num_engines: 1, tp_size: $4}"
    echo "refit: {buffer_size_bytes: 65536, timeout_s: $timeout_s, executor: $5${6:-}}"
  } > "$f"
  echo "$f"
}

rows=()
# cell NAME FAULT VERIFY(yes|no) CONFIG
cell() {
  local log=$out/$1.log args=(run "$4" --steps 3 --fault "$2")
  [ "$3" = yes ] && args+=(--verify)
  timeout 300 "$R" "${args[@]}" > "$log" 2>&1
  local rc=$?
  local failed ok3 anew verified
  # Matches, not lines: the ranks' log lines may interleave on one line.
  count() { grep -o "$1" "$log" | wc -l; }
  failed=$(count "1 of 3 refit(s) failed (steps 2); the session went on")
  ok3=$(count "step 3/3: refit [0-9]")
  anew=$(count "forming the groups anew")
  verified=$(count ", verified")
  rows+=("$(printf '%-28s %-18s rc=%-3s step2-failed=%s step3-ok=%s ranks-reformed=%s verified=%s' \
    "$1" "$2" "$rc" "$failed" "$ok3" "$anew" "$verified")")
}

if [ "$gpus" -ge 2 ]; then
  # NCCL point-to-point between processes on two GPUs.
  cell nccl-stall-trainer stall-trainer:0:2 yes "$(cfg nccl 1 false 1 p2p)"
  cell nccl-stall-engine-checksum stall-engine:0:2 yes \
    "$(cfg nccl-ck 1 false 1 p2p ', checksum: true, keep_previous: true')"
  cell nccl-stall-engine-publish stall-engine:0:2 no "$(cfg nccl-pub 1 false 1 p2p)"
  # Peer access over NVLink (CUDA IPC between the two GPUs).
  cell nvlink-peer-stall-trainer stall-trainer:0:2 yes "$(cfg peer 1 false 1 auto)"
fi
if [ "$gpus" -ge 2 ]; then
  # Colocated: CUDA IPC, trainer world 2 -> engine TP 2 (rank r on GPU r).
  cell colo-ipc-stall-trainer stall-trainer:1:2 yes "$(cfg colo 2 true 2 auto)"
else
  # One GPU: world 1 -> TP 1 colocated (NCCL refuses two ranks of one group on one GPU).
  cell colo1-ipc-stall-trainer stall-trainer:0:2 yes "$(cfg colo1 1 true 1 auto)"
  cell colo1-ipc-stall-engine stall-engine:0:2 no "$(cfg colo1e 1 true 1 auto)"
fi

note "== refits that fail in flight (timeout_s $timeout_s; expect rc=1, step2-failed = trainer ranks, step3-ok=1)"
for r in "${rows[@]}"; do note "$r"; done
