#!/usr/bin/env bash
# The fast tier on a busy machine: LOOPS busy loops (default 8) compete for the CPUs while it
# runs, as on a shared 2-core machine. It must pass all the same: tests assert behaviour, and
# bound only hangs, generously (timing belongs in benchmarks/).
#   bash scripts/busy_fast_tier.sh             8 busy loops, the fast tier
#   LOOPS=16 bash scripts/busy_fast_tier.sh -x  more load; anything after goes to pytest
# Uses the existing .venv as it is (SKIP_SETUP=1); the loops end with the script, however it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
loops="${LOOPS:-8}"
hogs=()
stop_hogs() {
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_hogs EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$loops"); do
  ( trap - EXIT INT TERM; while :; do :; done ) &
  hogs+=("$!")
done
echo "busy_fast_tier: $loops busy loops on $(nproc) CPUs (pids ${hogs[*]})" >&2
status=0
SKIP_SETUP=1 bash scripts/test.sh fast "$@" || status=$?
exit "$status"
