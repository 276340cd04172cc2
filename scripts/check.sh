#!/usr/bin/env bash
# Lint, formatting, types and the tests, in .venv (after scripts/install.sh); arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy over orsd_jax/ ([tool.mypy] in pyproject.toml) takes about 90 s from a cold cache, mostly
# reading jax's and numpy's stubs on one core: it runs beside the tests and is judged after them.
types=$(mktemp)
.venv/bin/mypy >"$types" 2>&1 &
mypy_pid=$!
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
wait "$mypy_pid" || status=1
cat "$types"
rm -f "$types"
exit "$status"
