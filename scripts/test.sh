#!/usr/bin/env bash
# Set up .venv if needed, lint with ruff, then run the whole test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -p no:cacheprovider -q "$@"
