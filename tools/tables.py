"""Arms x seeds of training runs in the layout of the paper's Table 1, from their validation records.

Per (run, benchmark, k): the peak of held-out pass@k over the run's validation trace, up to a step horizon
(by default the runs' configured ``steps``: a run trained or resumed past the matched horizon, such as the
paper's 1000 steps, must not win on steps the other arm never had); beside it, where the records hold it, the
peak of ``gold_logprob`` (the base's log-likelihood per gold-solution token: higher is better, so also the max).
Per arm: the mean and range [min, max] of those peaks over its seeds. Per other arm: its difference from the
baseline arm (``lspo - dapo``): with the same seeds (paired) the mean and range of the per-seed differences,
else the difference of the means. ``tools/compare_runs.py`` (recorded runs), ``tools/compare_arms.py`` and
``tools/ablate.py`` (runs they train) print these tables.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import yaml

from lspo_jax.job.evaluation import ESTIMATORS, GOLD_KEYS, metric_key
from lspo_jax.job.metrics_log import read_metrics

# The benchmark of validation records written before records named theirs (one pooled held-out set).
UNNAMED_BENCHMARK = "held_out"
# Metrics tabulated beside pass@k when the records hold them; like pass@k, higher is better. ``accuracy`` is the
# per-sample pass rate over all n samples a problem (pass@1 by the first-k slice reads the first sample alone).
EXTRA_METRICS = ("accuracy", "gold_logprob")
PERCENT_METRICS = ("accuracy",)
Column = int | str  # a table column: k of pass@k, or the name of an ``EXTRA_METRICS`` metric


@dataclasses.dataclass(frozen=True)
class RunTrace:
    """One training run: its arm, its seed, its validation records (``kind: eval`` of ``metrics.jsonl``) and
    its configured ``steps`` (None when unknown)."""

    arm: str
    seed: int
    evals: tuple[dict[str, Any], ...]
    path: str = ""
    steps: int | None = None


def benchmark_of(record: dict[str, Any]) -> str:
    return record.get("benchmark", UNNAMED_BENCHMARK)


def read_run(path: str, arm: str | None = None, seed: int | None = None) -> RunTrace:
    """A run directory's validation trace; ``arm`` and ``seed`` default to its ``config.yaml``
    (``scaffold.enabled`` -> ``lspo``, else ``dapo``; ``seed``), which also gives its ``steps``."""
    config_path = os.path.join(path, "config.yaml")
    config: dict[str, Any] = {}
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = yaml.safe_load(f) or {}
    if arm is None:
        if not config:
            raise ValueError(f"{path}: no config.yaml to tell the arm from; write it as ARM=DIR")
        arm = "lspo" if (config.get("scaffold") or {}).get("enabled", True) else "dapo"
    if seed is None:
        if "seed" not in config:
            raise ValueError(f"{path}: no seed in a config.yaml; write it as ARM:SEED=DIR")
        seed = int(config["seed"])
    records = read_metrics(os.path.join(path, "metrics.jsonl"))
    steps = int(config["steps"]) if config.get("steps") is not None else None
    return RunTrace(arm, seed, tuple(r for r in records if r.get("kind") == "eval"), path, steps)


def resolve_horizon(runs: Sequence[RunTrace], horizon: int | None = None) -> tuple[int | None, str]:
    """``(horizon, a line saying where it came from)``: ``horizon`` when given, else the smallest of the runs'
    configured ``steps`` (None, the whole trace, when no run says)."""
    if horizon is not None:
        return horizon, f"Horizon: validation steps <= {horizon} (--horizon)."
    steps = sorted({run.steps for run in runs if run.steps is not None})
    unknown = sum(run.steps is None for run in runs)
    if not steps:
        return None, "Horizon: the whole trace (no run's config.yaml gives its steps; set --horizon)."
    note = f"; {unknown} of {len(runs)} runs do not say theirs" if unknown else ""
    if len(steps) > 1:
        listed = ", ".join(map(str, steps))
        return steps[0], f"Horizon: validation steps <= {steps[0]}, the smallest of the runs' steps ({listed}){note}."
    return steps[0], f"Horizon: validation steps <= {steps[0]}, the runs' configured steps{note}."


def peak(evals: Iterable[dict[str, Any]], benchmark: str, key: str, horizon: int | None = None) -> float:
    """The largest ``key`` over the records of ``benchmark`` at steps <= ``horizon``; NaN when there is none."""
    values = [
        r[key]
        for r in evals
        if benchmark_of(r) == benchmark and r.get(key) is not None and (horizon is None or r["step"] <= horizon)
    ]
    return max(values) if values else math.nan


@dataclasses.dataclass
class PeakTable:
    """Peaks per (benchmark, column, arm, seed), a column being k of pass@k or an ``extra`` metric's name, and
    what they were computed over."""

    benchmarks: list[str]
    ks: list[int]
    arms: list[str]  # the baseline first
    seeds: dict[str, list[int]]
    peaks: dict[tuple[str, Column, str, int], float]
    estimator: str
    horizon: int | None
    extra: list[str] = dataclasses.field(default_factory=list)

    @property
    def baseline(self) -> str:
        return self.arms[0]

    @property
    def columns(self) -> list[Column]:
        return [*self.ks, *self.extra]

    def values(self, benchmark: str, column: Column, arm: str) -> list[float]:
        """The arm's peaks over its seeds (in seed order), runs without a record left out."""
        values = [self.peaks[benchmark, column, arm, s] for s in self.seeds[arm]]
        return [v for v in values if not math.isnan(v)]

    def summary(self, benchmark: str, column: Column, arm: str) -> tuple[float, float, float] | None:
        """``(mean, min, max)`` over the arm's seeds, or None without any value."""
        values = self.values(benchmark, column, arm)
        return (float(np.mean(values)), min(values), max(values)) if values else None

    def difference(self, benchmark: str, column: Column, arm: str) -> tuple[float, tuple[float, float] | None] | None:
        """``arm`` minus the baseline. Paired (the same seeds): the mean of the per-seed differences over the seeds
        both have a value for, and their [min, max]; else the difference of the means and None."""
        mine, base = self.summary(benchmark, column, arm), self.summary(benchmark, column, self.baseline)
        if mine is None or base is None:
            return None
        if self.seeds[arm] == self.seeds[self.baseline]:
            diffs = [self.peaks[benchmark, column, arm, s] - self.peaks[benchmark, column, self.baseline, s]
                     for s in self.seeds[arm]]  # fmt: skip
            diffs = [d for d in diffs if not math.isnan(d)]
            if diffs:
                return float(np.mean(diffs)), (min(diffs), max(diffs))
        return mine[0] - base[0], None


