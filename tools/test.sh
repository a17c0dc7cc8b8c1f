#!/usr/bin/env bash
# The test command: installs what the tests need, then lint, format check and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two worker processes, whole test files each (so module fixtures are built once). Much of the suite is XLA
# compiling on one thread; on the 2-core work machine the suite went from 589 s to 395-427 s (the slowest files
# first, in tests/conftest.py's order: --no-loadscope-reorder keeps xdist from sorting files by test count).
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
