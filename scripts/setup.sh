#!/usr/bin/env bash
# Create (or reuse) the local virtual environment .venv with the known-good CPU stack.
# Idempotent: does nothing when the pinned requirements have not changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
stamp=.venv/.capg-rec-setup
want="$(cat requirements-dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps torchrec==1.8.0
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
echo "$want" > "$stamp"
