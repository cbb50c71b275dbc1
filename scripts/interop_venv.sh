#!/usr/bin/env bash
# Build (once) the LeRobot venv the interop tier serves policies from, and print its python's path.
#   bash scripts/interop_venv.sh
# A Python 3.12 venv with LeRobot from the package index, exactly as a user installs it, plus this repository's
# serving distribution (serve/). It is kept outside the checkout, keyed by its pins, so a second run reuses it:
# ${RESCUE_INTEROP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vlm-rescue/interop}/lerobot-<version>-py<python>-<key>.
# The serving distribution is reinstalled on every run (a few seconds, no download: its dependencies are there).
# Anything that fails here fails the tier: nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
LEROBOT_PIN="lerobot[diffusion]==0.6.1"
PYTHON_MINOR="3.12"

# python3.12 on PATH, or a pyenv install of it.
python=""
for candidate in "${INTEROP_PYTHON:-}" "python$PYTHON_MINOR" $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PYTHON_MINOR".*/bin/python"$PYTHON_MINOR" 2>/dev/null); do
  if [ -n "$candidate" ] && "$candidate" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$PYTHON_MINOR'" 2>/dev/null; then
    python="$candidate"
    break
  fi
done
if [ -z "$python" ]; then
  echo "interop: no Python $PYTHON_MINOR found (set INTEROP_PYTHON to one)" >&2
  exit 1
fi

# Built from a copy, so no build/ is left in the checkout.
src="$(mktemp -d)"
trap 'rm -rf "$src"' EXIT
cp -a serve/pyproject.toml serve/rescue_serve "$src/"

key="$(printf '%s\n' "$LEROBOT_PIN" "$("$python" -c 'import sys; print(sys.version)')" | sha256sum | cut -c1-12)"
root="${RESCUE_INTEROP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vlm-rescue/interop}"
venv="$root/lerobot-0.6.1-py$PYTHON_MINOR-$key"
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$root"
  echo "interop: installing $LEROBOT_PIN into $venv" >&2
  "$python" -m venv "$venv"
  # One resolve for both: the serving distribution must install beside LeRobot's pins at once.
  "$venv/bin/python" -m pip install -q "$LEROBOT_PIN" "$src" >&2
  touch "$venv/.complete"
fi
# The serving distribution as a user installs it (not editable): what the adapters import comes from serve/.
"$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$src" >&2
"$venv/bin/python" -m pip check >&2
echo "$venv/bin/python"
