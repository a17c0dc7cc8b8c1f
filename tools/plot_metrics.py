"""Draw a run's curves (``metrics.jsonl``) to PNG files in the run directory.

.venv/bin/python -m tools.plot_metrics runs/demo [runs/other ...]
"""

from __future__ import annotations

import argparse
import os
import sys

from lspo_jax.job.metrics_log import MetricsError
from lspo_jax.job.plots import plot_run

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/plot_metrics.py: run it from the repository root as python -m tools.plot_metrics ...")
from tools import run_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run_main("plot_metrics", _plot, argv)


def _plot(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", help="training output directories (--out of lspo-train)")
    run_dirs = p.parse_args(argv).run_dirs
    for run_dir in run_dirs:  # every directory checked before any is drawn
        if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
            raise FileNotFoundError(f"{run_dir}: no metrics.jsonl to draw; give lspo-train's --out directory")
    for run_dir in run_dirs:
        paths = plot_run(run_dir, say=lambda line: print(f"plot_metrics: {line}", file=sys.stderr))
        if not paths:  # a run not yet past its first step, or a file of records without a curve's keys
            raise MetricsError(f"{os.path.join(run_dir, 'metrics.jsonl')}: no training or validation records to draw")
        print("\n".join(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
