#!/usr/bin/env bash
# Refits across a shaped link (docs/delta.md, "Shaped links"). Two hosts on one machine: network
# namespaces A and B joined by a veth pair, each with its own address and IPC namespace, every
# direction shaped with tc (a token bucket) to RATE. Trainer ranks 0 and 1 run on A, engine TP ranks
# 0 and 1 on B, so every (trainer, engine) pair moves its bytes point to point (Gloo over TCP)
# across the link. `refit trainer` / `refit engine`, an authenticated control plane, every process
# bounded by a timeout. Prints per refit its seconds and bytes, and the bytes the shaper passed from A
# to B; writes the logs and trainer rank 0's JSON report to --out.
#
# Needs root (namespaces, tc). From the repository root, after bash scripts/build.sh:
#   bash bench/shaped_link.sh --rate 1gbit --model qwen2.5-0.5b --steps 3
#   bash bench/shaped_link.sh --rate 10gbit --model qwen3-0.6b --steps 3 --update adam:1e-6
#   bash bench/shaped_link.sh --rate 1gbit --model qwen2.5-0.5b --steps 4 --update adam:1e-6 --delta on
#   bash bench/shaped_link.sh --rate 1gbit --model qwen2.5-0.5b --steps 3 --staged
# Flags: --rate R (tc rate, e.g. 1gbit, 10gbit; "none": unshaped), --model M, --steps N,
# --update U (refit run --update), --delta D (refit.delta: off, on, auto), --staged (refit.staged:
# the engines' generation pauses only for the apply; the table adds each refit's pause_s), --verify, --refit BIN (default build/src/refit), --out DIR
# (default: a new temporary directory), --timeout S (bound on the ranks, default 600),
# --config FILE (instead of the generated config: model, FSDP2 world 2 float32 -> SGLang TP 2 bf16).
# Exit codes: 0 every rank succeeded; 1 a rank failed; 2 bad usage; 3 this machine cannot make the
# namespaces or shape the link.
set -euo pipefail
rate=1gbit model=qwen2.5-0.5b steps=3 update="" verify="" bin="" out="" limit=600 config=""
delta=off staged=false
while [ $# -gt 0 ]; do
  case $1 in
    --rate) rate=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --update) update="--update $2"; shift 2 ;;
    --delta) delta=$2; shift 2 ;;
    --staged) staged=true; shift ;;
    --verify) verify=--verify; shift ;;
    --refit) bin=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    *) echo "shaped_link.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$(realpath "${bin:-$root/build/src/refit}")
[ -x "$bin" ] || { echo "shaped_link.sh: no refit CLI at $bin (bash scripts/build.sh)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "shaped_link.sh: needs root (network namespaces, tc)" >&2; exit 2; }
out=${out:-$(mktemp -d /tmp/refit-shaped-XXXXXX)}
mkdir -p "$out" && out=$(realpath "$out")
rm -f "$out"/codes-a "$out"/codes-b "$out"/report.json

id=$(( $$ % 200 + 20 ))
a=refit-sa$$ b=refit-sb$$
ip_a=10.232.$id.1 ip_b=10.232.$id.2
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; }
trap cleanup EXIT
# Exit 3 when this machine cannot make the namespaces or shape the link (no privilege, no tc).
setup_link() {
  ip netns add "$a" && ip netns add "$b" &&
    ip link add "${a}v" type veth peer name "${b}v" &&
    ip link set "${a}v" netns "$a" && ip link set "${b}v" netns "$b" &&
    ip -n "$a" addr add "$ip_a/24" dev "${a}v" && ip -n "$b" addr add "$ip_b/24" dev "${b}v" &&
    ip -n "$a" link set "${a}v" up && ip -n "$b" link set "${b}v" up &&
    ip -n "$a" link set lo up && ip -n "$b" link set lo up || return 1
  [ "$rate" = none ] && return 0
  # A bucket of 2 MB holds many 64 KiB segments (veth passes GSO segments) and 1.6 ms at 10 Gbit/s.
  for ns in "$a" "$b"; do
    ip netns exec "$ns" tc qdisc add dev "${ns}v" root tbf rate "$rate" burst 2mb latency 100ms ||
      return 1
  done
}
if ! setup_link > "$out/setup.log" 2>&1; then
  echo "shaped_link.sh: cannot make the namespaces or shape the link here:" >&2
  cat "$out/setup.log" >&2
  exit 3
