"""The experiment tools: run each from the repository root as ``python -m tools.NAME`` (``--help`` says what it does).

Not part of the installed package: they use ``lspo_jax`` as a user would, and the tests import them as modules. Each
tool's ``main`` runs through ``run_main``, the commands' error funnel.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lspo_jax.job import errors
from lspo_jax.train_config import ConfigError

# The larger data files (GSM8K, AIME 1983-2023) that the tools read and the package never ships: the folder beside the
# repository where its developers keep them (``--data-dir`` names another).
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def run_main(prog: str, body: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """``body(argv)``'s exit status (None: 0) through the commands' funnel (``lspo_jax.job.errors``): a user error (a
    bad option, config, path or file, what the machine refused, the devices' memory) is one line ``PROG: what`` and
    exit 2, its traceback only with ``LSPO_JAX_DEBUG`` set; Ctrl-C is exit 130. argparse's usage errors and a
    status a tool raises itself (``SystemExit``) pass as they are; any other error is a bug: its traceback."""
    try:
        status = body(argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return errors.EXIT_INTERRUPTED
    except Exception as err:
        # The devices' memory is the commands' user error too: a shape the machine cannot hold, not a bug.
        if not (isinstance(err, errors.user_errors()) or errors.out_of_memory(err)):
            raise
        errors.debug_traceback()
        print(f"{prog}: {describe(err)}", file=sys.stderr)
        return errors.EXIT_CONFIG
    return status or 0


def describe(err: BaseException) -> str:
    """The commands' one line for ``err`` (``errors.describe``), without ``config error:`` before a ``ConfigError``: a
    tool's names the option or key it is about itself (``--arm none: scaffold.corection: unknown key``)."""
    if isinstance(err, ConfigError):
        lines = str(err).strip().splitlines()
        return lines[0] if lines else type(err).__name__
    return errors.describe(err)


def resume_or_restart(out: str, tool: str) -> bool:
    """Whether a tool's own run directory ``out`` is resumed (it holds a checkpoint). A run that stopped before its
    first checkpoint left records a new run is refused over (``lspo-train`` keeps an earlier run's records): the
    tool made them, so it removes them, says so, and the run starts again."""
    import shutil

    if errors.has_checkpoint(out):
        return True
    if os.path.isdir(out) and os.listdir(out):
        print(f"{tool}: {out} stopped before its first checkpoint; starting it again", file=sys.stderr)
        shutil.rmtree(out)
    return False


def write_json(path: str | None, result: Any) -> None:
    """A tool's ``--json`` output (none: nothing), indented for a reader."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def model_sizes(items: list[str]) -> dict[str, int]:
    """A tool's ``--model FIELD=INT`` options: the ``ModelConfig`` sizes they set, by field."""
    import dataclasses

    from lspo_jax.config import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    sizes = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in fields or not value.isdigit():
            raise ConfigError(f"--model {item!r}: expected FIELD=INT of a ModelConfig field, e.g. num_layers=4")
        sizes[name] = int(value)
    return sizes
