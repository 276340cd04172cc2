#!/usr/bin/env bash
# Lint, formatting and the tests, in .venv (after scripts/install.sh); arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q "$@"
