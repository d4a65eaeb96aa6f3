#!/usr/bin/env bash
# FP8 engines on one GPU (docs/fp8.md): the CUDA amax / quantize kernels against the CPU reference
# (refit_tests Fp8Plane), FP8 refits of one layer of qwen3-8b and qwen3-30b-a3b shapes dumped and
# compared with torch's float8_e4m3fn quantizer, colocated cells with --verify, and `refit bench`
# of qwen3-8b bf16 -> fp8 and -> bf16 against the floor, beside torch's blockwise quantize (torch
# in python3). Logs in $REFIT_BENCH_OUT (default /tmp/refit-fp8).
#   bash scripts/build.sh && bash bench/gpu/fp8_gpu.sh
# REFIT_FP8_PARTS: any of "unit exact cells bench baseline" (default all). REFIT_FP8_ROUNDS=N runs
# the fp8 bench (and that of ALT, another build of the CLI, when given: bench/gpu/common.sh) N times, interleaved (default 1).
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-fp8
: > "$summary"
nvidia-smi -L | tee -a "$summary"
py=python3
parts=${REFIT_FP8_PARTS:-"unit exact cells bench baseline"}
has() { [[ " $parts " == *" $1 "* ]]; }

if has unit && [ -x "$T" ]; then
  "$T" --gtest_filter='Fp8Plane.*:Fp8Quantizer.*' > "$out/unit.log" 2>&1
  note "unit Fp8Plane/Fp8Quantizer rc=$? cuda-kernels-logs=$(grep -c 'CUDA kernels matched' "$out/unit.log")"
  grep -B2 -A8 "Failure" "$out/unit.log" | head -40 | tee -a "$summary"
fi

# model NAME LAYERS HIDDEN HEADS KV INTER [MOE_INTER EXPERTS]: one config.json under $work/NAME
model() {
  mkdir -p "$work/$1"
  if [ -n "${7:-}" ]; then
    echo "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"hidden_size\": $3, \"num_hidden_layers\": $2, \"num_attention_heads\": $4, \"num_key_value_heads\": $5, \"head_dim\": 128, \"intermediate_size\": $6, \"moe_intermediate_size\": $7, \"num_experts\": $8, \"num_experts_per_tok\": 8, \"vocab_size\": 4096, \"tie_word_embeddings\": false}" > "$work/$1/config.json"
  else
    echo "{\"architectures\": [\"Qwen3ForCausalLM\"], \"hidden_size\": $3, \"num_hidden_layers\": $2, \"num_attention_heads\": $4, \"num_key_value_heads\": $5, \"head_dim\": 128, \"intermediate_size\": $6, \"vocab_size\": 4096, \"tie_word_embeddings\": false}" > "$work/$1/config.json"
  fi
}
model q8-layer 1 4096 32 8 12288
model q30-layer 1 2048 32 4 6144 768 128
model q8-full 36 4096 32 8 12288   # the shapes of qwen3-8b, for torch's baseline

# exact NAME MODEL_DIR DTYPE: refit (hf layout) -> dump -> torch's quantizer
exact() {
  local f=$work/$1.yaml
  printf 'model: %s\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: %s}\ngeneration: {backend: vllm, colocated: true, num_engines: 1, tp_size: 1, layout: hf}\nrefit: {target_precision: fp8, timeout_s: 300}\n' "$2" "$3" > "$f"
  timeout 600 "$R" run "$f" --dump "$work/dump-$1" > "$out/$1.log" 2>&1
  local rc=$?
  $py "$root/bench/gpu/fp8_torch.py" exact "$work/dump-$1" 128 128 >> "$out/$1.log" 2>&1
  local trc=$?
  note "$(printf 'torch-exact %-14s refit rc=%s torch rc=%s  %s' "$1" "$rc" "$trc" "$(grep '^exact:' "$out/$1.log")")"
  rm -rf "$work/dump-$1"
}
if has exact; then
  exact q8-layer-bf16 "$work/q8-layer" bfloat16
  exact q30-layer-bf16 "$work/q30-layer" bfloat16
  exact q8-layer-fp32 "$work/q8-layer" float32
fi

