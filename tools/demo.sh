#!/usr/bin/env bash
# The demo: the main job on its embedded default config, on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
.venv/bin/lspo-train --config configs/demo.yaml --out "${OUT:-runs/demo}" "$@"
