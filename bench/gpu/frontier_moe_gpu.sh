#!/usr/bin/env bash
# DeepSeek-V3 (MLA) and GLM-4.5 fused layouts on one GPU (docs/models.md): colocated cells with
# --verify on the tiny shapes (bf16 with refit.checksum, fp8 blocks under DeepSeek's names, GLM's
# float32 router in vLLM's layout), then two layers of DeepSeek-V3 at its published widths (one
# dense layer, one MoE layer of 256 experts: 12.4 B parameters) verified bit-exact in bf16 and
# benched bf16 -> bf16 and bf16 -> fp8 (128 x 128 blocks, every slice whole blocks).
# Logs in $REFIT_BENCH_OUT (default /tmp/refit-frontier).
#   bash scripts/build.sh && bash bench/gpu/frontier_moe_gpu.sh
# Expected: every cell rc=0 with its verified line counted once per step; the bench lines print
# the median refit time and its ratio to the floor.
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-frontier
: > "$summary"
nvidia-smi -L | tee -a "$summary"

# cell NAME MODEL BACKEND PRECISION [refit extras]: colocated 1 GPU, fused, 2 steps, --verify
cell() {
  local f=$work/$1.yaml
  printf 'model: %s\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: float32}\ngeneration: {backend: %s, colocated: true, num_engines: 1, tp_size: 1}\nrefit: {target_precision: %s, timeout_s: 300%s}\n' \
    "$2" "$3" "$4" "${5:-}" > "$f"
  timeout 900 "$R" run "$f" --steps 2 --verify > "$out/$1.log" 2>&1
  local rc=$?
  note "$(printf 'cell %-26s rc=%s verified-lines=%s checksum-lines=%s' "$1" "$rc" \
    "$(grep -c -E 'verified bit-exact (against|on every)' "$out/$1.log")" \
    "$(grep -c 'refit.checksum: step' "$out/$1.log")")"
  [ "$rc" = 0 ] || tail -5 "$out/$1.log" | tee -a "$summary"
}
cell deepseek-vllm-bf16-checksum tiny-deepseek vllm bf16 ", checksum: true"
cell deepseek-sglang-fp8 tiny-deepseek sglang fp8 ", fp8: {block: [8, 8]}"
cell deepseek-lite-sglang-bf16 tiny-deepseek-lite sglang bf16
cell glm-vllm-bf16-checksum tiny-glm4-moe vllm bf16 ", checksum: true"
cell glm-sglang-bf16 tiny-glm4-moe sglang bf16

# Two layers of DeepSeek-V3 at its published widths.
mkdir -p "$work/ds2"
cat > "$work/ds2/config.json" <<'EOF'
{"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
 "moe_intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 128,
 "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
 "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
 "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
 "topk_method": "noaux_tc", "num_nextn_predict_layers": 0, "vocab_size": 129280,
 "tie_word_embeddings": false}
EOF
cell ds2-vllm-bf16 "$work/ds2" vllm bf16

# bench NAME MODEL BACKEND PRECISION: colocated 1 GPU, fused, refit bench --steps 5
bench() {
  local f=$work/$1.yaml
  printf 'model: %s\ndevice: cuda\npolicy: {backend: fsdp2, world_size: 1, dtype: bfloat16}\ngeneration: {backend: %s, colocated: true, num_engines: 1, tp_size: 1}\nrefit: {target_precision: %s, timeout_s: 300}\n' \
    "$2" "$3" "$4" > "$f"
  timeout 900 "$R" bench "$f" --steps 5 --json "$out/$1.json" > "$out/$1.log" 2>&1
  local rc=$?
  note "$(printf 'bench %-18s rc=%s %s' "$1" "$rc" \
    "$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); t=sorted(r["refit_seconds"]); print("refit %.2f ms median, floor ratio %.2f, %.2f GB per refit" % (t[len(t)//2]*1e3, r.get("ratio_to_floor", 0), r["bytes_per_refit"]/1e9))' "$out/$1.json" 2>&1 | tail -1)")"
  [ "$rc" = 0 ] || tail -5 "$out/$1.log" | tee -a "$summary"
}
bench ds2-bf16 "$work/ds2" vllm bf16
bench ds2-fp8 "$work/ds2" vllm fp8

echo "--- summary"
cat "$summary"
