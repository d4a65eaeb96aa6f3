#!/usr/bin/env bash
# device: cuda with a model directory's checkpoint and --verify (the host-side comparison): a tiny
# Qwen3 checkpoint dumped on the CPU, refitted colocated and not, then corrupted (a --verify
# failure naming the tensor, and refit.checksum without --verify). Logs in
# $REFIT_BENCH_OUT (default /tmp/refit-checkpoint_cell).
#   bash scripts/build.sh && bash bench/gpu/checkpoint_cell.sh
set -uo pipefail
source "$(dirname "$0")/common.sh"
w=$(mktemp -d); mkdir -p $w/model $w/dump
cat > $w/model/config.json <<'J'
{
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "vocab_size": 1000, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "tie_word_embeddings": false}
J
printf 'model: %s\ndevice: cpu\npolicy: {world_size: 1}\ngeneration: {tp_size: 1}\n' $w/model > $w/cpu.yaml
"$R" run $w/cpu.yaml --steps 1 --dump $w/dump > $out/ckpt-dump.log 2>&1; echo "dump rc=$?"
cp $w/dump/trainer.safetensors $w/model/model.safetensors
for colo in true false; do
printf 'model: %s\ndevice: cuda\npolicy: {world_size: 1, dtype: float32}\ngeneration: {backend: vllm, colocated: %s, tp_size: 1}\nrefit: {timeout_s: 60}\n' $w/model $colo > $w/cuda.yaml
"$R" run $w/cuda.yaml --steps 2 --verify > $out/ckpt-$colo.log 2>&1; echo "cuda checkpoint colocated=$colo --verify rc=$? $(tail -1 $out/ckpt-$colo.log)"
done
# The negative: a corrupted parameter must fail verification naming the tensor (the host-side
# comparison of a checkpoint's values), and the checksum must catch it without --verify.
printf 'model: %s\ndevice: cuda\npolicy: {world_size: 1, dtype: float32}\ngeneration: {backend: vllm, colocated: true, tp_size: 1}\nrefit: {timeout_s: 60}\n' $w/model > $w/corrupt.yaml
"$R" run $w/corrupt.yaml --steps 1 --verify --fault corrupt:0 > $out/ckpt-corrupt.log 2>&1
echo "cuda checkpoint corrupt:0 --verify rc=$? (want 1) $(grep -m1 -o 'verify: [^(]*' $out/ckpt-corrupt.log)"
printf 'model: %s\ndevice: cuda\npolicy: {world_size: 1, dtype: float32}\ngeneration: {backend: vllm, colocated: true, tp_size: 1}\nrefit: {timeout_s: 60, checksum: true}\n' $w/model > $w/sum.yaml
"$R" run $w/sum.yaml --steps 2 --fault corrupt:0 > $out/ckpt-checksum.log 2>&1
echo "cuda checkpoint checksum corrupt:0 rc=$? (want 1) $(grep -m1 -o 'checksum mismatch in refit step [0-9]*' $out/ckpt-checksum.log); step 2: $(grep -c 'step 2/2: refit [0-9]' $out/ckpt-checksum.log)"
