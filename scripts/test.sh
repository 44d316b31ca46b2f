#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "lint: ruff + mypy" >&2
.venv/bin/ruff check --quiet .
.venv/bin/mypy --no-error-summary store lmctl engine_hook
exec .venv/bin/python -m pytest -q "$@"
