#!/usr/bin/env bash
# Lint, formatting and types, in .venv (after scripts/install.sh); the README's test command runs
# the tests after it.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # orsd_jax/ ([tool.mypy] in pyproject.toml)
