#!/usr/bin/env bash
# CTest `cpp_package`: installs the build (cmake --install) into a scratch prefix, then builds
# tests/package/consumer.cc as an outside project three ways, with the lines README.md shows
# ("Installing"), and runs each (a real refit):
#   1. README's CMake lines: find_package(refit <version> CONFIG REQUIRED) -> refit::refit
#      (librefit.so);
#   2. the same with README's alternative, refit::refit_static (librefit.a);
#   3. README's pkg-config command line (librefit.so).
# The README's lines are extracted from README.md here, so the documentation and this test cannot
# drift apart: a README example that does not work with this build fails the test.
# Usage: run.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
readme="$here/../../README.md"
work=$(mktemp -d /tmp/refit-package.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"
fail() { echo "cpp_package: $*"; exit 1; }

# README's fenced ```cmake block that holds find_package(refit ...), and its ```sh line that holds
# pkg-config.
awk '/^```cmake$/ {on = 1; block = ""; next}
     on && /^```$/ {on = 0; if (block ~ /find_package\(refit/) {printf "%s", block; exit}; next}
     on {block = block $0 "\n"}' "$readme" > "$work/readme.cmake"
grep -q 'find_package(refit' "$work/readme.cmake" || fail "README.md has no \`\`\`cmake block with find_package(refit"
grep -q 'refit::refit)' "$work/readme.cmake" || fail "README.md's CMake block links no refit::refit"
grep -q 'refit::refit_static' "$work/readme.cmake" || fail "README.md's CMake block names no refit::refit_static"
pc_line=$(awk '/^```sh$/ {on = 1; next} on && /^```$/ {on = 0; next} on && /pkg-config/ {print; exit}' "$readme")
[ -n "$pc_line" ] || fail "README.md has no \`\`\`sh line with pkg-config"
echo "cpp_package: README.md's lines:"; cat "$work/readme.cmake"; echo "$pc_line"

cmake --install "$build" --prefix "$prefix" >"$work/install.log"
for f in include/refit/session.h include/refit/version.h bin/refit; do
  [ -e "$prefix/$f" ] || fail "$f not installed"
done
libdir=$(dirname "$(find "$prefix" -name librefit.so -print -quit)")
[ -f "$libdir/librefit.a" ] || fail "librefit.a not installed"
"$prefix/bin/refit" --version
# The package is SameMinorVersion-compatible (0.x releases may break the API), so README's
# find_package must ask for the installed major.minor: "refit 0.12.0 (wire …" -> 0.12.
have=$("$prefix/bin/refit" --version | sed -n 's/^refit \([0-9]*\.[0-9]*\)\..*/\1/p')
asked=$(sed -n 's/.*find_package(refit \([0-9][0-9.]*\) .*/\1/p' "$work/readme.cmake")
[ -n "$have" ] || fail "cannot read the version of the installed CLI"
if [ -n "$asked" ] && [ "$asked" != "$have" ]; then
  fail "README.md's find_package asks for refit $asked, but this build is refit $have (the package accepts only its own major.minor before 1.0): update README.md"
fi

gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
for kind in shared static; do
  snippet="$work/readme-$kind.cmake"
  if [ "$kind" = static ]; then
    sed 's/refit::refit)/refit::refit_static)/' "$work/readme.cmake" > "$snippet"
  else
    cp "$work/readme.cmake" "$snippet"
  fi
  cmake -S "$here" -B "$work/$kind" "${gen[@]}" -DCMAKE_PREFIX_PATH="$prefix" \
        -DREADME_SNIPPET="$snippet" -DCMAKE_BUILD_RPATH="$libdir" >"$work/$kind.log" 2>&1 ||
    { cat "$work/$kind.log"; exit 1; }
  cmake --build "$work/$kind" >>"$work/$kind.log" 2>&1 || { cat "$work/$kind.log"; exit 1; }
  deps=$(ldd "$work/$kind/app")  # whole, before matching (grep -q under pipefail races)
  if [ "$kind" = static ] && [[ "$deps" == *librefit* ]]; then
    echo "cpp_package: the static consumer links librefit.so:"; echo "$deps"; exit 1
  fi
  if [ "$kind" = shared ] && [[ "$deps" != *"$libdir/librefit.so"* ]]; then
    echo "cpp_package: the shared consumer does not load the installed librefit.so:"; echo "$deps"
    exit 1
  fi
  result=$("$work/$kind/app")  # an assignment: a failing consumer fails the test
  [[ "$result" == "consumer: ok "* ]] || fail "cmake $kind: the consumer said: $result"
  echo "cpp_package: cmake $kind: $result"
done

# README's pkg-config line, as written, on app.cc in a directory of its own.
mkdir "$work/pc" && cp "$here/consumer.cc" "$work/pc/app.cc"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
pkg-config --modversion refit
(cd "$work/pc" && bash -c "set -e; $pc_line" >"$work/pc.log" 2>&1) || { cat "$work/pc.log"; exit 1; }
[ -x "$work/pc/a.out" ] || fail "README.md's pkg-config line made no a.out"
result=$(LD_LIBRARY_PATH="$libdir" "$work/pc/a.out")
[[ "$result" == "consumer: ok "* ]] || fail "pkg-config: the consumer said: $result"
echo "cpp_package: pkg-config: $result"
