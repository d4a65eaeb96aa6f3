#!/usr/bin/env bash
# The control plane per rank and refit as a CPU run grows: `refit run` of tiny-qwen3 with T trainer
# ranks feeding T/4 engines of TP 4 (2T processes), for each process count given (default 32 and
# 256), with --verify and refit.checksum. Prints each run's `control` counters from the JSON report
# and, per rank and refit, the mailbox messages and store requests; the store requests per rank
# and second of refit time; the messages per refit of the busiest rank (trainer rank 0, through
# relays: docs/protocol.md "Relays"); and the median refit, each with the ratio to the first run.
# Flat means a ratio near 1.
#
#   bench/control_scale.sh [REFIT] [PROCESSES...]      e.g. bench/control_scale.sh build/src/refit 32 256
# STEPS (default 3) refits per run; CHECKSUM=false and VERIFY=0 take refit.checksum and --verify
# out, to see what each adds. ENGINES=E keeps E engines of TP 4 at every size (the trainer ranks
# take the other processes), so that every run moves the same bytes and only the ranks grow.
# ROUNDS=R (default 1) runs every size R times, the sizes taking turns, and prints besides each
# round's median refits and their ratio to the first size, and the median of those ratios: runs
# next to each other in time share the host's speed, which drifts from minute to minute on a
# shared machine by more than most changes move a median.
#
# A run of N processes needs about 32 N threads (ulimit -u) and 8 N file descriptors per rank's
# peers (refit raises both soft limits when the hard ones allow).
set -euo pipefail

refit=${1:-build/src/refit}
shift || true
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(32 256)
steps=${STEPS:-3}
rounds=${ROUNDS:-1}
checksum=${CHECKSUM:-true}                  # refit.checksum
verify=--verify; [ "${VERIFY:-1}" = 1 ] || verify=""
work=$(mktemp -d "${TMPDIR:-/tmp}/refit-control-scale-XXXXXX")
trap 'rm -rf "$work"' EXIT

# One run of the size whose config is written: its report and log under $work.
run_size() {
  "$refit" run "$work/config-$1.yaml" --steps "$steps" ${verify:+"$verify"} \
    --json "$work/report-$1.json" > "$work/log-$1.txt" 2>&1
}
median_of() {
  python3 -c 'import json, statistics, sys; print(statistics.median(json.load(open(sys.argv[1]))["refit_seconds"]))' "$1"
}

rows=()
declare -A medians=()
base_msg="" base_req=""
for n in "${sizes[@]}"; do
  if [ -n "${ENGINES:-}" ]; then
    e=$ENGINES
    t=$((n - 4 * e))
    if [ "$t" -lt 1 ]; then
      echo "control_scale.sh: $n processes: fewer than the $((4 * e)) engine ranks of ENGINES=$e" >&2
      exit 2
    fi
  else
    t=$((n / 2))
    e=$((t / 4))
    if [ $((t % 4)) -ne 0 ] || [ "$t" -lt 4 ]; then
      echo "control_scale.sh: $n processes: needs a multiple of 8" >&2
      exit 2
    fi
  fi
  cat > "$work/config-$n.yaml" <<YAML
