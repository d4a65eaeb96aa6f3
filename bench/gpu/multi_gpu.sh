#!/usr/bin/env bash
# Non-colocated refit on several GPUs of one host: trainer ranks on the first GPUs, engine ranks on
# the next ones. Cells run the transfer plan (refit.executor auto: peer access over NVLink); every
# benchmark runs twice, as the transfer plan and as the full-bucket broadcast (executor gather:
# NCCL unshard + broadcast), and the table gives the plan's speed-up over the broadcast.
#  - cells: `refit run --verify` (and --check-logits where cheap) on tiny models for every split
#    the GPU count allows: FSDP2 → SGLang / vLLM with 1 trainer GPU + 1 engine GPU; with ≥ 4 GPUs
#    multi-rank FSDP2 (world 2 and 3) and Megatron TP 2 → both protocols with 2 engines; with 8
#    GPUs larger splits (FSDP2 world 4 → 2 engines TP 2, Megatron TP 2 × EP 2 / TP 2 × PP 2,
#    3 engines); faults (corruption, a killed engine, a killed trainer rank).
#  - bench: `refit bench` (GB/s, ratio to the floor) on qwen3-8b (fp32 and bf16 trainer) and
#    qwen3-30b-a3b (bf16) shapes, FSDP2 world 1 → one engine TP 1 (2 GPUs); with ≥ 4 GPUs also
#    → TP 2 and FSDP2 world 2 → TP 2; with 8 GPUs → TP 4; each shape verified at that scale
#    first, and the PyTorch packed-broadcast baseline (bench/baselines/torch_broadcast.py) on the
#    same shapes, GPUs and bucket size.
# One table last; logs in $REFIT_BENCH_OUT (default /tmp/refit-multi-gpu): summary.txt,
# topology.txt, cells.log, bench.log, torch.log, results.json.
#
#   bash scripts/build.sh && bash bench/gpu/multi_gpu.sh
#   REFIT_MG_PARTS=cells bash bench/gpu/multi_gpu.sh     # one part only (4 or 8 GPUs: each part
#   REFIT_MG_PARTS=bench bash bench/gpu/multi_gpu.sh     # takes several minutes)
#
# Environment: REFIT_MG_PARTS ("cells bench", or one of them), REFIT_MG_GPUS (default: the count
# nvidia-smi -L lists), REFIT_MG_SHAPES (default "qwen3-8b:float32 qwen3-8b:bfloat16
# qwen3-30b-a3b:bfloat16"), REFIT_MG_BUCKET (bench bucket bytes, default 512 MiB),
# REFIT_MG_PYTHON (an interpreter with torch, default python3), and REFIT_MG_DEVICE=cpu: a dry
# run of the same configs (and the baseline) on Gloo, on a machine without GPUs.
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-multi-gpu
dev=${REFIT_MG_DEVICE:-cuda}
parts=${REFIT_MG_PARTS:-"cells bench"}
has() { [[ " $parts " == *" $1 "* ]]; }
shapes=${REFIT_MG_SHAPES:-"qwen3-8b:float32 qwen3-8b:bfloat16 qwen3-30b-a3b:bfloat16"}
bench_buf=${REFIT_MG_BUCKET:-536870912}
py=${REFIT_MG_PYTHON:-python3}  # with torch
: > "$summary"

if [ "$dev" = cuda ]; then
  nvidia-smi -L | tee -a "$summary"
  nvidia-smi topo -m > "$out/topology.txt" 2>&1
  note "nccl from: $nccl_dir"
