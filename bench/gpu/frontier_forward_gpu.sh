#!/usr/bin/env bash
# DeepSeek-V3 (MLA) and GLM-4.5 on one GPU against transformers (docs/models.md, "The reference
# forward"): bench/gpu/frontier_device_test.py builds transformers' DeepseekV3ForCausalLM and
# Glm4MoeForCausalLM from small configs with random initialisation, trains them under FSDP2
# (world 1) and refits them into the fused layouts of vLLM and SGLang (TP 1, colocated, bf16 and
# fp8), then checks every engine parameter bit for bit against an oracle of the engines' loaders,
# that the engine's on_weights_changed hook heard every parameter once per refit (it derives MLA's
# W_UK_T / W_UV from kv_b_proj there), and the logits of a forward from the engine's parameters
# and those matrices (MLA absorbed) against transformers' own forward on the same (dequantized)
# weights. Needs torch and transformers 5.x on the device.
# Expected: every case PASS, hook "ok", logit error at most 1e-4 (fp8 cases too: both forwards
# read the same dequantized weights).
# Logs in $REFIT_BENCH_OUT (default /tmp/refit-frontier-forward).
#   bash scripts/build.sh && bash bench/gpu/frontier_forward_gpu.sh
# It uses the build tree's Python module (build/python), or builds one from a bundle's
# librefit.a (REFIT_BUNDLE_WITH=python bash bench/gpu/bundle.sh).
# REFIT_FRONTIER_CASES=a,b runs a subset (names in frontier_device_test.py's CASES).
set -uo pipefail
source "$(dirname "$0")/common.sh" /tmp/refit-frontier-forward
: > "$summary"
nvidia-smi -L | tee -a "$summary"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
  | tee -a "$summary"

if ls "${build:-/nonexistent}"/python/refit/_refit*.so > /dev/null 2>&1; then
  pypath=$build/python  # the build tree's module
else  # a bundle: build the module here, for this interpreter, from its librefit.a
  pypath=$work/py
  mkdir -p "$pypath/refit" && cp "$root"/python/refit/*.py "$pypath/refit/"
  if ! g++ -O2 -shared -fPIC -std=c++20 "$root"/python/src/*.cc -I"$root/include" -I"$I" -I"$root/python/src" \
      $(python3 -m pybind11 --includes) -o "$pypath/refit/_refit$(python3-config --extension-suffix)" \
      -Wl,--start-group "$A" "$lib/libgloo.so.0" "$lib/libzmq.so.5" \
      "$lib/libyaml-cpp.so.0.7" "$lib/libfmt.so.9" "$lib/libsodium.so.23" -Wl,--end-group \
      -L/usr/local/cuda/lib64 -lcudart_static -L"$nccl_dir" -l:libnccl.so.2 -lpthread -ldl -lrt \
      > "$out/python-build.log" 2>&1; then
    note "python module build FAILED (python-build.log)"
    tail -20 "$out/python-build.log"
    exit 1
  fi
fi
PYTHONPATH=$pypath timeout "${REFIT_PY_TIMEOUT:-560}" python3 "$root/bench/gpu/frontier_device_test.py" \
  ${REFIT_FRONTIER_CASES:+--cases "$REFIT_FRONTIER_CASES"} --json "$out/frontier.json" > "$out/frontier.log" 2>&1
rc=$?
note "frontier device test rc=$rc"
echo "== table"
sed -n '/^case /,$p' "$out/frontier.log" | tee -a "$summary"
[ "$rc" -eq 0 ] || grep -E "problems|Error|Traceback" "$out/frontier.log" | head -20 | tee -a "$summary"
echo "== summary"; cat "$summary"
exit $rc