model: tiny-qwen3
device: cpu
seed: 11
policy: {backend: fsdp2, world_size: $t, dtype: float32}
generation: {backend: sglang, colocated: false, num_engines: $e, tp_size: 4}
refit: {target_precision: bf16, buffer_size_bytes: 65536, timeout_s: 120, checksum: $checksum}
YAML
  start=$(date +%s.%N)
  if ! run_size "$n"; then
    echo "control_scale.sh: the run of $n processes failed; its first errors:" >&2
    grep -m 15 -E "error|refused|cannot|limit" "$work/log-$n.txt" >&2 || tail -20 "$work/log-$n.txt" >&2
    for r in "${rows[@]}"; do echo "$r"; done
    [ -z "${REFIT_SCALE_KEEP:-}" ] || cp "$work/log-$n.txt" "$REFIT_SCALE_KEEP/"
    exit 1
  fi
  secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }')
  read -r sr mm rsr rmm med tot busy < <(python3 - "$work/report-$n.json" <<'PY'
import json, sys, statistics
r = json.load(open(sys.argv[1]))
c = r["control"]
print(c["store_requests"], c["mailbox_messages"], c["refit_store_requests"],
      c["refit_mailbox_messages"], statistics.median(r["refit_seconds"]), sum(r["refit_seconds"]),
      c["busiest_refit_mailbox_messages"])
PY
)
  msg=$(awk -v m="$rmm" -v n="$n" -v s="$steps" 'BEGIN { printf "%.3f", m / n / s }')
  req=$(awk -v r="$rsr" -v n="$n" -v s="$steps" 'BEGIN { printf "%.3f", r / n / s }')
  rps=$(awk -v r="$rsr" -v n="$n" -v t="$tot" 'BEGIN { printf "%.2f", r / n / t }')
  [ -n "$base_msg" ] || { base_msg=$msg; base_req=$req; base_rps=$rps; base_med=$med; }
  rmsg=$(awk -v a="$msg" -v b="$base_msg" 'BEGIN { printf "%.2f", a / b }')
  rreq=$(awk -v a="$req" -v b="$base_req" 'BEGIN { printf "%.2f", b == 0 ? 0 : a / b }')
  rrps=$(awk -v a="$rps" -v b="$base_rps" 'BEGIN { printf "%.2f", b == 0 ? 0 : a / b }')
  rmed=$(awk -v a="$med" -v b="$base_med" 'BEGIN { printf "%.2f", a / b }')
  busy=$(awk -v b="$busy" -v s="$steps" 'BEGIN { printf "%.0f", b / s }')
  medians[$n]=$med
  rows+=("$(printf '| %5d | %3d -> %2d x TP 4 | %8d | %8d | %6.3f | %5.2f | %5d | %6.3f | %5.2f | %7.2f | %5.2f | %6.3f | %5.2f | %6.1f |' \
    "$n" "$t" "$e" "$sr" "$mm" "$msg" "$rmsg" "$busy" "$req" "$rreq" "$rps" "$rrps" "$med" "$rmed" "$secs")")
done

echo "refit control plane, $steps refits (${verify:-no --verify}, refit.checksum: $checksum), $(nproc) cores"
echo
echo "| processes | ranks | store requests | mailbox messages | msgs / rank / refit | ratio | busiest rank's msgs / refit | store reqs / rank / refit | ratio | store reqs / rank / s in refits | ratio | median refit s | ratio | run s |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for r in "${rows[@]}"; do echo "$r"; done

[ "$rounds" -gt 1 ] || exit 0
echo
echo "| round | $(printf '%s processes: median refit s | ' "${sizes[@]}")ratio, ${sizes[${#sizes[@]}-1]} to ${sizes[0]} |"
echo "|---|$(printf -- '---|%.0s' "${sizes[@]}")---|"
ratios=()
for ((k = 1; k <= rounds; k++)); do
  if [ "$k" -gt 1 ]; then
    for n in "${sizes[@]}"; do
      if ! run_size "$n"; then
        echo "control_scale.sh: round $k: the run of $n processes failed; its first errors:" >&2
        grep -m 15 -E "error|refused|cannot|limit" "$work/log-$n.txt" >&2 || tail -20 "$work/log-$n.txt" >&2
        exit 1
      fi
      medians[$n]=$(median_of "$work/report-$n.json")
    done
  fi
  line="| $k |"
  for n in "${sizes[@]}"; do line+=$(printf ' %.4f |' "${medians[$n]}"); done
  last=${sizes[${#sizes[@]}-1]}
  ratio=$(awk -v a="${medians[$last]}" -v b="${medians[${sizes[0]}]}" 'BEGIN { printf "%.2f", a / b }')
  ratios+=("$ratio")
  echo "$line $ratio |"
done
echo
echo "median over $rounds rounds of the ratio of ${sizes[${#sizes[@]}-1]} to ${sizes[0]} processes: $(printf '%s\n' "${ratios[@]}" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
