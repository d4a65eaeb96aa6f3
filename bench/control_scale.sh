#!/usr/bin/env bash
# The control plane per rank and refit as a CPU run grows: `refit run` of tiny-qwen3 with T trainer
# ranks feeding T/4 engines of TP 4 (2T processes), for each process count given (default 32 and
# 256), with --verify and refit.checksum. Prints each run's `control` counters from the JSON report
# and, per rank and refit, the mailbox messages and store requests, with the ratio to the first
# run. Flat means a ratio near 1.
#
#   bench/control_scale.sh [REFIT] [PROCESSES...]      e.g. bench/control_scale.sh build/src/refit 32 256
#
# A run of N processes needs about 32 N threads (ulimit -u) and 8 N file descriptors per rank's
# peers (refit raises both soft limits when the hard ones allow).
set -euo pipefail

refit=${1:-build/src/refit}
shift || true
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(32 256)
steps=${STEPS:-3}
work=$(mktemp -d "${TMPDIR:-/tmp}/refit-control-scale-XXXXXX")
trap 'rm -rf "$work"' EXIT

rows=()
base_msg="" base_req=""
for n in "${sizes[@]}"; do
  t=$((n / 2))
  if [ $((t % 4)) -ne 0 ] || [ "$t" -lt 4 ]; then
    echo "control_scale.sh: $n processes: needs a multiple of 8" >&2
    exit 2
  fi
  cat > "$work/config-$n.yaml" <<YAML
model: tiny-qwen3
device: cpu
seed: 11
policy: {backend: fsdp2, world_size: $t, dtype: float32}
generation: {backend: sglang, colocated: false, num_engines: $((t / 4)), tp_size: 4}
refit: {target_precision: bf16, buffer_size_bytes: 65536, timeout_s: 120, checksum: true}
YAML
  start=$(date +%s.%N)
  if ! "$refit" run "$work/config-$n.yaml" --steps "$steps" --verify --json "$work/report-$n.json" \
      > "$work/log-$n.txt" 2>&1; then
    echo "control_scale.sh: the run of $n processes failed:" >&2
    tail -20 "$work/log-$n.txt" >&2
    exit 1
  fi
  secs=$(echo "$(date +%s.%N) - $start" | bc)
  read -r sr mm rsr rmm med < <(python3 - "$work/report-$n.json" <<'PY'
import json, sys, statistics
r = json.load(open(sys.argv[1]))
c = r["control"]
print(c["store_requests"], c["mailbox_messages"], c["refit_store_requests"],
      c["refit_mailbox_messages"], statistics.median(r["refit_seconds"]))
PY
)
  msg=$(echo "scale=3; $rmm / $n / $steps" | bc)
  req=$(echo "scale=3; $rsr / $n / $steps" | bc)
  [ -n "$base_msg" ] || { base_msg=$msg; base_req=$req; }
  rmsg=$(echo "scale=2; $msg / $base_msg" | bc)
  rreq=$(echo "scale=2; if ($base_req == 0) 0 else $req / $base_req" | bc)
  rows+=("$(printf '| %5d | %3d -> %2d x TP 4 | %8d | %8d | %6.3f | %5.2f | %6.3f | %5.2f | %6.3f | %6.1f |' \
    "$n" "$t" "$((t / 4))" "$sr" "$mm" "$msg" "$rmsg" "$req" "$rreq" "$med" "$secs")")
done

echo "refit control plane, $steps refits with --verify and refit.checksum, $(nproc) cores"
echo
echo "| processes | ranks | store requests | mailbox messages | msgs / rank / refit | ratio | store reqs / rank / refit | ratio | median refit s | run s |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for r in "${rows[@]}"; do echo "$r"; done
