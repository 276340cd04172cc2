#!/usr/bin/env bash
# Lint, formatting, types and the tests, in .venv (after scripts/install.sh); arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # orsd_jax/ ([tool.mypy] in pyproject.toml)
.venv/bin/python -m pytest -q "$@"
