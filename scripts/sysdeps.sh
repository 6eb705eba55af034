#!/usr/bin/env bash
# The system packages of the compile-only analysis: clang-19 compiles the HIP kernels for gfx942
# and gfx90a (device-only) and builds the wave emulator; lld-19 and libamdhip64-dev come with it.
# Run by `make test`, `make report` and CI. Installs what is missing with apt-get where it can
# (root, or sudo without a password); elsewhere it says what to install and goes on: the tests
# that need clang then skip, saying why. An install that is tried and fails is an error.
set -euo pipefail

pkgs=(clang-19 lld-19 libamdhip64-dev)
missing=()
if command -v dpkg-query >/dev/null 2>&1; then
  for p in "${pkgs[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
elif ! command -v clang++-19 >/dev/null 2>&1; then
  missing=("${pkgs[@]}")
fi
if ((${#missing[@]} == 0)); then
  echo "sysdeps: ${pkgs[*]} already installed"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "sysdeps: not installed: ${missing[*]} (no apt-get here; install clang 19 with the HIP headers" \
       "yourself, or the gfx942 compile and emulator tests skip)" >&2
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "sysdeps: not installed: ${missing[*]} (not root and no password-less sudo: run" \
       "'sudo apt-get install ${missing[*]}', or the gfx942 compile and emulator tests skip)" >&2
  exit 0
fi
echo "sysdeps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