fi

if [ -z "$config" ]; then
  config=$out/config.yaml
  printf 'model: %s\nseed: 0\npolicy: {backend: fsdp2, world_size: 2, dtype: float32}\ngeneration: {backend: sglang, colocated: false, num_engines: 1, tp_size: 2}\nrefit: {target_precision: bf16, timeout_s: 120, executor: auto, delta: %s, staged: %s}\n' \
    "$model" "$delta" "$staged" > "$config"
fi
config=$(realpath "$config")
secret=$out/secret
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$secret" && chmod 600 "$secret"
env="MASTER_ADDR=$ip_a MASTER_PORT=29655 REFIT_SECRET_FILE=$secret"
host_a="cd $out; export $env REFIT_HOST=$ip_a;
  RANK=0 WORLD_SIZE=2 $bin trainer $config --steps $steps $verify $update --json $out/report.json > t0.log 2>&1 &
  RANK=1 WORLD_SIZE=2 $bin trainer $config --steps $steps $verify $update > t1.log 2>&1 &
  for p in \$(jobs -p); do wait \$p; echo \$? >> codes-a; done"
host_b="cd $out; export $env REFIT_HOST=$ip_b;
  ENGINE_RANK=0 $bin engine $config $verify $update > e0.log 2>&1 &
  ENGINE_RANK=1 $bin engine $config $verify $update > e1.log 2>&1 &
  for p in \$(jobs -p); do wait \$p; echo \$? >> codes-b; done"
timeout -k 5 "$limit" ip netns exec "$a" unshare --ipc bash -c "$host_a" &
pa=$!
timeout -k 5 "$limit" ip netns exec "$b" unshare --ipc bash -c "$host_b" &
pb=$!
wait $pa || true
wait $pb || true
sent() {  # bytes the shaper (or the device, unshaped) of namespace $1 passed
  ip -n "$1" -s link show "${1}v" | awk '/TX:/ {getline; print $1; exit}'
}
a_to_b=$(sent "$a")
codes=$(cat "$out"/codes-a "$out"/codes-b 2>/dev/null | tr '\n' ' ')
echo "ranks' exit codes (trainer 0 1, engine 0 1 in finishing order): $codes" | tee "$out/summary.txt"
if [ "$codes" != "0 0 0 0 " ] || [ ! -s "$out/report.json" ]; then
  echo "shaped_link.sh: the run failed; logs in $out" | tee -a "$out/summary.txt"
  tail -n 5 "$out"/t0.log "$out"/e0.log >&2 || true
  exit 1
fi
python3 - "$out/report.json" "$rate" "$a_to_b" "$steps" <<'PY' | tee -a "$out/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
rate, sent, steps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = r["config"]["model"]
steps_d = r.get("delta", {}).get("steps", [])
print(f"{'model':<14} {'rate':>7} {'step':>4} {'refit_s':>9} {'pause_s':>9} {'pause/refit':>11} {'bytes_per_refit':>16}"
      + (f" {'wire_bytes':>12} {'delta_pairs':>11} {'changed':>8} {'wire/step1':>10} {'time/step1':>10}"
         if steps_d else ""))
secs = r["refit_seconds"]
for i, s in enumerate(secs, 1):
    p = r["pause_seconds"][i - 1]
    line = f"{model:<14} {rate:>7} {i:>4} {s:>9.3f} {p:>9.3f} {p / s:>11.3f} {r['bytes_per_refit']:>16}"
    if len(steps_d) == len(secs):
        d, d1 = steps_d[i - 1], steps_d[0]
        line += (f" {d['wire_bytes']:>12} {d['pairs']:>11} {100 * d['changed_fraction']:>7.2f}%"
                 f" {d['wire_bytes'] / max(1, d1['wire_bytes']):>10.4f} {s / secs[0]:>10.3f}")
    print(line)
print(f"link A->B carried {sent} bytes over {steps} refit(s) and setup "
      f"({sent / max(1, steps * r['bytes_per_refit']):.3f} x bytes_per_refit x steps); "
      f"verified: {r['verified']}")
PY
