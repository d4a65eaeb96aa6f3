#!/usr/bin/env bash
# Setup cost of the transfer plan at frontier scale, on the CPU that runs it (no GPU needed):
# the whole plan streamed rank by rank (`refit check CONFIG`, every rank's view in turn), then the
# per-rank views (`refit check CONFIG --rank R`: what that rank derives at setup) of trainer rank 0,
# engine rank 0 and the trainer and engine ranks with the most routes. Wall and CPU seconds and
# peak resident memory of the command from GNU time; for a rank's view also the CPU seconds of its
# derivation alone (what the rank spends at setup; `refit check --rank` prints them), which the
# view budgets are checked on. The whole plan's budget is checked on its wall time.
#
#   bash bench/plan/setup_scale.sh [./build/src/refit]
#
# Prints one row per (config, what) and, last, each budget with whether it held:
#   a heaviest rank's view <= 1 s and <= 256 MB (Qwen3-235B-A22B 256 -> 8 x TP 8, Kimi-K2
#   1,024 -> 32 x TP 8), <= 0.3 s for Qwen3-235B-A22B 64 -> 8 x TP 8; every rank of a config
#   (the whole plan) <= 30 s and <= 2 GB.
set -euo pipefail
cd "$(dirname "$0")/../.."
REFIT=${1:-./build/src/refit}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

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
cfg k2-1024 kimi-k2 1024 32 8
cfg q30-64 qwen3-30b-a3b 64 8 8
cfg default qwen2.5-0.5b 2 1 2

FAILS=0
BUDGETS=()
# measure LABEL MAX_S MAX_MB ARGS...: one row; a budget of 0 is none.
measure() {
  local label=$1 max_s=$2 max_mb=$3
  shift 3
  /usr/bin/time -f "%e %U %S %M" -o "$TMP/time" "$REFIT" check "$@" > "$TMP/out" 2>&1 || {
    echo "$label: refit check failed:" >&2
    tail -5 "$TMP/out" >&2
    return 1
  }
  local secs user sys kb
  read -r secs user sys kb < "$TMP/time"
  local cpu mb derive checked
  cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.2f", u + s }')
  mb=$((kb / 1024))
  derive=$(grep -o "([0-9.]* s of CPU)" "$TMP/out" | head -1 | tr -dc '0-9.' || true)
  checked=${derive:-$secs}
  printf "| %-46s | %8.2f | %8s | %8s | %8d |\n" "$label" "$secs" "$cpu" "${derive:--}" "$mb"
  if [[ $max_s != 0 ]]; then
    local ok=yes
    awk -v c="$checked" -v m="$max_s" 'BEGIN { exit !(c <= m) }' || ok=no
    [[ $mb -le $max_mb ]] || ok=no
    [[ $ok == yes ]] || FAILS=$((FAILS + 1))
    BUDGETS+=("$(printf "| %-46s | <= %5s s, <= %5s MB | %-4s |" "$label" "$max_s" "$max_mb" "$ok")")
  fi
}

printf "| %-46s | %8s | %8s | %8s | %8s |\n" "what" "wall s" "CPU s" "derive s" "peak MB"
printf "|%s|%s|%s|%s|%s|\n" "------------------------------------------------" "----------" \
  "----------" "----------" "----------"
measure "default config, every rank" 0 0 "$TMP/default.yaml"
measure "qwen3-30b-a3b 64 -> 8 x TP 8, every rank" 0 0 "$TMP/q30-64.yaml"
for c in q235-64 q235-256 k2-1024; do
  case $c in
    q235-64) view_s=0.3 ;;
    *) view_s=1 ;;
  esac
  measure "$c: every rank" 30 2048 "$TMP/$c.yaml"
  # The ranks with the most routes, as the whole plan names them.
  most=$(grep -o "the most routes: trainer rank [0-9]* ([0-9]*), engine rank [0-9]*" "$TMP/out")
  t=$(sed -E 's/.*trainer rank ([0-9]+).*/\1/' <<< "$most")
  g=$(sed -E 's/.*engine rank ([0-9]+)$/\1/' <<< "$most")
  measure "$c: trainer rank 0" "$view_s" 256 "$TMP/$c.yaml" --rank trainer:0
  [[ $t == 0 ]] || measure "$c: trainer rank $t (most routes)" "$view_s" 256 "$TMP/$c.yaml" --rank "trainer:$t"
  measure "$c: engine rank 0" "$view_s" 256 "$TMP/$c.yaml" --rank engine:0
  [[ $g == 0 ]] || measure "$c: engine rank $g (most routes)" "$view_s" 256 "$TMP/$c.yaml" --rank "engine:$g"
done
echo
printf "| %-46s | %-22s | %-4s |\n" "budget" "limit" "held"
printf "|%s|%s|%s|\n" "------------------------------------------------" "------------------------" "------"
printf "%s\n" "${BUDGETS[@]}"
exit $((FAILS > 0))
