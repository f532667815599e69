#!/usr/bin/env bash
# Set up .venv if needed, then run the main demo (extra arguments go to `capg-rec demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/capg-rec demo "$@"
