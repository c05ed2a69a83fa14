#!/usr/bin/env bash
# Set up a fresh machine and run the test suite: `bash tests/run.sh [pytest args]`.
# Debian/Ubuntu (as root or with sudo): installs clang-19 for the MSL emulator, Chromium for the browser
# tests, and torch 2.13 CPU ($COMFY_METAL_TORCH=2.15.0: that release instead, as CI's second leg does).
# macOS: uses the torch you have (MPS build from PyPI) and clang-19 from Homebrew's llvm@19 if present.
# $PYTHON: the Python (environment) to set up and test in (default python3).
# The ComfyUI integration tests use $COMFYUI_PATH, else the ComfyUI the pack sits in, else the ComfyUI
# archive beside the project (../shared/comfyui/), unpacked once into ~/.cache/comfy-metal with ComfyUI's
# requirements installed (tests/tools/prepare_comfyui.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  APT=()
  command -v clang-19 >/dev/null 2>&1 || APT+=(clang-19)
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || APT+=(chromium)
  if [ ${#APT[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
  fi
elif ! command -v clang-19 >/dev/null 2>&1; then
  if [ "$(uname -s)" = "Darwin" ] && command -v brew >/dev/null 2>&1; then
    brew list llvm@19 >/dev/null 2>&1 || brew install llvm@19
    export PATH="$(brew --prefix llvm@19)/bin:$PATH"
    [ -e "$(brew --prefix llvm@19)/bin/clang-19" ] || export COMFY_METAL_EMU_CLANG="$(brew --prefix llvm@19)/bin/clang"
  fi
fi

PIN=$(mktemp)
if [ "$(uname -s)" = "Linux" ]; then
  # Pinned: an unpinned torch would pull the newest multi-GB CUDA build (2.13.0 is the CPU wheel here).
  TORCH_VERSION=${COMFY_METAL_TORCH:-2.13.0}
  echo "torch==$TORCH_VERSION" > "$PIN"
  $PY -m pip install -q "torch==$TORCH_VERSION"
fi
$PY -m pip install -q -c "$PIN" -e ".[test]"
rm -f "$PIN"
$PY tests/tools/prepare_comfyui.py

set +e
$PY -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
