#!/usr/bin/env bash
# Installs refit's build and test dependencies from Debian 12 packages (the only registry used).
# Idempotent: skips apt-get when everything is already present.
set -euo pipefail
pkgs=(build-essential cmake ninja-build ccache pkg-config clang-format
      libgloo-dev libzmq3-dev cppzmq-dev libsodium-dev nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libfmt-dev
      libgtest-dev libgmock-dev pybind11-dev python3-dev python3-numpy python3-pytest python3-yaml
      python3-jsonschema python3-pip python3-venv
      python3-torch  # torch 1.13 (CPU): tests/python/test_torch.py runs refit.torch in CI
      iproute2)  # iproute2: the two-host test's network namespaces (tests/netns_test.cc)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
