#!/usr/bin/env bash
# Here (the build machine): stages what bench/gpu/refit_device.sh needs on the device machine into
# the git-ignored .carry/refit: the refit CLI and test binaries and librefit.a (stripped of debug
# info), the generated include/refit/version.h, and the non-system shared libraries they load (gloo, ZeroMQ, yaml-cpp, fmt and
# their dependencies; NCCL and CUDA come from the device). Then:
#   run(command="bash bench/gpu/refit_device.sh", carry=[".carry/refit"])
# The carry must stay under 64 MiB: with everything it does not. REFIT_CARRY=tests (default) leaves
# out librefit.a (no Python module on the device); REFIT_CARRY=python leaves out refit_tests (no
# CUDA unit tests) and keeps librefit.a for refit_device.sh's python part.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
dst=.carry/refit
rm -rf "$dst" && mkdir -p "$dst/bin" "$dst/lib" "$dst/include/refit"
strip --strip-debug -o "$dst/bin/refit" "$build/src/refit"
case ${REFIT_CARRY:-tests} in
  tests) strip --strip-debug -o "$dst/bin/refit_tests" "$build/tests/refit_tests" ;;
  python) strip --strip-debug -o "$dst/lib/librefit.a" "$build/src/librefit.a" ;;
  *) echo "carry_refit.sh: REFIT_CARRY is tests or python" >&2; exit 2 ;;
esac
cp "$build/include/refit/version.h" "$dst/include/refit/"
# A CLI built for other GPUs only (tests the "no kernels for this GPU" setup error), if present:
#   cmake -S . -B build-sm80 -G Ninja -DCMAKE_CUDA_ARCHITECTURES=80-real -DREFIT_BUILD_TESTS=OFF \
#         -DREFIT_BUILD_PYTHON=OFF && cmake --build build-sm80 --target refit
if [ -x build-sm80/src/refit ]; then strip --strip-debug -o "$dst/bin/refit-sm80" build-sm80/src/refit; fi
ldd "$build/src/refit" | awk '/=> \// {print $3}' |
  grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt|libresolv|ld-linux[^/]*|libnccl)\.so' |
  while read -r lib; do cp -L "$lib" "$dst/lib/"; done
du -sh "$dst"