fi
gpus=${REFIT_MG_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
note "GPUs: $gpus, device: $dev, parts: $parts, refit: $R"
if [ "$gpus" -lt 2 ]; then
  note "non-colocated cells need 2 GPUs (NCCL refuses two ranks of one group on one GPU)"
  exit 1
fi

# cfg TAG MODEL POLICY WORLD MEGATRON ENGINE ENGINES TP DTYPE [BUF] [TIMEOUT_S]
# MEGATRON is "tp,pp,ep" or "-". The file records the GPUs the cell needs: WORLD + ENGINES*TP.
cfg() {
  local f=$work/$1.yaml mg="" mtp mpp mep
  if [ "$5" != - ]; then
    IFS=, read -r mtp mpp mep <<< "$5"
    mg=", megatron: {tp: $mtp, pp: $mpp, ep: $mep}"
  fi
  {
    echo "# gpus: $(($4 + $7 * $8))"
    echo "model: $2"; echo "device: $dev"
    echo "policy: {backend: $3, world_size: $4, dtype: $9$mg}"
    echo "generation: {backend: $6, colocated: false, weight_transfer_mode: broadcast, num_engines: $7, tp_size: $8}"
    echo "refit: {buffer_size_bytes: ${10:-268435456}, num_buffers: 2, timeout_s: ${11:-60}, executor: ${EXEC:-auto}}"
  } > "$f"
  echo "$f"
}
need() { sed -n 's/^# gpus: //p' "$1"; }

# cell NAME WANT CONFIG ARGS... — WANT: 0, "fail", or "fail:TEXT" (non-zero exit naming TEXT).
cell() {
  local name=$1 want=$2 f=$3; shift 3
  local n; n=$(need "$f")
  if [ "$n" -gt "$gpus" ]; then
    note "$(printf 'cell %-58s skipped (needs %s GPUs)' "$name" "$n")"
    return
  fi
  local log=$work/cell.log start
  start=$(date +%s.%N)
  timeout 300 "$R" run "$f" "$@" > "$log" 2>&1
  local rc=$? ok=FAIL
  case $want in
    0) [ $rc = 0 ] && ok=ok ;;
    fail) [ $rc != 0 ] && ok=ok ;;
    fail:*) [ $rc != 0 ] && grep -q -- "${want#fail:}" "$log" && ok=ok ;;
  esac
  { echo "=== $name ($n GPUs): $R run $f $*"; cat "$f" "$log"; echo; } >> "$out/cells.log"
  note "$(printf 'cell %-58s rc=%-3s %-4s (%s s)' "$name" "$rc" "$ok" \
    "$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}")")"
  if [ $ok != ok ]; then
    grep -E 'error|failed|FAIL|abort' "$log" | head -3 | cut -c1-300 | sed 's/^/    /' | tee -a "$summary"
  elif [ "$want" != 0 ]; then  # how the expected failure was reported
    grep -m1 -E 'run failed|verify:|killed' "$log" | cut -c1-300 | sed 's/^/    /' | tee -a "$summary"
  fi
}