# cell NAME MODEL DTYPE BACKEND [extra args]: colocated 1 GPU, fused, --verify
cell() {
  local f=$work/$1.yaml
  printf 'model: %s\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: %s}\ngeneration: {backend: %s, colocated: true, num_engines: 1, tp_size: 1}\nrefit: {target_precision: fp8, timeout_s: 300%s}\n' "$2" "$3" "$4" "${5:-}" > "$f"
  timeout 600 "$R" run "$f" --steps 2 --verify > "$out/$1.log" 2>&1
  note "$(printf 'cell %-22s rc=%s verified-logs=%s' "$1" "$?" "$(grep -c 'against the FP8 reference quantizer' "$out/$1.log")")"
}
if has cells; then
  cell tiny-qwen3-logits tiny-qwen3 float32 vllm ", fp8: {block: [16, 16]}"
  cell q8-layer-sglang "$work/q8-layer" bfloat16 sglang
  cell q30-layer-tensor "$work/q30-layer" bfloat16 vllm ", fp8: {scheme: tensor}"
fi

# bench NAME TARGET [CLI]: qwen3-8b bf16 trainer, colocated 1 GPU. With REFIT_LOG=debug the
# ranks' lines carry wall-clock times: one timeline of trainer and engine per step.
bench() {
  local f=$work/b-$1.yaml
  printf 'model: qwen3-8b\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: bfloat16}\ngeneration: {backend: vllm, colocated: true, num_engines: 1, tp_size: 1}\nrefit: {target_precision: %s, timeout_s: 300}\n' "$2" > "$f"
  timeout 600 "${3:-$R}" bench "$f" --steps 5 --json "$out/bench-$1.json" > "$out/bench-$1.log" 2>&1
  note "$(printf 'bench %-10s rc=%s' "$1" "$?")"
}
if has bench; then
  for ((k = 1; k <= ${REFIT_FP8_ROUNDS:-1}; ++k)); do
    sfx=$([ "$k" -gt 1 ] && echo "-$k" || true)
    bench "fp8$sfx" fp8
    # A second CLI staged beside the first (another build), benched alike.
    if [ -x "$ALT" ]; then bench "fp8-alt$sfx" fp8 "$ALT"; fi
  done
  # The mailboxes' spin off (REFIT_CONTROL_SPIN_US=0): what it saves per refit.
  REFIT_CONTROL_SPIN_US=0 bench fp8-nospin fp8
  bench bf16 bf16
  REFIT_LOG=debug bench fp8-debug fp8
fi
if has baseline; then
  $py "$root/bench/gpu/fp8_torch.py" baseline "$work/q8-full/config.json" > "$out/baseline.log" 2>&1
fi
echo "== table"
$py - "$out" <<'PY' | tee -a "$summary"
import json, statistics, sys, glob, os
out = sys.argv[1]
print(f"{'bench':10} {'ms':>8} {'floor ms':>9} {'ratio':>6} {'GB/s':>7}  phases ms (cast_pack transfer apply)")
names = sorted(os.path.basename(p)[6:-5] for p in glob.glob(f"{out}/bench-*.json"))
for name in names:
    p = f"{out}/bench-{name}.json"
    j = json.load(open(p))
    if not j.get("ok"):
        print(f"{name:10} failed: {j.get('error', '')[:200]}"); continue
    ms = statistics.median(j["refit_seconds"]) * 1e3
    ph = j.get("phases", {})
    phases = " ".join(f"{ph.get(k, 0) * 1e3:.2f}" for k in ("cast_pack", "transfer", "apply"))
    print(f"{name:10} {ms:8.2f} {j.get('floor_seconds', 0) * 1e3:9.2f} {j.get('ratio_to_floor', 0):6.2f} {j['gbps']:7.1f}  {phases}")
if os.path.exists(f"{out}/baseline.log"):
    for line in open(f"{out}/baseline.log"):
        print(line.rstrip())
PY
# The debug bench's last steps as one timeline of trainer and engine.
[ -f "$out/bench-fp8-debug.log" ] && $py "$root/bench/gpu/timeline.py" "$out/bench-fp8-debug.log" 2 | tee -a "$summary"
echo "== summary"; cat "$summary"
