"""Recorded training runs (arms x seeds) -> the paper's Table 1 layout, as Markdown and as a PNG plot.

Each run is a training output directory (its ``metrics.jsonl``; ``config.yaml`` for the arm and seed),
given as ``DIR`` (arm from ``scaffold.enabled``: lspo or dapo; seed from the config), ``ARM=DIR`` or
``ARM:SEED=DIR``. Per (run, benchmark, k) the peak of validation pass@k (and of ``gold_logprob``, the gold
solutions' log-likelihood per token, where the records hold it) up to ``--horizon`` steps (default: the runs'
configured ``steps``, the smallest when they differ), then the mean and [min, max] per arm and the difference from
the baseline arm, paired by seed where the arms ran the same seeds (``tools.tables``). The output says which
horizon it used.

    .venv/bin/python -m tools.compare_runs runs/lspo_seed4{2,3,4} runs/dapo_seed4{2,3,4} --horizon 500 \\
        [--out table.md] [--plot table.png] [--per-seed] [--estimator unbiased]
"""

from __future__ import annotations

import argparse
import os
import sys

from lspo_jax.job.metrics_log import MetricsError
from lspo_jax.train_config import ConfigError
from tools import tables

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/compare_runs.py: run it from the repository root as python -m tools.compare_runs ...")
from tools import run_main  # noqa: E402


def parse_run(item: str) -> tables.RunTrace:
    """``DIR``, ``ARM=DIR`` or ``ARM:SEED=DIR``; a directory without a run's records is a ``FileNotFoundError``, an
    arm or seed neither given nor in the run's ``config.yaml`` a ``ConfigError``."""
    label, sep, path = item.partition("=")
    if not sep:
        label, path = "", item
    arm, _, seed = label.partition(":")
    if seed and not seed.lstrip("-").isdigit():
        raise ConfigError(f"{item}: the seed {seed!r} is not an integer (write ARM:SEED=DIR)")
    if not os.path.isfile(os.path.join(path, "metrics.jsonl")):
        raise FileNotFoundError(f"{path}: not a training run (no metrics.jsonl); give lspo-train's --out directory")
    try:
        return tables.read_run(path, arm=arm or None, seed=int(seed) if seed else None)
    except MetricsError:
        raise
    except ValueError as err:  # read_run's own: the config.yaml does not say the run's arm or seed
        raise ConfigError(str(err)) from err


def main(argv: list[str] | None = None) -> int:
    return run_main("compare_runs", _compare, argv)


def _compare(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="DIR, ARM=DIR or ARM:SEED=DIR")
    p.add_argument("--horizon", type=int, default=None, help="only validation steps <= this (default: runs' steps)")
    p.add_argument("--estimator", default="first_k", choices=["first_k", "unbiased"])
    p.add_argument("--ks", default=None, help="comma-separated k (default: all the records hold)")
    p.add_argument("--benchmarks", default=None, help="comma-separated (default: all, in order of appearance)")
    p.add_argument("--baseline", default=None, help="the arm others are compared with (default: dapo)")
    p.add_argument("--per-seed", action="store_true", help="also the table of every run's peaks")
    p.add_argument("--out", default=None, help="write the Markdown here")
    p.add_argument("--plot", default=None, help="write the PNG plot here")
    args = p.parse_args(argv)
    runs = [parse_run(item) for item in args.runs]
    ks = args.ks.split(",") if args.ks else None
    if ks and not all(k.isdigit() and int(k) > 0 for k in ks):
        raise ConfigError(f"--ks {args.ks!r}: write positive integers separated by commas")
    horizon, horizon_line = tables.resolve_horizon(runs, args.horizon)
    try:
        table = tables.peak_table(
            runs,
            ks=[int(k) for k in ks] if ks else None,
            benchmarks=args.benchmarks.split(",") if args.benchmarks else None,
            estimator=args.estimator,
            horizon=horizon,
            baseline=args.baseline,
        )
    except ValueError as err:  # peak_table's refusals of what it was given: a baseline without runs, a seed twice
        raise ConfigError(str(err)) from err
    parts = [tables.caption(table), horizon_line, tables.markdown(table)]
    if args.per_seed:
        parts += ["Per run:", tables.markdown_per_seed(table)]
    text = "\n\n".join(parts) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.plot:
        print(f"plot: {tables.plot(table, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
