#!/usr/bin/env bash
# The transfer plan on 2 GPUs of one host: cells with --verify (and --check-logits on tiny models),
# faults, then `refit bench` on the targets' shapes against the plan-aware floor, and the PyTorch
# baselines on the same GPUs (torch in python3). Two GPUs. One table last; logs in
# $REFIT_BENCH_OUT (default /tmp/refit-plan-gpu): summary.txt, cells.log, bench.log, torch.log,
# results.json, topology.txt.
#
#   bash scripts/build.sh && bash bench/gpu/plan_gpu.sh
#
# Environment: REFIT_PG_PARTS (default "cells bench torch"; "fp8": FP8 engines on 2 GPUs, cells
# with --verify and benches, docs/fp8.md), REFIT_PG_BENCH (space-separated bench
# names to run, default all), REFIT_PG_STEPS (bench steps, default 5).
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-plan-gpu
: > "$summary"
parts=${REFIT_PG_PARTS:-"cells bench torch"}
steps=${REFIT_PG_STEPS:-5}
has() { [[ " $parts " == *" $1 "* ]]; }
want_bench() { [ -z "${REFIT_PG_BENCH:-}" ] || [[ " $REFIT_PG_BENCH " == *" $1 "* ]]; }

nvidia-smi -L | tee -a "$summary"
nvidia-smi topo -m > "$out/topology.txt" 2>&1
note "nccl: $(ls "$nccl_dir"/libnccl.so.2* 2>/dev/null | head -1)"

# cfg NAME MODEL POLICY WORLD MEGATRON ENGINE COLOCATED ENGINES TP DTYPE EXECUTOR [BUF] [TIMEOUT]
#     [REFIT_KEYS]
# MEGATRON is "tp,pp,ep" or "-"; REFIT_KEYS more keys of the refit section (", checksum: true").
cfg() {
  local f=$work/$1.yaml mg="" mtp mpp mep
  if [ "$5" != - ]; then
    IFS=, read -r mtp mpp mep <<< "$5"
    mg=", megatron: {tp: $mtp, pp: $mpp, ep: $mep}"
  fi
  {
    echo "model: $2"
    echo "device: cuda"
    echo "policy: {backend: $3, world_size: $4, dtype: ${10}$mg}"
    echo "generation: {backend: $6, colocated: $7, num_engines: $8, tp_size: $9}"
    echo "refit: {buffer_size_bytes: ${12:-536870912}, num_buffers: 2, timeout_s: ${13:-60}, executor: ${11}${14:-}}"
  } > "$f"
  echo "$f"
}

# cell NAME WANT CONFIG ARGS... — WANT: 0, or "fail:TEXT" (non-zero exit naming TEXT).
cell() {
  local name=$1 want=$2 f=$3; shift 3
  local log=$work/cell.log start
  start=$(date +%s.%N)
  timeout 180 "$R" run "$f" "$@" > "$log" 2>&1
  local rc=$? ok=FAIL
  case $want in
    0) [ $rc = 0 ] && ok=ok ;;
    fail:*) [ $rc != 0 ] && [ $rc != 124 ] && grep -q -- "${want#fail:}" "$log" && ok=ok ;;
  esac
  { echo "=== $name: $R run $f $*"; cat "$f" "$log"; echo; } >> "$out/cells.log"
  note "$(printf 'cell %-62s rc=%-3s %-4s (%s s) %s' "$name" "$rc" "$ok" \
    "$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}")" \
    "$(grep -m1 -o 'pairs by executor: .*' "$log")")"
  if [ $ok != ok ]; then
    grep -E 'error|failed|FAIL|abort' "$log" | head -3 | cut -c1-300 | sed 's/^/    /' | tee -a "$summary"
  elif [ "$want" != 0 ]; then
    grep -m1 -E 'run failed|verify:|killed' "$log" | cut -c1-300 | sed 's/^/    /' | tee -a "$summary"
  fi
}

