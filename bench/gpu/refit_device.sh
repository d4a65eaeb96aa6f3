#!/usr/bin/env bash
# refit on one GPU (an H200, or any GPU the build has kernels for): the CUDA unit tests, every
# `device: cuda` cell one GPU allows through the real CLI (colocated trainer + engine processes,
# the peer executor and executor gather's CUDA-IPC buckets, FSDP2 and Megatron, --verify on the
# GPU, --check-logits, a corruption fault), `refit bench` on qwen3-8b (fp32 trainer) and
# qwen3-30b-a3b (bf16 trainer) shapes with the floor measured in the same run, and the Python
# module's PyTorch device test. One table last; logs in $REFIT_BENCH_OUT (default
# /tmp/refit-device). About 10 minutes.
#
#   bash scripts/build.sh && bash bench/gpu/refit_device.sh
#
# REFIT_DEVICE_PARTS: any of "tests cells archcheck bench python" (default all). The python part
# uses the build tree's module (build/python), or builds one from a bundle's librefit.a
# (bench/gpu/bundle.sh with REFIT_BUNDLE_WITH=python or all).
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-device
: > "$summary"
parts=${REFIT_DEVICE_PARTS:-"tests cells archcheck bench python"}  # a subset for a shorter run
has() { [[ " $parts " == *" $1 "* ]]; }

nvidia-smi -L | tee -a "$summary"
note "nccl from: $nccl_dir"

if has tests; then
echo "== CUDA unit tests"
timeout 240 "$T" --gtest_filter='Cuda*' > "$out/tests.log" 2>&1
note "cuda unit tests: rc=$? ($(grep -c '^\[       OK' "$out/tests.log") ok, $(grep -c '^\[  FAILED' "$out/tests.log") failed, $(grep -c '^\[  SKIPPED' "$out/tests.log") skipped)"
fi

cfg() {  # model backend engine dtype [megatron]
  local f=$work/$1-$2-$3-$4.yaml
  {
    echo "model: $1"; echo "device: cuda"
    echo "policy: {backend: $2, world_size: 1, dtype: $4}"
    echo "generation: {backend: $3, colocated: true, num_engines: 1, tp_size: 1}"
    echo "refit: {buffer_size_bytes: ${BUF:-268435456}, timeout_s: 120, executor: ${EXEC:-auto}}"
  } > "$f"
  echo "$f"
}
cell() {  # name expected-rc args...
  local name=$1 want=$2; shift 2
  local start=$(date +%s.%N)
  timeout 300 "$R" "$@" >> "$out/cells.log" 2>&1
  local rc=$?
  local ok=FAIL; { [ "$want" = 0 ] && [ $rc = 0 ]; } || { [ "$want" != 0 ] && [ $rc != 0 ]; } && ok=ok
  note "$(printf 'cell %-44s rc=%-3s %s (%s s)' "$name" "$rc" "$ok" "$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}")")"
}
if has cells; then
echo "== device: cuda cells"
: > "$out/cells.log"
cell "fsdp2->sglang zero-copy tiny-qwen3" 0 run "$(cfg tiny-qwen3 fsdp2 sglang float32)" --steps 3 --verify --check-logits
cell "fsdp2->vllm zero-copy tiny-moe" 0 run "$(cfg tiny-moe fsdp2 vllm float32)" --steps 3 --verify --check-logits
cell "fsdp2->vllm cuda-ipc buckets tiny-moe" 0 run "$(EXEC=gather BUF=65536 cfg tiny-moe fsdp2 vllm bfloat16)" --steps 3 --verify
cell "fsdp2->sglang cuda-ipc buckets tiny-qwen2" 0 run "$(EXEC=gather BUF=4096 cfg tiny-qwen2 fsdp2 sglang float32)" --steps 2 --verify
cell "megatron->vllm zero-copy tiny-qwen2" 0 run "$(cfg tiny-qwen2 megatron vllm float32)" --steps 2 --verify --check-logits
cell "megatron->sglang zero-copy qwen2.5-0.5b" 0 run "$(cfg qwen2.5-0.5b megatron sglang float32)" --steps 2 --verify
cell "corrupt:0 must fail naming the tensor" 1 run "$(cfg tiny-qwen3 fsdp2 sglang float32)" --steps 1 --verify --fault corrupt:0
cell "buckets, corrupt:1 must fail" 1 run "$(EXEC=gather BUF=4096 cfg tiny-qwen3 fsdp2 vllm float32)" --steps 1 --verify --fault corrupt:1
cell "buckets, killed engine: all exit quickly" 1 run "$(EXEC=gather BUF=4096 cfg tiny-qwen3 fsdp2 vllm float32)" --steps 2 --fault kill-engine:0:3
cell "zero-copy, killed trainer: all exit quickly" 1 run "$(cfg tiny-qwen3 fsdp2 sglang float32)" --steps 2 --fault kill-trainer:0:0
grep -m1 "verify:" "$out/cells.log" | cut -c1-240 | tee -a "$summary"
fi

