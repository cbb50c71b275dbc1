#!/usr/bin/env bash
# Set up, then run the embedded end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rescue demo "$@"