if has cells; then
  echo "== cells"
  : > "$out/cells.log"
  cell "colocated fsdp2 w2 -> sglang tp2, tiny-qwen3 (auto)" 0 \
    "$(cfg c1 tiny-qwen3 fsdp2 2 - sglang true 1 2 float32 auto)" --steps 3 --verify --check-logits
  cell "colocated fsdp2 w2 -> vllm 2 engines tp1, tiny-moe (auto)" 0 \
    "$(cfg c2 tiny-moe fsdp2 2 - vllm true 2 1 float32 auto)" --steps 3 --verify --check-logits
  cell "colocated megatron tp2 -> vllm tp2, tiny-qwen2 (auto)" 0 \
    "$(cfg c3 tiny-qwen2 megatron 2 2,1,1 vllm true 1 2 float32 auto)" --steps 3 --verify --check-logits
  cell "colocated fsdp2 w2 -> sglang tp2, qwen2.5-0.5b bf16 (peer)" 0 \
    "$(cfg c4 qwen2.5-0.5b fsdp2 2 - sglang true 1 2 bfloat16 peer)" --steps 2 --verify
  cell "colocated fsdp2 w1 -> vllm tp1 (1 GPU), tiny-qwen3 (auto)" 0 \
    "$(cfg c5 tiny-qwen3 fsdp2 1 - vllm true 1 1 float32 auto)" --steps 3 --verify --check-logits
  cell "non-colocated fsdp2 w1 -> sglang tp1, tiny-qwen3 (auto: peer over NVLink)" 0 \
    "$(cfg n1 tiny-qwen3 fsdp2 1 - sglang false 1 1 float32 auto)" --steps 3 --verify --check-logits
  cell "non-colocated fsdp2 w1 -> vllm tp1, tiny-moe (p2p NCCL, 4 KiB rounds)" 0 \
    "$(cfg n2 tiny-moe fsdp2 1 - vllm false 1 1 float32 p2p 4096)" --steps 3 --verify --check-logits
  cell "non-colocated fsdp2 w1 -> sglang tp1, tiny-qwen3 (p2p NCCL, route metadata)" 0 \
    "$(cfg n5 tiny-qwen3 fsdp2 1 - sglang false 1 1 float32 p2p 8192)" --steps 3 --verify --check-logits
  cell "non-colocated megatron w1 -> vllm tp1, tiny-qwen2 (p2p NCCL)" 0 \
    "$(cfg n3 tiny-qwen2 megatron 1 1,1,1 vllm false 1 1 float32 p2p 65536)" --steps 2 --verify
  cell "non-colocated fsdp2 w1 -> sglang tp1, tiny-qwen3 (gather: NCCL broadcast)" 0 \
    "$(cfg n4 tiny-qwen3 fsdp2 1 - sglang false 1 1 float32 gather)" --steps 2 --verify
  # Large contiguous routes into the other GPU: the copy engines move half the bytes beside the
  # kernel (REFIT_COPY_ENGINE=auto); the debug log names the split, and --verify checks every byte.
  REFIT_LOG=debug cell "non-colocated fsdp2 w1 -> vllm tp1, qwen3-8b bf16 (copy engines beside the kernel)" 0 \
    "$(cfg n6 qwen3-8b fsdp2 1 - vllm false 1 1 bfloat16 auto)" --steps 2 --verify
  note "$(printf '     copy lists split onto the copy engines: %s' \
    "$(grep -c 'on the copy engines' "$work/cell.log")")"
  # refit.checksum and recovery: the corrupted step fails, the session goes on and the next steps
  # verify; with keep_previous every engine rank restores (and verifies) the previous version.
  cell "non-colocated p2p, checksum: corrupt:1:2 caught, steps 1 and 3 verify" \
    "fail:1 of 3 refit(s) failed (steps 2); the session went on" \
    "$(cfg r1 tiny-qwen3 fsdp2 1 - sglang false 1 1 float32 p2p 8192 60 ', checksum: true')" \
    --steps 3 --verify --fault corrupt:1:2
  cell "colocated w2 tp2 peer, checksum + keep_previous: corrupt:0:2 rolled back" \
    "fail:1 of 3 refit(s) failed (steps 2); the session went on" \
    "$(cfg r2 tiny-qwen3 fsdp2 2 - vllm true 1 2 float32 auto 4096 60 ', checksum: true, keep_previous: true')" \
    --steps 3 --verify --fault corrupt:0:2
  note "    rolled-back weights verified on $(grep -o 'weights kept after the failed refit (version' "$work/cell.log" | wc -l) engine rank(s) (want 2)"
  # A refit an engine rank refuses (its pause hook fails, or outlasts the timeout) is aborted by
  # every trainer rank before any byte moves; the session's other steps verify.
  cell "colocated w2 tp2 peer: fail-pause:1:2 aborted, steps 1 and 3 verify" \
    "fail:1 of 3 refit(s) failed (steps 2); the session went on" \
    "$(cfg r3 tiny-qwen3 fsdp2 2 - vllm true 1 2 float32 auto 4096 20)" --steps 3 --verify --fault fail-pause:1:2
  # (grep -o: the two engine ranks' log lines may interleave on one line)
  note "    engine ranks that kept their version: $(grep -o 'was aborted before any byte landed' "$work/cell.log" | wc -l) (want 2)"
  cell "non-colocated p2p: slow-pause:0:1 (1.5 x timeout 4 s) aborted, steps 2 and 3 verify" \
    "fail:1 of 3 refit(s) failed (steps 1); the session went on" \
    "$(cfg r4 tiny-qwen3 fsdp2 1 - sglang false 1 1 float32 p2p 8192 4)" --steps 3 --verify --fault slow-pause:0:1
  cell "colocated w2 tp2, corrupt:0 must fail naming the tensor" "fail:verify:" \
    "$(cfg f1 tiny-qwen3 fsdp2 2 - vllm true 1 2 float32 auto 4096 20)" --steps 1 --verify --fault corrupt:0
  cell "colocated w2 tp2, killed engine rank 1: every rank exits" "fail:killed by signal 9" \
    "$(cfg f2 tiny-qwen3 fsdp2 2 - vllm true 1 2 float32 auto 4096 20)" --steps 2 --fault kill-engine:1:0
  cell "non-colocated p2p, killed trainer rank 0: every rank exits" "fail:killed by signal 9" \
    "$(cfg f3 tiny-qwen3 fsdp2 1 - vllm false 1 1 float32 p2p 4096 20)" --steps 2 --fault kill-trainer:0:2
