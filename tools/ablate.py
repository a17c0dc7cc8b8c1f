"""An ablation grid: every combination of the ``--grid`` options, each trained with every seed, in the layout of
the paper's Table 1.

    .venv/bin/python -m tools.ablate --config configs/demo.yaml --grid 'scaffold.splice=partial,group' \\
        --grid 'scaffold.adapter=fresh,persistent' --seeds 42 43 44 --out runs/ablate \\
        [--json runs/ablate/ablate.json] [--results benchmarks/RESULTS.md] [dotted.key=value ...]

A cell is one value per ``--grid`` key (values parsed as YAML, as overrides are), named ``key=value,...`` by the
keys' last parts. Per (cell, benchmark, k): the peak of held-out pass@k (and of ``gold_logprob`` where recorded)
over the validation trace per seed, then its mean and range over seeds, and the difference from the first cell
(each key's first value: put the defaults first), paired by seed. Beside it, per cell over its seeds, the
scaffold's mechanism figures: the surpass rate (cliff groups with a verified re-roll over those attempted), the
per-rollout pass rate of the re-rolls, and the spliced ratio mean (the token-mean of pi_theta / pi_mu over spliced
rows, averaged over the steps that spliced).
Runs go to ``OUT/CELL_seedSEED``: a finished one is reused, an interrupted one or one that trained fewer steps than
``steps`` resumed (``compare_arms.run_cell``), one of another config or a seed given twice refused before anything
trains.
``--json`` writes the peaks and figures per cell and seed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from datetime import date

import yaml

from lspo_jax.job.compiles import use_cache
from lspo_jax.job.config import load_config
from lspo_jax.job.config_io import apply_overrides, from_dict, to_dict
from lspo_jax.train_config import ConfigError
from tools import tables

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/ablate.py: run it from the repository root as python -m tools.ablate ...")
from tools import run_main  # noqa: E402
from tools.compare_arms import append_results, check_reusable, check_seeds, provenance, run_cell, traces  # noqa: E402

FIGURES = ("surpass_rate", "rescue_pass_rate", "spliced_ratio_mean")


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """``KEY=V1,V2`` strings as ``(KEY, [V1, V2])``; a malformed one or a key given twice is a ``ConfigError``."""
    grid = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values or "" in values.split(","):
            raise ConfigError(f"--grid {item!r}: write KEY=VALUE1,VALUE2,...")
        if key in dict(grid):
            raise ConfigError(f"--grid {key}: given twice")
        grid.append((key, values.split(",")))
    return grid


def cells(base_config, grid: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """``(name, overrides)`` of every combination, the first values' first; each is checked to make a valid config
    before anything trains, so a bad value fails at once and names its key."""
    out = []
    for values in itertools.product(*(v for _, v in grid)):
        overrides = [f"{key}={value}" for (key, _), value in zip(grid, values, strict=True)]
        from_dict(type(base_config), apply_overrides(to_dict(base_config), overrides))
        out.append((",".join(f"{key.rsplit('.', 1)[-1]}={yaml.safe_load(v)}" for (key, _), v in zip(grid, values,
                                                                                                   strict=True)),
                    overrides))  # fmt: skip
    return out


def figures(result: dict) -> dict[str, float | None]:
    """The mechanism figures of one run (``FIGURES``; None where the run had nothing to measure)."""
    summary = result["summary"]
    ratios = [r["spliced_ratio_mean"] for r in result["train"] if r.get("spliced_ratio_mean") is not None]
    return {
        "surpass_rate": summary.get("surpass_rate"),
        "rescue_pass_rate": summary.get("rescue_pass_rate"),
        "spliced_ratio_mean": statistics.fmean(ratios) if ratios else None,
    }


def figures_table(results: list[dict], names: list[str]) -> str:
    """Per cell: each figure's mean [min, max] over the seeds that measured it."""
    rows = ["| cell | surpass rate (%) | per-rollout pass rate (%) | spliced ratio mean |", "|---|---|---|---|"]
    for name in names:
        per_seed = [figures(r) for r in results if r["arm"] == name]
        cols = []
        for figure, scale in zip(FIGURES, (100, 100, 1), strict=True):
            values = [f[figure] * scale for f in per_seed if f[figure] is not None]
            digits = 1 if scale == 100 else 3
            cols.append(f"{statistics.fmean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"
                        if values else "n/a")  # fmt: skip
        rows.append(f"| {name} | " + " | ".join(cols) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    return run_main("ablate", _ablate, argv)


def _ablate(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description="An ablation grid of config options, with paired seeds.")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="one option and its values")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    p.add_argument("--out", default="runs/ablate")
    p.add_argument("--horizon", type=int, default=None, help="only validation steps <= this count (default: steps)")
    p.add_argument("--results", default=None, help="append the tables to this Markdown file")
    p.add_argument("--json", default=None, help="write the peaks and figures per cell and seed here")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    check_seeds(args.seeds)
    base = load_config(args.config, args.overrides)
    grid = parse_grid(args.grid)
    if not grid:
        raise ConfigError("--grid: give at least one KEY=V1,V2")
    grid_cells = cells(base, grid)
    for name, overrides in grid_cells:
        for seed in args.seeds:
            check_reusable(base, name, overrides, seed, args.out)
    use_cache(base.compile_cache)  # the cells share their programs, and a rerun reads them back
    start, results = time.perf_counter(), []
    for seed in args.seeds:
        for i, (name, overrides) in enumerate(grid_cells):
            print(f"ablate: seed {seed}, cell {i + 1}/{len(grid_cells)}: {name}", file=sys.stderr, flush=True)
            results.append(run_cell(base, name, overrides, seed, args.out, "ablate"))
    minutes = (time.perf_counter() - start) / 60
    names = [name for name, _ in grid_cells]
    runs = traces(results)
    horizon, horizon_line = tables.resolve_horizon(runs, args.horizon)
    table = tables.peak_table(runs, ks=list(base.eval.ks), horizon=horizon, baseline=names[0])
    command = " ".join(["-m tools.ablate", *(argv if argv is not None else sys.argv[1:])])
    text = "\n\n".join([
        f"## Ablation on `{args.config}` ({date.today().isoformat()})",
        provenance(command, len(results), minutes),
        tables.caption(table),
        horizon_line,
        tables.markdown(table),
        "The scaffold's mechanism figures per cell, mean [min, max] over seeds (paper: 43% surpassed, 5.8% "
        "per-rollout pass rate):",
        figures_table(results, names),
    ])  # fmt: skip
    print(text)
    if args.json:
        per_run = {f"{r['arm']}_seed{r['seed']}": {"cell": r["arm"], "seed": r["seed"], **figures(r)} for r in results}
        peaks = {f"{b}|{tables.column_label(c)}|{arm}|{seed}": v for (b, c, arm, seed), v in table.peaks.items()}
        with open(args.json, "w") as f:
            json.dump({"horizon": table.horizon, "cells": dict(grid_cells), "runs": per_run, "peaks": peaks}, f,
                      indent=1)  # fmt: skip
        print(f"ablate: wrote {args.json}")
    append_results(args.results, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
