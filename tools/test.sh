#!/usr/bin/env bash
# The test command: installs what the tests need, then lint, format check and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