if has cells; then
  echo "== cells (non-colocated, device: $dev)"
  : > "$out/cells.log"
  # 2 GPUs: trainer on GPU 0, one engine (TP 1) on GPU 1.
  cell "fsdp2 w1 -> sglang tp1, tiny-qwen3" 0 \
    "$(cfg a1 tiny-qwen3 fsdp2 1 - sglang 1 1 float32)" --steps 3 --verify --check-logits
  cell "fsdp2 w1 -> vllm tp1, tiny-moe" 0 \
    "$(cfg a2 tiny-moe fsdp2 1 - vllm 1 1 float32)" --steps 3 --verify --check-logits
  cell "fsdp2 w1 -> vllm tp1, tiny-moe bf16, 64 KiB buckets" 0 \
    "$(cfg a3 tiny-moe fsdp2 1 - vllm 1 1 bfloat16 65536)" --steps 3 --verify
  cell "fsdp2 w1 -> sglang tp1, qwen2.5-0.5b, 16 MiB buckets" 0 \
    "$(cfg a4 qwen2.5-0.5b fsdp2 1 - sglang 1 1 float32 16777216)" --steps 2 --verify
  cell "megatron w1 -> vllm tp1, tiny-qwen2" 0 \
    "$(cfg a5 tiny-qwen2 megatron 1 1,1,1 vllm 1 1 float32)" --steps 3 --verify --check-logits
  cell "corrupt:1 must fail naming the tensor" fail:"verify:" \
    "$(cfg f1 tiny-qwen3 fsdp2 1 - vllm 1 1 float32 4096 20)" --steps 1 --verify --fault corrupt:1
  cell "killed engine: every rank exits" fail \
    "$(cfg f2 tiny-qwen3 fsdp2 1 - sglang 1 1 float32 4096 20)" --steps 2 --fault kill-engine:0:3
  # 4 GPUs: multi-rank FSDP2 unsharding over NCCL; Megatron TP 2 with 2 engines.
  cell "fsdp2 w2 -> sglang tp2, qwen2.5-0.5b (the seed's cell)" 0 \
    "$(cfg b1 qwen2.5-0.5b fsdp2 2 - sglang 1 2 float32)" --steps 3 --verify
  cell "fsdp2 w2 -> vllm tp2, tiny-moe" 0 \
    "$(cfg b2 tiny-moe fsdp2 2 - vllm 1 2 float32)" --steps 3 --verify --check-logits
  cell "fsdp2 w2 -> sglang tp2, tiny-qwen3 bf16, 4 KiB buckets" 0 \
    "$(cfg b3 tiny-qwen3 fsdp2 2 - sglang 1 2 bfloat16 4096)" --steps 2 --verify
  cell "fsdp2 w3 (uneven chunks) -> vllm tp1, tiny-qwen3" 0 \
    "$(cfg b4 tiny-qwen3 fsdp2 3 - vllm 1 1 float32)" --steps 3 --verify --check-logits
  cell "megatron tp2 -> sglang 2 engines tp1, tiny-qwen2" 0 \
    "$(cfg b5 tiny-qwen2 megatron 2 2,1,1 sglang 2 1 float32)" --steps 3 --verify --check-logits
  cell "megatron tp2 -> vllm 2 engines tp1, tiny-moe" 0 \
    "$(cfg b6 tiny-moe megatron 2 2,1,1 vllm 2 1 float32)" --steps 3 --verify --check-logits
  cell "w2, killed trainer rank 1: every rank exits" fail \
    "$(cfg f3 tiny-qwen3 fsdp2 2 - vllm 1 2 float32 4096 20)" --steps 2 --fault kill-trainer:1:2
  # 8 GPUs: larger splits.
  cell "fsdp2 w4 -> sglang 2 engines tp2, qwen3-0.6b" 0 \
    "$(cfg c1 qwen3-0.6b fsdp2 4 - sglang 2 2 float32)" --steps 2 --verify
  cell "megatron tp2 ep2 (w4) -> vllm 2 engines tp2, tiny-moe" 0 \
    "$(cfg c2 tiny-moe megatron 4 2,1,2 vllm 2 2 float32)" --steps 3 --verify --check-logits
  cell "megatron tp2 pp2 (w4) -> sglang tp4, tiny-llama" 0 \
    "$(cfg c3 tiny-llama megatron 4 2,2,1 sglang 1 4 float32)" --steps 3 --verify --check-logits
  cell "fsdp2 w2 -> vllm 3 engines tp2, qwen2.5-0.5b" 0 \
    "$(cfg c4 qwen2.5-0.5b fsdp2 2 - vllm 3 2 float32)" --steps 2 --verify
fi

