#!/usr/bin/env bash
# Where the control hops of a colocated refit spend their time (docs/runtime.md, "Latency of the
# control hops"): `refit bench` of qwen3-8b bf16 -> fp8 on one GPU under REFIT_LOG=debug, one
# timeline of trainer and engine per step, in variants:
#   plain      as configured;
#   nospin     REFIT_CONTROL_SPIN_US=0;
#   nolanes    REFIT_CONTROL_LANES=0 (every message through ZeroMQ);
# One GPU; logs in $REFIT_BENCH_OUT (default /tmp/refit-hops).
#   bash scripts/build.sh && bash bench/gpu/control_hops.sh
# REFIT_HOPS_VARIANTS picks some, in order, repeats allowed (default "plain nolanes nospin").
# Prints the medians and the last step's timelines.
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-hops
: > "$summary"
py=python3
note "$(nproc) cores; cpuidle driver: $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none);" \
  "states: $(cat /sys/devices/system/cpu/cpu0/cpuidle/state*/name 2>/dev/null | tr '\n' ' ')" \
  "exit latencies us: $(cat /sys/devices/system/cpu/cpu0/cpuidle/state*/latency 2>/dev/null | tr '\n' ' ')" \
  "$(grep -q hypervisor /proc/cpuinfo && echo '(virtual machine)')"
f=$work/b.yaml
printf 'model: qwen3-8b\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: bfloat16}\ngeneration: {backend: vllm, colocated: true, num_engines: 1, tp_size: 1}\nrefit: {target_precision: %s, timeout_s: 300}\n' "${REFIT_HOPS_TARGET:-fp8}" > "$f"
run_bench() {  # NAME [env assignments...]; a repeated NAME gets -2, -3, ...
  local name=$1 k=2
  shift
  if [ -e "$out/hops-$name.json" ]; then
    while [ -e "$out/hops-$name-$k.json" ]; do k=$((k + 1)); done
    name=$name-$k
  fi
  env REFIT_LOG=debug "$@" timeout 600 "$R" bench "$f" --steps 6 --json "$out/hops-$name.json" \
    > "$out/hops-$name.log" 2>&1
  note "$(printf 'hops %-8s rc=%s' "$name" "$?")"
}
for v in ${REFIT_HOPS_VARIANTS:-plain nolanes nospin}; do
  case $v in
    plain) run_bench plain ;;
    nospin) run_bench nospin REFIT_CONTROL_SPIN_US=0 ;;
    nolanes) run_bench nolanes REFIT_CONTROL_LANES=0 ;;
    *) note "unknown variant $v" ;;
  esac
done
echo "== table"
$py - "$out" <<'PY' | tee -a "$summary"
import glob, json, os, statistics, sys
for p in sorted(glob.glob(f"{sys.argv[1]}/hops-*.json")):
    j = json.load(open(p))
    name = os.path.basename(p)[5:-5]
    if not j.get("ok"):
        print(f"{name:10} failed: {j.get('error', '')[:200]}"); continue
    ms = statistics.median(j["refit_seconds"]) * 1e3
    print(f"{name:10} {ms:7.2f} ms  floor {j.get('floor_seconds', 0) * 1e3:6.2f}  ratio {j.get('ratio_to_floor', 0):.2f}"
          f"  copy {j.get('phases', {}).get('cast_pack', 0) * 1e3:.2f} ms")
PY
for l in "$out"/hops-*.log; do echo "== $(basename "$l")"; $py "$root/bench/gpu/timeline.py" "$l" 1; done | tee -a "$summary"
