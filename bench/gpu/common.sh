# Sourced by the GPU scripts (bench/gpu/*.sh) before anything else. Each script runs from a
# checkout on a host with the GPUs it needs (`bash bench/gpu/<script>.sh`), prints a short table
# last and keeps its logs in an output directory. Sets:
#   root, the checkout;
#   the refit binaries: R (the CLI), T (refit_tests), A (librefit.a), I (the generated headers:
#     refit/version.h), Z (zero_copy_bench) and D (refit_delta_bench) — from a bundle when there is one (bench/gpu/bundle.sh; REFIT_BUNDLE,
#     default <checkout>/.bundle/refit), else from the build tree (REFIT_BUILD, default
#     <checkout>/build, as `bash scripts/build.sh` makes it); REFIT_BIN overrides the CLI alone;
#   the optional CLIs: SM80 (one built for sm_80 only: the bundle's refit-sm80, else
#     <checkout>/build-sm80/src/refit) and ALT (another build to compare with: REFIT_ALT_BIN, else
#     the bundle's refit-alt); scripts skip what needs them when they are absent;
#   nccl_dir, and LD_LIBRARY_PATH with the bundle's libraries, NCCL's and CUDA's;
#   out, the output directory: REFIT_BENCH_OUT, else the default the script passes (or
#     /tmp/refit-<script>); summary ($out/summary.txt; a script that starts a run empties it) and
#     note() (echo and append to it);
#   work, a scratch directory removed on exit.
# NVLink multicast (NVLS) is off for every process, torch's baselines included: refit turns it off
# for its own NCCL groups (docs/gpu.md), so both sides run under the same NCCL settings.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=${REFIT_BUNDLE:-$root/.bundle/refit}
if [ -d "$bundle/bin" ]; then
  T=$bundle/bin/refit_tests A=$bundle/lib/librefit.a I=$bundle/include lib=$bundle/lib
  Z=$bundle/bin/zero_copy_bench D=$bundle/bin/refit_delta_bench
  R=${REFIT_BIN:-$bundle/bin/refit} SM80=$bundle/bin/refit-sm80
else
  build=${REFIT_BUILD:-$root/build}
  T=$build/tests/refit_tests A=$build/src/librefit.a I=$build/include lib=
  Z=$build/zero_copy_bench D=$build/tests/refit_delta_bench
  R=${REFIT_BIN:-$build/src/refit} SM80=$root/build-sm80/src/refit
fi
ALT=${REFIT_ALT_BIN:-$bundle/bin/refit-alt}
nccl_dir=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=${lib:+$lib:}$nccl_dir:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
out=${REFIT_BENCH_OUT:-${1:-/tmp/refit-$(basename "$0" .sh)}}
mkdir -p "$out"
summary=$out/summary.txt
note() { echo "$*" | tee -a "$summary"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