if has bench; then
  echo "== benchmarks (bucket $bench_buf bytes, vLLM protocol)"
  : > "$out/bench.log"
  : > "$out/torch.log"
  # Splits "world:engines:tp" this host allows (GPUs = world + engines*tp).
  splits="1:1:1"
  [ "$gpus" -ge 4 ] && splits="$splits 1:1:2 2:1:2"
  [ "$gpus" -ge 8 ] && splits="$splits 1:1:4"
  for shape in $shapes; do
    model=${shape%%:*} dtype=${shape#*:}
    for split in $splits; do
      IFS=: read -r w e tp <<< "$split"
      # The transfer plan (executor auto) and the full-bucket broadcast (gather), same run.
      for ex in auto gather; do
        label=$model-$dtype-w$w-e$e-tp$tp-$ex
        f=$(EXEC=$ex cfg "$label" "$model" fsdp2 "$w" - vllm "$e" "$tp" "$dtype" "$bench_buf" 120)
        timeout 400 "$R" run "$f" --steps 1 --verify >> "$out/bench.log" 2>&1
        note "$(printf '%-46s verify rc=%s' "$label" "$?")"
        timeout 400 "$R" bench "$f" --steps 5 --json "$work/bench-$label.json" >> "$out/bench.log" 2>&1
        note "$(printf '%-46s bench  rc=%s' "$label" "$?")"
      done
      # The PyTorch method on the same GPUs: trainer GPU 0, every engine GPU a receiver.
      egpus=$((e * tp))
      tj=$work/torch-$model-$dtype-g$egpus.json
      if [ ! -f "$tj" ]; then
        timeout 500 "$py" "$root/bench/baselines/torch_broadcast.py" --device "$dev" --refit "$R" \
          --model "$model" --trainer-dtype "$dtype" --engines "$egpus" \
          --bucket-bytes "$bench_buf" --steps 5 --json "$tj" >> "$out/torch.log" 2>&1
        note "$(printf '%-40s torch  rc=%s' "$model-$dtype-1+$egpus" "$?")"
      fi
    done
  done
fi

echo "== table"
python3 - "$out" "$work" "$(nvidia-smi -L 2>/dev/null | head -1 | sed 's/ (UUID.*//')" <<'PY' | tee -a "$summary"
import glob, json, os, statistics, sys
out, work, gpu = sys.argv[1], sys.argv[2], sys.argv[3]
rows, results, by_case = [], [], {}
for f in sorted(glob.glob(os.path.join(work, "bench-*.json"))):
    j = json.load(open(f))
    label = os.path.basename(f)[6:-5]
    model, dtype, w, e, tp, ex = label.rsplit("-", 5)
    w, e, tp = int(w[1:]), int(e[1:]), int(tp[2:])
    ms = statistics.median(j["refit_seconds"]) * 1e3
    by_case[(model, dtype, w, e, tp, ex)] = ms
    tf = os.path.join(work, f"torch-{model}-{dtype}-g{e * tp}.json")
    t = json.load(open(tf)) if os.path.exists(tf) else {}
    rows.append((model, dtype, w, e, tp, ex, ms, j["gbps"], j.get("ratio_to_floor", 0),
                 t.get("ms")))
    results.append({"case": label, "refit": j, "torch": t})
json.dump({"gpu": gpu, "rows": results}, open(os.path.join(out, "results.json"), "w"), indent=1)
print(f"machine: {gpu or 'no GPU'}")
print(f"{'shape':24} {'GPUs: trainer+engines x tp':>27} {'executor':>8} {'refit ms':>9} {'GB/s':>7} "
      f"{'floor/refit':>11} {'vs gather':>9} {'torch ms':>9} {'vs torch':>8}")
for model, dtype, w, e, tp, ex, ms, gb, floor, tms in rows:
    g = by_case.get((model, dtype, w, e, tp, "gather"))
    vs_g = f"{g / ms:8.2f}x" if g and ex != "gather" else f"{'-':>9}"
    tcol = f"{tms:9.2f} {tms / ms:7.2f}x" if tms else f"{'-':>9} {'-':>8}"
    print(f"{model + ' ' + dtype:24} {f'{w}+{e}x{tp} ({w + e * tp})':>27} {ex:>8} {ms:9.2f} "
          f"{gb:7.1f} {floor:11.2f} {vs_g} {tcol}")
PY
