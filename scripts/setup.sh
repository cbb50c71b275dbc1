#!/usr/bin/env bash
# Set up a fresh machine: the system libraries MuJoCo's software rendering
# needs, then a virtual environment in .venv with the project and its
# simulator installed. Safe to run again; it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

# chromium: the report's browser test loads the page headless.
SYSTEM_PACKAGES=(libegl1 libegl-mesa0 libgl1 libosmesa6 chromium)
missing=()
for pkg in "${SYSTEM_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing system packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# torch first and pinned: its CPU build; a looser requirement resolved later
# would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# The project's pins; --upgrade-strategy only-if-needed keeps this fast on a re-run.
.venv/bin/python -m pip install -q -e ".[libero,test,learned,video,ray]"