if has bench; then
echo "== benchmarks"
: > "$out/bench.log"
bench() {  # label model dtype [env]
  local label=$1 model=$2 dtype=$3
  local f; f=$(cfg "$model" fsdp2 vllm "$dtype")
  timeout 400 "$R" run "$f" --steps 2 --verify >> "$out/bench.log" 2>&1
  note "$(printf '%-28s verify rc=%s' "$label" "$?")"
  timeout 400 "$R" bench "$f" --steps 5 --json "$out/bench-$label.json" >> "$out/bench.log" 2>&1
  note "$(printf '%-28s bench  rc=%s' "$label" "$?")"
}
bench qwen3-8b-fp32 qwen3-8b float32
bench qwen3-30b-a3b-bf16 qwen3-30b-a3b bfloat16
timeout 400 "$R" bench "$(EXEC=gather BUF=536870912 cfg qwen3-8b fsdp2 vllm float32)" --steps 5 \
  --json "$work/bench-qwen3-8b-fp32-buckets.json" >> "$out/bench.log" 2>&1
note "qwen3-8b-fp32 cuda-ipc buckets bench rc=$?"
fi

if has archcheck && [ -x "$SM80" ]; then
echo "== a CLI with sm_80 kernels only, on this GPU: must be refused at setup, naming the GPU"
timeout 120 "$SM80" run "$(cfg tiny-qwen3 fsdp2 sglang float32)" --steps 1 \
  > "$out/archcheck.log" 2>&1
rc=$?
if [ $rc != 0 ] && grep -q "has no refit kernels" "$out/archcheck.log"; then
  note "archcheck: ok, rc=$rc: $(grep -o 'device [0-9]* ([^)]*) has no refit kernels[^;]*' "$out/archcheck.log" | head -1)"
else
  note "archcheck: FAIL rc=$rc (archcheck.log)"
fi
fi

if has python; then
echo "== python module + PyTorch device test"
if ls "${build:-/nonexistent}"/python/refit/_refit*.so > /dev/null 2>&1; then
  pypath=$build/python  # the build tree's module
  : > "$out/python.log"
else  # a bundle: build the module here, for this interpreter, from its librefit.a
  pypath=$work/py
  mkdir -p "$pypath/refit" && cp "$root"/python/refit/*.py "$pypath/refit/"
  g++ -O2 -shared -fPIC -std=c++20 "$root"/python/src/*.cc -I"$root/include" -I"$I" -I"$root/python/src" \
    $(python3 -m pybind11 --includes) -o "$pypath/refit/_refit$(python3-config --extension-suffix)" \
    -Wl,--start-group "$A" "$lib/libgloo.so.0" "$lib/libzmq.so.5" \
    "$lib/libyaml-cpp.so.0.7" "$lib/libfmt.so.9" "$lib/libsodium.so.23" -Wl,--end-group \
    -L/usr/local/cuda/lib64 -lcudart_static -L"$nccl_dir" -l:libnccl.so.2 -lpthread -ldl -lrt \
    > "$out/python.log" 2>&1 || pypath=
fi
if [ -n "$pypath" ]; then
  PYTHONPATH=$pypath timeout "${REFIT_PY_TIMEOUT:-540}" python3 "$root/bench/gpu/python_device_test.py" \
    --steps 2 ${REFIT_PY_CASES:+--cases "$REFIT_PY_CASES"} --json "$work/python.json" >> "$out/python.log" 2>&1
  note "python device test rc=$?"
else
  note "python module build FAILED (python.log)"
fi
fi

echo "== table"
python3 - "$out" "$work" <<'PY' | tee -a "$summary"
import glob, json, os, sys
out, work = sys.argv[1], sys.argv[2]
rows = []
for f in sorted(glob.glob(os.path.join(out, "bench-*.json")) + glob.glob(os.path.join(work, "bench-*.json"))):
    j = json.load(open(f))
    if not j.get("ok", True):  # a failed run's report (schema_version 3): no measurements
        print(f"{os.path.basename(f)[6:-5]}: failed: {j['error']['message']}")
        continue
    med = sorted(j["refit_seconds"])[len(j["refit_seconds"]) // 2]
    rows.append((os.path.basename(f)[6:-5], med * 1e3, j["gbps"], j.get("floor_seconds", 0) * 1e3,
                 j.get("ratio_to_floor", 0), j.get("ratio", 0)))
print(f"{'case':34} {'refit ms':>9} {'GB/s':>8} {'floor ms':>9} {'floor/refit':>11} {'refit/raw':>9}")
for r in rows:
    print(f"{r[0]:34} {r[1]:9.2f} {r[2]:8.1f} {r[3]:9.2f} {r[4]:11.2f} {r[5]:9.2f}")
PY