fi

# bench NAME CONFIG [VAR=VALUE ...]
bench() {
  want_bench "$1" || return 0
  local name=$1 f=$2; shift 2
  echo "=== $name $*" >> "$out/bench.log"
  env "$@" timeout 300 "$R" bench "$f" --steps "$steps" --json "$work/bench-$name.json" >> "$out/bench.log" 2>&1
  local rc=$?
  note "$(printf 'bench %-40s rc=%s' "$name" "$rc")"
  [ $rc = 0 ] || tail -5 "$out/bench.log" | cut -c1-300 | sed 's/^/    /' | tee -a "$summary"
}

if has bench; then
  echo "== benchmarks"
  : > "$out/bench.log"
  bench colo-w2-tp2-8b-fp32 "$(cfg b1 qwen3-8b fsdp2 2 - vllm true 1 2 float32 auto)"
  bench colo-w2-tp2-30b-bf16 "$(cfg b2 qwen3-30b-a3b fsdp2 2 - vllm true 1 2 bfloat16 auto)"
  bench colo-meg-tp2-tp2-8b-bf16 "$(cfg b3 qwen3-8b megatron 2 2,1,1 vllm true 1 2 bfloat16 auto)"
  bench colo-w2-2xtp1-8b-fp32 "$(cfg b4 qwen3-8b fsdp2 2 - vllm true 2 1 float32 auto)"
  bench noncolo-1to1-8b-fp32 "$(cfg b5 qwen3-8b fsdp2 1 - vllm false 1 1 float32 auto)"
  bench noncolo-1to1-8b-bf16 "$(cfg b6 qwen3-8b fsdp2 1 - vllm false 1 1 bfloat16 auto)"
  bench noncolo-1to1-8b-bf16-p2p "$(cfg b7 qwen3-8b fsdp2 1 - vllm false 1 1 bfloat16 p2p)"
  bench colo-1gpu-8b-fp32 "$(cfg b8 qwen3-8b fsdp2 1 - vllm true 1 1 float32 auto)"
  # REFIT_COPY_ENGINE: the copy engines alone (1) and the kernel alone (0) instead of the default
  # (auto: the copy engines beside the kernel into another GPU's memory).
  bench noncolo-1to1-8b-bf16-ce "$(cfg b9 qwen3-8b fsdp2 1 - vllm false 1 1 bfloat16 auto)" REFIT_COPY_ENGINE=1
  bench noncolo-1to1-8b-bf16-kernel "$(cfg b12 qwen3-8b fsdp2 1 - vllm false 1 1 bfloat16 auto)" REFIT_COPY_ENGINE=0
  bench colo-w2-tp2-8b-bf16-ce "$(cfg b10 qwen3-8b fsdp2 2 - vllm true 1 2 bfloat16 auto)" REFIT_COPY_ENGINE=1
  bench colo-w2-tp2-8b-bf16 "$(cfg b11 qwen3-8b fsdp2 2 - vllm true 1 2 bfloat16 auto)"
  # The cost of refit.checksum and refit.keep_previous (docs/runtime.md).
  bench colo-1gpu-8b-fp32-checksum "$(cfg b13 qwen3-8b fsdp2 1 - vllm true 1 1 float32 auto '' '' ', checksum: true')"
  bench colo-1gpu-8b-fp32-keep "$(cfg b14 qwen3-8b fsdp2 1 - vllm true 1 1 float32 auto '' '' ', keep_previous: true')"
  bench noncolo-1to1-8b-bf16-checksum "$(cfg b15 qwen3-8b fsdp2 1 - vllm false 1 1 bfloat16 auto '' '' ', checksum: true')"
  bench colo-w2-tp2-8b-bf16-checksum "$(cfg b16 qwen3-8b fsdp2 2 - vllm true 1 2 bfloat16 auto '' '' ', checksum: true')"