def _ks_in(runs: Sequence[RunTrace], estimator: str) -> list[int]:
    suffix = ESTIMATORS[estimator]
    ks = set()
    for run in runs:
        for record in run.evals:
            for key in record:
                k = (
                    key[len("pass@") : len(key) - len(suffix)]
                    if key.startswith("pass@") and key.endswith(suffix)
                    else ""
                )
                if k.isdigit():
                    ks.add(int(k))
    return sorted(ks)


def peak_table(
    runs: Sequence[RunTrace],
    *,
    ks: Sequence[int] | None = None,
    benchmarks: Sequence[str] | None = None,
    estimator: str = "first_k",
    horizon: int | None = None,
    baseline: str | None = None,
    extra: Sequence[str] | None = None,
) -> PeakTable:
    """Peaks of every run. Benchmarks, ks and ``extra`` metrics (of ``EXTRA_METRICS``) default to all the records
    hold (benchmarks in order of first appearance); the baseline defaults to ``dapo`` when there is such an arm,
    else the last arm."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
    arms = list(dict.fromkeys(run.arm for run in runs))
    baseline = baseline or ("dapo" if "dapo" in arms else arms[-1])
    if baseline not in arms:
        raise ValueError(f"baseline arm {baseline!r} has no runs; arms: {arms}")
    seeds = {arm: sorted(run.seed for run in runs if run.arm == arm) for arm in arms}
    for arm, arm_seeds in seeds.items():
        if len(set(arm_seeds)) != len(arm_seeds):
            raise ValueError(f"arm {arm!r} has two runs with the same seed: {arm_seeds}")
    benchmarks = list(benchmarks or dict.fromkeys(benchmark_of(r) for run in runs for r in run.evals))
    ks = list(ks or _ks_in(runs, estimator))
    if extra is None:
        extra = [m for m in EXTRA_METRICS if any(r.get(m) is not None for run in runs for r in run.evals)]
    columns = {**{k: metric_key(k, estimator) for k in ks}, **{m: m for m in extra}}
    peaks = {
        (b, column, run.arm, run.seed): peak(run.evals, b, key, horizon)
        for run in runs
        for b in benchmarks
        for column, key in columns.items()
    }
    arms = [baseline] + [a for a in arms if a != baseline]
    return PeakTable(benchmarks, ks, arms, seeds, peaks, estimator, horizon, list(extra))


# ------------------------------------------------------------------------------------------------ output
def column_label(column: Column) -> str:
    return f"pass@{column}" if isinstance(column, int) else column


def _value(column: Column, x: float, sign: str = "") -> str:
    """pass@k in percent with one decimal; a log-likelihood in nats with three (a change of a few thousandths of
    a nat a token is already a visible move of a solution's likelihood)."""
    if isinstance(column, int) or column in PERCENT_METRICS:
        return f"{100 * x:{sign}.1f}"
    return f"{x:{sign}.3f}"


def _summary_cell(table: PeakTable, b: str, column: Column, arm: str) -> str:
    s, count = table.summary(b, column, arm), len(table.values(b, column, arm))
    if s is None:
        return "n/a"
    cell = f"{_value(column, s[0])} [{_value(column, s[1])}, {_value(column, s[2])}]"
    if count < len(table.seeds[arm]):  # some runs have no record of this benchmark
        cell += f" ({count} of {len(table.seeds[arm])} runs)"
    return cell


def _difference_cell(table: PeakTable, b: str, column: Column, arm: str) -> str:
    d = table.difference(b, column, arm)
    if d is None:
        return "n/a"
    spread = "" if d[1] is None else f" [{_value(column, d[1][0], '+')}, {_value(column, d[1][1], '+')}]"
    return _value(column, d[0], "+") + spread


def markdown(table: PeakTable) -> str:
    """Rows (benchmark, arm) and (benchmark, arm - baseline); columns pass@k (%) and the extra metrics: mean
    [min, max] over seeds, and for a difference the mean [min, max] of the paired per-seed differences (the
    difference of the means when the seeds do not pair)."""
    lines = [
        "| benchmark | arm | " + " | ".join(map(column_label, table.columns)) + " |",
        "|---|---|" + "---|" * len(table.columns),
    ]
    for b in table.benchmarks:
        for arm in table.arms:
            cells = [_summary_cell(table, b, c, arm) for c in table.columns]
            lines.append(f"| {b} | {arm} (n={len(table.seeds[arm])}) | " + " | ".join(cells) + " |")
        for arm in table.arms[1:]:
            cells = [_difference_cell(table, b, c, arm) for c in table.columns]
            lines.append(f"| {b} | {arm} - {table.baseline} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_per_seed(table: PeakTable) -> str:
    """Every run's peaks: rows (benchmark, arm, seed), columns pass@k (%) and the extra metrics."""
    lines = ["| benchmark | arm | seed | " + " | ".join(map(column_label, table.columns)) + " |",
             "|---|---|---|" + "---|" * len(table.columns)]  # fmt: skip
    for b in table.benchmarks:
        for arm in table.arms:
            for seed in table.seeds[arm]:
                values = [(c, table.peaks[b, c, arm, seed]) for c in table.columns]
                cells = ["n/a" if math.isnan(v) else _value(c, v) for c, v in values]
                lines.append(f"| {b} | {arm} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def caption(table: PeakTable) -> str:
    horizon = "the whole trace" if table.horizon is None else f"validation steps <= {table.horizon}"
    estimator = "first-k slice" if table.estimator == "first_k" else "unbiased estimator"
    gold = (" and peak gold_logprob (the base's mean log-likelihood per token of the gold solutions, nats)"
            if "gold_logprob" in table.extra else "")  # fmt: skip
    accuracy = ", peak per-sample accuracy (%, all n samples)" if "accuracy" in table.extra else ""
    return (f"Peak held-out pass@k (%, {estimator}){accuracy}{gold} over {horizon}, per arm: mean [min, max] over "
            "seeds; a difference row: the mean [min, max] of the per-seed differences (seeds paired), or the "
            "difference of the means.")  # fmt: skip


def plot(table: PeakTable, path: str) -> str:
    """One panel per benchmark: each arm's mean peak pass@k against k, the band its [min, max] over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table.benchmarks), figsize=(4.5 * len(table.benchmarks), 3.8),
                             constrained_layout=True, squeeze=False)  # fmt: skip
    for ax, b in zip(axes[0], table.benchmarks, strict=True):
        for arm in table.arms:
            points = [(k, s) for k in table.ks if (s := table.summary(b, k, arm)) is not None]
            if not points:
                continue
            ks = [k for k, _ in points]
            mean, low, high = (np.array([100 * s[i] for _, s in points]) for i in range(3))
            line = ax.plot(ks, mean, marker="o", label=f"{arm} (n={len(table.seeds[arm])})")[0]
            ax.fill_between(ks, low, high, color=line.get_color(), alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(table.ks, [str(k) for k in table.ks])
        ax.set_xlabel("k")
        ax.set_ylabel("peak pass@k (%)")
        ax.set_title(b)
        ax.legend()
    fig.suptitle(caption(table), fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------- traces
def metric_keys(records: Iterable[dict[str, Any]]) -> list[str]:
    """The held-out metrics the records hold: pass@k by each estimator, the per-sample ``accuracy``, then the gold
    solutions' log-likelihood (``evaluation.GOLD_KEYS``)."""
    keys = dict.fromkeys(k for r in records for k in r if k.startswith("pass@") or k == "accuracy" or k in GOLD_KEYS)
    rank = lambda k: (k in GOLD_KEYS, k == "accuracy", k.endswith(ESTIMATORS["unbiased"]), len(k), k)
    return sorted(keys, key=rank)


def start_peak_last(runs: Sequence[RunTrace], horizon: int | None) -> dict[str, Any]:
    """``{"horizon": H, "arms": {arm: {seed: {benchmark: {metric: {"start", "peak", "last", "mean"}}}}}}``: per run
    the first, largest and last value of every held-out metric over its validation steps <= ``horizon`` (the
    largest is the best for every one of them, the log-likelihoods included), and the mean over those after step 0
    (the trained trace: a decay late in a run hides from a peak, and one last value is noisy)."""
    arms: dict[str, dict[str, Any]] = {}
    for run in runs:
        within = [r for r in run.evals if horizon is None or r["step"] <= horizon]
        per_benchmark: dict[str, Any] = {}
        for b in dict.fromkeys(map(benchmark_of, within)):
            records = sorted((r for r in within if benchmark_of(r) == b), key=lambda r: r["step"])
            per_benchmark[b] = {
                key: {"start": values[0][1], "peak": max(v for _, v in values), "last": values[-1][1],
                      **({"mean": float(np.mean(trained))} if (trained := [v for s, v in values if s > 0]) else {})}
                for key in metric_keys(records)
                if (values := [(r["step"], r[key]) for r in records if r.get(key) is not None])
            }  # fmt: skip
        arms.setdefault(run.arm, {})[str(run.seed)] = per_benchmark
    return {"horizon": horizon, "arms": arms}


def curves(runs: Sequence[RunTrace], benchmark: str, key: str, horizon: int | None = None) -> dict[str, Any]:
    """Per arm: ``(steps, mean, min, max, seeds)`` of ``key`` over the arm's seeds, at the validation steps every
    one of them reached (up to ``horizon``); a seed that validated ``benchmark`` but never recorded ``key`` is left
    out, one that never validated it leaves the arm without a curve."""
    out = {}
    for arm in dict.fromkeys(run.arm for run in runs):
        traces = []
        for run in (r for r in runs if r.arm == arm):
            records = [r for r in run.evals if benchmark_of(r) == benchmark]
            if records and all(r.get(key) is None for r in records):
                continue  # validated, but never recorded the key (older code): this seed is left out, not the arm
            points = {r["step"]: r[key] for r in records if r.get(key) is not None}
            traces.append({s: v for s, v in points.items() if horizon is None or s <= horizon})
        steps = sorted(set.intersection(*(set(t) for t in traces))) if traces else []
        if steps:
            values = np.array([[t[s] for s in steps] for t in traces])
            out[arm] = (steps, values.mean(0), values.min(0), values.max(0), len(traces))
    return out


def plot_curves(runs: Sequence[RunTrace], path: str, key: str = "pass@1", horizon: int | None = None) -> str:
    """One panel per benchmark (the demo: one per difficulty class): each arm's held-out ``key`` against the
    step, the line its mean over seeds and the band its [min, max]. Rates (accuracy, pass@k) are drawn in percent on
    one 0-100 scale; any other key (a log-likelihood, an entropy) in its own units, each panel scaled to its data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks = list(dict.fromkeys(benchmark_of(r) for run in runs for r in run.evals))
    fig, axes = plt.subplots(1, len(benchmarks), figsize=(4.5 * len(benchmarks), 3.6),
                             constrained_layout=True, squeeze=False)  # fmt: skip
    rate = key == "accuracy" or key.startswith("pass@")
    scale = 100 if rate else 1
    for ax, b in zip(axes[0], benchmarks, strict=True):
        for arm, (steps, mean, low, high, n) in curves(runs, b, key, horizon).items():
            label = f"{arm} (mean of {n} seeds)" if n > 1 else f"{arm} (1 seed)"
            line = ax.plot(steps, scale * mean, marker="o", markersize=3, label=label)[0]
            ax.fill_between(steps, scale * low, scale * high, color=line.get_color(), alpha=0.2)
        ax.set_title(b)
        if rate:
            ax.set_ylim(-2, 102)  # one scale for every panel: a class stuck at 0 reads as 0, not as a flat middle
        ax.set_xlabel("step")
        ax.set_ylabel(f"held-out {key}{' (%)' if rate else ''}")
    # One legend for every panel, beside them: with eight arms a legend in each panel hid the lines it named.
    labelled = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    if labelled:
        fig.legend(labelled.values(), labelled.keys(), loc="outside right center", fontsize="small")
    fig.suptitle(f"Held-out {key} per benchmark: mean over seeds, band = [min, max]", fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
