#!/usr/bin/env bash
# Set up, then run the test suite, or one tier of it (pyproject.toml registers the tiers):
#   bash scripts/test.sh               everything
#   bash scripts/test.sh fast          pure core and protocol tests, under a minute
#   bash scripts/test.sh slow          the rest: the simulator and end-to-end runs
#   bash scripts/test.sh sim           tests that need LIBERO (MuJoCo)
#   bash scripts/test.sh e2e           the CLI, servers or an install in subprocesses
#   bash scripts/test.sh interop       against the real LeRobot 0.6.1, in a Python 3.12 venv it builds once
#                                      (scripts/interop_venv.sh: ~5 GB, outside the checkout); in no other tier
# Anything else, or anything after a tier name, goes to pytest as is:
#   bash scripts/test.sh fast -x -q    bash scripts/test.sh -m "not sim and not e2e"
# SKIP_SETUP=1 skips scripts/setup.sh (an existing .venv is used as it is).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
export MUJOCO_GL="${MUJOCO_GL:-egl}"
# A tier runs on TEST_WORKERS pytest-xdist workers (default 2; 0 runs it in this process), a test module per
# worker at a time (tests/tiers_plugin.py).
WORKERS="${TEST_WORKERS:-2}"
case "${1:-}" in
  fast) shift; set -- -m "not sim and not e2e and not interop" -n "$WORKERS" --dist loadgroup --no-loadscope-reorder "$@" ;;
  slow) shift; set -- -m "sim or e2e" -n "$WORKERS" --dist loadgroup --no-loadscope-reorder "$@" ;;
  sim | e2e) tier="$1"; shift; set -- -m "$tier" -n "$WORKERS" --dist loadgroup --no-loadscope-reorder "$@" ;;
  # One process: its two policy servers and their studies share one LeRobot venv and the simulator.
  interop) shift; set -- -m interop "$@" ;;
esac
exec .venv/bin/python -m pytest "$@"
