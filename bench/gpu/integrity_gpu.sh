#!/usr/bin/env bash
# refit.checksum and refit.keep_previous on one GPU (docs/runtime.md, "What checksums and rollback
# cost"): recovery cells with --verify (a corrupted step fails, the session goes on; with
# keep_previous every engine rank restores and verifies the previous version), then `refit bench`
# on qwen3-8b colocated (fp32 and bf16 trainers) with each off and on, in one run of the script.
# One GPU. One table last; logs in $REFIT_BENCH_OUT (default /tmp/refit-integrity_gpu):
# summary.txt, cells.log, bench.log.
#   bash scripts/build.sh && bash bench/gpu/integrity_gpu.sh
# Environment: REFIT_IG_STEPS (bench steps, default 8).
set -uo pipefail
source "$(dirname "$0")/common.sh"
: > "$summary"
steps=${REFIT_IG_STEPS:-8}
nvidia-smi -L | tee -a "$summary"

# cfg NAME MODEL DTYPE WORLD TP [REFIT_KEYS] — colocated vLLM, every rank on GPU 0.
cfg() {
  local f=$work/$1.yaml
  {
    echo "model: $2"
    echo "device: cuda"
    echo "policy: {backend: fsdp2, world_size: $4, dtype: $3}"
    echo "generation: {backend: vllm, colocated: true, num_engines: 1, tp_size: $5}"
    echo "refit: {buffer_size_bytes: 536870912, timeout_s: 120${6:-}}"
  } > "$f"
  echo "$f"
}

echo "== recovery cells"
: > "$out/cells.log"
# cell NAME WANT_TEXT COUNT_TEXT WANT_COUNT CONFIG ARGS...: must exit 1 naming WANT_TEXT, and print
# COUNT_TEXT WANT_COUNT times.
cell() {
  local name=$1 want=$2 count=$3 n=$4 f=$5; shift 5
  timeout 300 "$R" run "$f" "$@" > "$work/cell.log" 2>&1
  local rc=$? got
  got=$(grep -c "$count" "$work/cell.log")
  { echo "=== $name: $*"; cat "$f" "$work/cell.log"; echo; } >> "$out/cells.log"
  local ok=FAIL
  [ $rc = 1 ] && grep -q "$want" "$work/cell.log" && [ "$got" = "$n" ] && ok=ok
  note "$(printf 'cell %-58s rc=%s %s (%s x "%s")' "$name" "$rc" "$ok" "$got" "$count")"
}
cell "w1 tp1 tiny-qwen3, checksum, corrupt:0:2" "1 of 3 refit(s) failed (steps 2)" \
  "weights are invalid and generation stays paused" 1 \
  "$(cfg r1 tiny-qwen3 float32 1 1 ', checksum: true')" --steps 3 --verify --fault corrupt:0:2
cell "w1 tp1 qwen2.5-0.5b, checksum + keep_previous, corrupt:0:2" "1 of 3 refit(s) failed (steps 2)" \
  "weights kept after the failed refit (version '1') verified bit-exact" 1 \
  "$(cfg r2 qwen2.5-0.5b bfloat16 1 1 ', checksum: true, keep_previous: true')" --steps 3 --verify --fault corrupt:0:2
cell "w1 tp1 tiny-moe, keep_previous, verify fails step 1 (rolls back to 0)" "1 of 2 refit(s) failed (steps 1)" \
  "weights kept after the failed refit (version '0') verified bit-exact" 1 \
  "$(cfg r3 tiny-moe float32 1 1 ', keep_previous: true')" --steps 2 --verify --fault corrupt:0:1

echo "== benchmarks"
: > "$out/bench.log"
bench() {  # NAME CONFIG
  timeout 400 "$R" bench "$2" --steps "$steps" --json "$work/bench-$1.json" >> "$out/bench.log" 2>&1
  note "$(printf 'bench %-34s rc=%s' "$1" "$?")"
}
bench 8b-fp32 "$(cfg b1 qwen3-8b float32 1 1)"
bench 8b-fp32-checksum "$(cfg b2 qwen3-8b float32 1 1 ', checksum: true')"
bench 8b-fp32-keep "$(cfg b3 qwen3-8b float32 1 1 ', keep_previous: true')"
bench 8b-bf16 "$(cfg b4 qwen3-8b bfloat16 1 1)"
bench 8b-bf16-checksum "$(cfg b5 qwen3-8b bfloat16 1 1 ', checksum: true')"
bench 8b-bf16-keep "$(cfg b6 qwen3-8b bfloat16 1 1 ', keep_previous: true')"

echo "== table"
python3 - "$work" <<'PY' | tee -a "$summary"
import glob, json, os, statistics, sys
res = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "bench-*.json"))):
    j = json.load(open(f))
    res[os.path.basename(f)[6:-5]] = (statistics.median(j["refit_seconds"]) * 1e3,
                                      j.get("ratio_to_floor", 0))
print(f"{'cell':22} {'ms':>8} {'floor ratio':>11} {'vs off':>8}")
for name, (ms, ratio) in res.items():
    base = res.get(name.split("-checksum")[0].split("-keep")[0], (ms, 0))[0]
    print(f"{name:22} {ms:8.2f} {ratio:11.2f} {ms / base:8.3f}")
PY