fi

# FP8 engines on 2 GPUs: colocated world 2 -> TP 2 and non-colocated 1 -> 1 through
# the transfer plan, verified against the reference quantizer; benches whose engine ranks' bytes
# received (the table) are the bytes on the link; torch's quantize of the same elements.
fp8=", target_precision: fp8"
if has fp8; then
  echo "== fp8 cells"
  : > "$out/cells.log"
  cell "fp8 colocated fsdp2 w2 -> vllm tp2, tiny-qwen3 (auto)" 0 \
    "$(cfg e1 tiny-qwen3 fsdp2 2 - vllm true 1 2 float32 auto '' '' "$fp8, fp8: {block: [16, 16]}")" --steps 2 --verify --check-logits
  cell "fp8 colocated megatron tp2 -> sglang tp2, tiny-qwen3 (auto)" 0 \
    "$(cfg e2 tiny-qwen3 megatron 2 2,1,1 sglang true 1 2 float32 auto '' '' "$fp8, fp8: {block: [16, 16]}")" --steps 2 --verify
  cell "fp8 non-colocated fsdp2 w1 -> vllm tp1, tiny-qwen3 (peer over NVLink)" 0 \
    "$(cfg e3 tiny-qwen3 fsdp2 1 - vllm false 1 1 float32 auto '' '' "$fp8, fp8: {block: [16, 16]}")" --steps 2 --verify
  cell "fp8 non-colocated fsdp2 w1 -> sglang tp1, tiny-qwen3 (p2p NCCL)" 0 \
    "$(cfg e4 tiny-qwen3 fsdp2 1 - sglang false 1 1 float32 p2p 4096 '' "$fp8, fp8: {block: [16, 16]}")" --steps 2 --verify
  echo "== fp8 benchmarks"
  : > "$out/bench.log"
  bench fp8-colo-w2-tp2-8b-bf16 "$(cfg g1 qwen3-8b fsdp2 2 - vllm true 1 2 bfloat16 auto '' '' "$fp8")"
  bench bf16-colo-w2-tp2-8b-bf16 "$(cfg g2 qwen3-8b fsdp2 2 - vllm true 1 2 bfloat16 auto)"
  bench fp8-noncolo-1to1-8b-bf16 "$(cfg g3 qwen3-8b fsdp2 1 - vllm false 1 1 bfloat16 auto '' '' "$fp8")"
  bench bf16-noncolo-1to1-8b-bf16 "$(cfg g4 qwen3-8b fsdp2 1 - vllm false 1 1 bfloat16 auto)"
  bench fp8-noncolo-1to1-8b-bf16-p2p "$(cfg g5 qwen3-8b fsdp2 1 - vllm false 1 1 bfloat16 p2p '' '' "$fp8")"
  mkdir -p "$work/q8" && python3 -c "
