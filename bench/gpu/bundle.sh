#!/usr/bin/env bash
# Copies what the GPU scripts (bench/gpu/*.sh) run into the git-ignored .bundle/refit, so that a
# GPU host with the NVIDIA driver, CUDA and NCCL but without refit's build dependencies can run
# them from a copy of the checkout: the refit CLI, and refit_tests or librefit.a (stripped of
# debug info), the generated include/refit/version.h, and the non-system shared libraries they
# load (gloo, ZeroMQ, yaml-cpp, fmt, libsodium and their dependencies; NCCL and CUDA come from the
# GPU host). On the build host, then on the GPU host:
#   bash scripts/build.sh && bash bench/gpu/bundle.sh [BUILD_DIR]
#   rsync -a ./ gpu-host:refit/ && ssh gpu-host 'cd refit && bash bench/gpu/refit_device.sh'
# The scripts use the bundle when it exists, else the build tree (bench/gpu/common.sh).
# REFIT_BUNDLE_WITH picks the large parts: tests (default: the CLI and refit_tests, for the CUDA
# unit tests; no Python module on the GPU host), python (the CLI and librefit.a, for
# refit_device.sh's python part; no CUDA unit tests), kernels (refit_tests and zero_copy_bench,
# for kernels_gpu.sh; build it first: cmake --build build --target zero_copy_bench), delta
# (the CLI, refit_tests and refit_delta_bench, for delta_gpu.sh) or all.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
dst=.bundle/refit
rm -rf "$dst" && mkdir -p "$dst/bin" "$dst/lib" "$dst/include/refit"
with=${REFIT_BUNDLE_WITH:-tests}
case $with in
  tests | python | kernels | delta | all) ;;
  *) echo "bundle.sh: REFIT_BUNDLE_WITH is tests, python, kernels, delta or all" >&2; exit 2 ;;
esac
has() { [ "$with" = all ] || [[ " $* " == *" $with "* ]]; }
if has tests python delta; then strip --strip-debug -o "$dst/bin/refit" "$build/src/refit"; fi
if has tests kernels delta; then
  strip --strip-debug -o "$dst/bin/refit_tests" "$build/tests/refit_tests"
fi
if has delta; then
  strip --strip-debug -o "$dst/bin/refit_delta_bench" "$build/tests/refit_delta_bench"
fi
if has python; then strip --strip-debug -o "$dst/lib/librefit.a" "$build/src/librefit.a"; fi
if has kernels; then strip --strip-debug -o "$dst/bin/zero_copy_bench" "$build/zero_copy_bench"; fi
cp "$build/include/refit/version.h" "$dst/include/refit/"
# A CLI built for other GPUs only (refit_device.sh's archcheck: the "no kernels for this GPU"
# setup error), if present:
#   cmake -S . -B build-sm80 -G Ninja -DCMAKE_CUDA_ARCHITECTURES=80-real -DREFIT_BUILD_TESTS=OFF \
#         -DREFIT_BUILD_PYTHON=OFF && cmake --build build-sm80 --target refit
if [ -x build-sm80/src/refit ]; then strip --strip-debug -o "$dst/bin/refit-sm80" build-sm80/src/refit; fi
ldd "$build/src/refit" | awk '/=> \// {print $3}' |
  grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt|libresolv|ld-linux[^/]*|libnccl)\.so' |
  while read -r lib; do cp -L "$lib" "$dst/lib/"; done
du -sh "$dst"
