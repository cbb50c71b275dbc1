#!/usr/bin/env bash
# Set up a fresh machine: the system libraries MuJoCo's software rendering
# needs, then a virtual environment in .venv with the project and its
# simulator installed. Safe to run again; it skips what is already there (on a
# set-up machine it installs nothing: see the stamp below).
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

# A re-run on a set-up machine skips the Python packages when nothing they come from changed since
# the last complete install here (the stamp: both pyproject.toml files, this script, the interpreter and this
# checkout's path) and pip finds what is installed consistent. SETUP_FORCE=1 installs again.
STAMP=.venv/.setup-stamp
stamp() { { cat pyproject.toml serve/pyproject.toml scripts/setup.sh; .venv/bin/python -VV; pwd -P; } | sha256sum | cut -d" " -f1; }
if [ "${SETUP_FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp)" ] \
    && .venv/bin/python -m pip check >/dev/null 2>&1; then
  echo "setup: .venv is in place (installed from this pyproject.toml; SETUP_FORCE=1 installs again)"
  exit 0
fi
rm -f "$STAMP"
# torch first and pinned: its CPU build; a looser requirement resolved later
# would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# A project installed before it depended on the serving distribution shipped rescue_serve and the rescue-serve
# script itself: remove that install first, or replacing it would take the serving distribution's files along.
if .venv/bin/python -m pip show -f vlm-rescue 2>/dev/null | grep "bin/rescue-serve$" >/dev/null; then
  .venv/bin/python -m pip uninstall -q -y vlm-rescue
fi
# The serving distribution (serve/: the project depends on it, and it is on no package index) and the project with
# its pins, both editable, in one resolve: pip installs the serving distribution first.
.venv/bin/python -m pip install -q -e ./serve -e ".[libero,test,learned,video,ray]"
stamp > "$STAMP"