import json; json.dump({'architectures': ['Qwen3ForCausalLM'], 'hidden_size': 4096, 'num_hidden_layers': 36,
  'num_attention_heads': 32, 'num_key_value_heads': 8, 'head_dim': 128, 'intermediate_size': 12288,
  'vocab_size': 4096, 'tie_word_embeddings': False}, open('$work/q8/config.json', 'w'))"
  python3 "$root/bench/gpu/fp8_torch.py" baseline "$work/q8/config.json" > "$out/torch-fp8.log" 2>&1
  note "$(tail -1 "$out/torch-fp8.log")"
fi

if has torch; then
  echo "== PyTorch baselines"
  : > "$out/torch.log"
  for s in qwen3-8b:float32 qwen3-30b-a3b:bfloat16; do
    m=${s%%:*} d=${s#*:}
    timeout 240 python3 "$root/bench/baselines/torch_shard.py" --refit "$R" --model "$m" \
      --trainer-dtype "$d" --json "$work/torch-shard-$m-$d.json" >> "$out/torch.log" 2>&1
    note "torch shard-to-shard $m $d rc=$?"
  done
  for d in float32 bfloat16; do
    timeout 240 python3 "$root/bench/baselines/torch_broadcast.py" --device cuda --refit "$R" \
      --model qwen3-8b --trainer-dtype "$d" --engines 1 --bucket-bytes 536870912 --steps 5 \
      --json "$work/torch-bcast-qwen3-8b-$d.json" >> "$out/torch.log" 2>&1
    note "torch packed broadcast qwen3-8b $d rc=$?"
  done
fi

echo "== table"
python3 - "$out" "$work" <<'PY' | tee -a "$summary"
import glob, json, os, statistics, sys
out, work = sys.argv[1], sys.argv[2]
res = {}
print(f"{'cell':30} {'ms':>8} {'floor ms':>8} {'ratio':>6} {'ovl ms':>7} {'ratio':>6} {'raw ms':>7} {'GB/s':>7} {'peer GB/s':>9}  pairs / bytes received per engine rank")
for f in sorted(glob.glob(os.path.join(work, "bench-*.json"))):
    j = json.load(open(f))
    name = os.path.basename(f)[6:-5]
    ms = statistics.median(j["refit_seconds"]) * 1e3
    raw = statistics.median(j.get("raw_seconds", [0])) * 1e3
    ranks = j.get("ranks", [])
    pairs = sum(r.get("peer_pairs", 0) for r in ranks if r["role"] == "trainer"), \
        sum(r.get("p2p_pairs", 0) for r in ranks if r["role"] == "trainer")
    recv = " ".join(f"{r['bytes_received'] / 1e9:.2f}GB" for r in ranks if r["role"] == "engine")
    print(f"{name:30} {ms:8.2f} {j.get('floor_seconds', 0) * 1e3:8.2f} "
          f"{j.get('ratio_to_floor', 0):6.2f} {j.get('floor_overlap_seconds', 0) * 1e3:7.2f} "
          f"{j.get('ratio_to_overlap_floor', 0):6.2f} {raw:7.2f} {j['gbps']:7.1f} "
          f"{j.get('peer_bandwidth_gbps', 0):9.1f}  peer {pairs[0]} p2p {pairs[1]}; {recv}")
    res[name] = j
for f in sorted(glob.glob(os.path.join(work, "torch-*.json"))):
    j = json.load(open(f))
    name = os.path.basename(f)[:-5]
    print(f"{name:40} {j.get('ms', 0):8.2f} ms")
    res[name] = j
json.dump(res, open(os.path.join(out, "results.json"), "w"), indent=1)
PY
