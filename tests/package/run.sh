#!/usr/bin/env bash
# CTest `cpp_package`: installs the build (cmake --install) into a scratch prefix, then builds
# tests/package/consumer.cc as an outside project three ways and runs each (a real refit):
#   1. find_package(refit CONFIG) -> refit::refit (librefit.so)
#   2. find_package(refit CONFIG) -> refit::refit_static (librefit.a)
#   3. pkg-config --cflags --libs refit (librefit.so)
# Usage: run.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/refit-package.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

cmake --install "$build" --prefix "$prefix" >"$work/install.log"
for f in include/refit/session.h include/refit/version.h bin/refit; do
  [ -e "$prefix/$f" ] || { echo "cpp_package: $f not installed"; exit 1; }
done
libdir=$(dirname "$(find "$prefix" -name librefit.so -print -quit)")
[ -f "$libdir/librefit.a" ] || { echo "cpp_package: librefit.a not installed"; exit 1; }
"$prefix/bin/refit" --version
# The consumer asks for the installed major.minor (the package is SameMinorVersion-compatible, as
# 0.x releases may break the API): "refit 0.4.0 (wire …" -> 0.4.
want=$("$prefix/bin/refit" --version | sed -n 's/^refit \([0-9]*\.[0-9]*\)\..*/\1/p')
[ -n "$want" ] || { echo "cpp_package: cannot read the version of the installed CLI"; exit 1; }

gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
for kind in shared static; do
  static=OFF; [ "$kind" = static ] && static=ON
  cmake -S "$here" -B "$work/$kind" "${gen[@]}" -DCMAKE_PREFIX_PATH="$prefix" \
        -DCONSUMER_STATIC=$static -DREFIT_WANT="$want" -DCMAKE_BUILD_RPATH="$libdir" \
        >"$work/$kind.log" 2>&1 ||
    { cat "$work/$kind.log"; exit 1; }
  cmake --build "$work/$kind" >>"$work/$kind.log" 2>&1 || { cat "$work/$kind.log"; exit 1; }
  deps=$(ldd "$work/$kind/consumer")  # whole, before matching (grep -q under pipefail races)
  if [ "$kind" = static ] && [[ "$deps" == *librefit* ]]; then
    echo "cpp_package: the static consumer links librefit.so:"; echo "$deps"; exit 1
  fi
  if [ "$kind" = shared ] && [[ "$deps" != *"$libdir/librefit.so"* ]]; then
    echo "cpp_package: the shared consumer does not load the installed librefit.so:"; echo "$deps"
    exit 1
  fi
  echo "cpp_package: cmake $kind: $("$work/$kind/consumer")"
done

export PKG_CONFIG_PATH="$libdir/pkgconfig"
pkg-config --modversion refit
# shellcheck disable=SC2046
g++ -std=c++20 -o "$work/pc-consumer" "$here/consumer.cc" $(pkg-config --cflags --libs refit) \
    -Wl,-rpath,"$libdir" -pthread
echo "cpp_package: pkg-config: $("$work/pc-consumer")"
