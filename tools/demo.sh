#!/usr/bin/env bash
# The demo: lspo-train on configs/demo.yaml, on the CPU. Writes runs/demo (replaced each run).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
out="${OUT:-runs/demo}"
rm -rf "$out"
.venv/bin/lspo-train --config configs/demo.yaml --out "$out" "$@"
