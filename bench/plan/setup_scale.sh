#!/usr/bin/env bash
# Setup cost of the transfer plan at frontier scale, on the CPU that runs it (no GPU needed):
# per-rank views (`refit check CONFIG --rank R`, what that rank derives at setup) and the whole
# plan streamed rank by rank (`refit check CONFIG`), wall time and peak memory (GNU time -v).
#
#   bash bench/plan/setup_scale.sh [./build/src/refit]
#
# Prints one row per (config, what): wall seconds, CPU seconds (user + system: on a machine shared
# with other work the wall time also counts waiting for a core) and peak resident MB. The configs are written to a
# temporary directory; the 1T-class model is bench/plan/kimi-k2-dims (a Qwen3-MoE table at
# Kimi-K2's dimensions: 61 layers, 384 experts, hidden 7168, 69,674 tensors).
set -euo pipefail
cd "$(dirname "$0")/../.."
REFIT=${1:-./build/src/refit}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
KIMI=$PWD/bench/plan/kimi-k2-dims

cfg() {  # name model world engines tp
  cat > "$TMP/$1.yaml" <<YAML
model: $2
device: cuda
policy: {backend: fsdp2, world_size: $3, dtype: bfloat16}
generation: {backend: vllm, colocated: false, num_engines: $4, tp_size: $5}
YAML
}
cfg q235-64 qwen3-235b-a22b 64 8 8
cfg q235-256 qwen3-235b-a22b 256 8 8
cfg k1t-1024 "$KIMI" 1024 32 8
cfg q30-8 qwen3-30b-a3b 8 8 1
cfg q30-64 qwen3-30b-a3b 64 8 8
cfg default qwen2.5-0.5b 2 1 2

measure() {  # label args...
  local label=$1
  shift
  /usr/bin/time -f "%e %U %S %M" -o "$TMP/time" "$REFIT" check "$@" > "$TMP/out" 2>&1 || {
    echo "$label: refit check failed:" >&2
    tail -5 "$TMP/out" >&2
    return 1
  }
  read -r secs user sys kb < "$TMP/time"
  printf "| %-44s | %8.2f | %8.2f | %9d |\n" "$label" "$secs" "$(awk "BEGIN{print $user + $sys}")" "$((kb / 1024))"
}

printf "| %-44s | %8s | %8s | %9s |\n" "what" "wall s" "CPU s" "peak MB"
printf "|%s|%s|%s|%s|\n" "----------------------------------------------" "----------" "----------" "-----------"
measure "default config, whole plan" "$TMP/default.yaml"
measure "qwen3-30b-a3b 8 -> 8 x TP 1, whole plan" "$TMP/q30-8.yaml"
measure "qwen3-30b-a3b 64 -> 8 x TP 8, whole plan" "$TMP/q30-64.yaml"
for c in q235-64 q235-256 k1t-1024; do
  measure "$c: trainer rank 0" "$TMP/$c.yaml" --rank trainer:0
  measure "$c: engine rank 0" "$TMP/$c.yaml" --rank engine:0
  measure "$c: whole plan, every rank" "$TMP/$c.yaml"
done
