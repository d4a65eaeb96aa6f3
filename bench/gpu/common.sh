# Sourced by the device scripts (bench/gpu/*.sh) before anything else. Sets:
#   the NVLink-multicast switches the device machines require;
#   root (the checkout), c (.carry/refit), R (the carried CLI, or $REFIT_BIN);
#   nccl_dir, and LD_LIBRARY_PATH with the carried libraries, NCCL's and CUDA's;
#   out ($OUT, or $1 as the default), summary ($out/summary.txt; a script that starts a run
#   empties it) and note() (echo and append to it);
#   work, a scratch directory removed on exit.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
c=$root/.carry/refit
R=${REFIT_BIN:-$c/bin/refit}
nccl_dir=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$c/lib:$nccl_dir:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
out=${OUT:-${1:-/tmp/refit-out}}
mkdir -p "$out"
summary=$out/summary.txt
note() { echo "$*" | tee -a "$summary"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
