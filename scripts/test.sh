#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite.
#   scripts/test.sh           the whole suite: lint, the reliability suite, every test
#   scripts/test.sh --fast    the fast lane for every edit: lint and the tests that take under
#                             1.5 s each (no engines, no reliability suite; tests/slow.txt)
#   scripts/test.sh ARGS      lint, then pytest ARGS
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "lint: ruff + mypy" >&2
.venv/bin/ruff check --quiet .
.venv/bin/mypy --no-error-summary store lmctl engine_hook testsupport tests
if [ "${1:-}" = "--fast" ]; then
    shift
    exec .venv/bin/python -m pytest -q --fast "$@"
fi
if [ $# -eq 0 ]; then
    echo "reliability suite: stress/reliability.py --quick (kills, bit flips, a full disk, hostile frames, concurrent clients)" >&2
    .venv/bin/python stress/reliability.py --quick 2>/dev/null
fi
exec .venv/bin/python -m pytest -q "$@"
