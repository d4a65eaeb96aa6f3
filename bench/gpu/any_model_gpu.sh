#!/usr/bin/env bash
# Any model, any engine layout, on one GPU through the CLI (`device: cuda`, colocated world 1 -> TP 1, CUDA IPC):
# the fused layouts of the new architectures (Gemma 3 with SGLang's whole embedding, Phi-3's
# checkpoint-fused q/k/v and gate/up, Qwen2-MoE's shared expert, Gemma 2) and the hf layout,
# where `refit run`'s engine takes every batch through the on_load_weights hook from GPU memory
# and verifies what it took; one hf cell with a corrupted refit rolled back (the hook runs again
# on the restored bytes). One table last; logs in $REFIT_BENCH_OUT (default /tmp/refit-any-model).
#   bash scripts/build.sh && bash bench/gpu/any_model_gpu.sh
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-any-model
: > "$summary"
nvidia-smi -L | tee -a "$summary"
cell() {  # name model backend layout expected-rc extra-refit-keys args...
  local name=$1 model=$2 backend=$3 layout=$4 want=$5 keys=$6; shift 6
  local f=$work/$name.yaml
  {
    echo "model: $model"; echo "device: cuda"
    echo "policy: {backend: fsdp2, world_size: 1, dtype: float32}"
    echo "generation: {backend: $backend, colocated: true, num_engines: 1, tp_size: 1, layout: $layout}"
    echo "refit: {buffer_size_bytes: 65536, timeout_s: 120$keys}"
  } > "$f"
  timeout 300 "$R" run "$f" "$@" > "$out/$name.log" 2>&1
  local rc=$? hook=$(grep -c "by name in" "$out/$name.log") rolled=$(grep -c "after the rollback" "$out/$name.log")
  local res=FAIL; [ "$rc" = "$want" ] && res=PASS
  [ "$layout" = hf ] && [ "$hook" = 0 ] && res="FAIL (no load_weights)"
  note "$(printf '%-28s %-16s %-6s %-5s rc=%-3s hook-logs=%-2s rollback-logs=%-2s %s' "$name" "$model" "$backend" "$layout" "$rc" "$hook" "$rolled" "$res")"
}
cell gemma3-sglang-fused tiny-gemma3 sglang fused 0 "" --steps 2 --verify
cell gemma2-vllm-fused tiny-gemma2 vllm fused 0 "" --steps 2 --verify
cell phi3-vllm-fused tiny-phi3 vllm fused 0 "" --steps 2 --verify
cell qwen2moe-sglang-fused tiny-qwen2-moe sglang fused 0 "" --steps 2 --verify
cell qwen3-hf-logits tiny-qwen3 vllm hf 0 "" --steps 2 --verify --check-logits
cell moe-hf tiny-moe sglang hf 0 "" --steps 2 --verify
cell qwen3-hf-rollback tiny-qwen3 sglang hf 1 ", checksum: true, keep_previous: true, executor: peer" --steps 3 --verify --fault corrupt:0:2
echo "== table"; cat "$summary"
