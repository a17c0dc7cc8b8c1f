"""Curves of a run's ``metrics.jsonl`` as PNG files (training and validation).

Per step the curves take the step's last record: a run resumed after a crash may have logged steps again, and
the later record is the one the run went on from, so a line never goes back in step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np

from lspo_jax.job.metrics_log import read_metrics

# (key in train records, panel title, smoothed); a panel is drawn only if some record holds its key.
TRAIN_PANELS = (
    ("loss", "policy loss", True),
    ("reward_mean", "reward (mean over rollouts)", True),
    ("accuracy_mean", "rollout accuracy", True),
    ("grad_norm", "grad norm (before clipping)", True),
    ("approx_kl", "approx KL(old || new), k3", True),
    ("lr", "learning rate", False),  # a schedule, not noise
    ("entropy", "entropy", True),
    ("response_len_mean", "response length", True),
    ("cliff_groups", "cliff groups", True),
    ("surpassed_groups", "surpassed groups", True),
    ("rescue_pass_rate", "re-rollout pass rate", True),
)
PANEL_COLUMNS = 4


def plot_run(run_dir: str, say: Callable[[str], None] | None = None) -> list[str]:
    """Write ``train_curves.png`` (and ``eval_curves.png`` when there are validation records); their paths. ``say``
    hears of a last record cut off mid-write, which is not drawn (``read_metrics``)."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"), say)
    written = []
    for fig, name in ((train_figure(records), "train_curves.png"), (eval_figure(records), "eval_curves.png")):
        if fig is not None:
            written.append(_save(fig, os.path.join(run_dir, name)))
    return written


def last_per_step(records: list[dict], group: str | None = None) -> list[dict]:
    """The last record of each step (per ``group`` key value when given, e.g. ``benchmark``), in step order."""
    last = {(r.get(group) if group else None, r["step"]): r for r in records}
    return [last[k] for k in sorted(last, key=lambda k: k[1])]


def smooth(values: np.ndarray) -> np.ndarray:
    """Centred moving average over ``2h + 1`` points, ``h = max(1, n // 25)`` (fewer at the ends).

    Centred rather than an EMA so the smoothed curve does not lag the raw points by the window.
    """
    h = max(1, len(values) // 25)
    sums = np.concatenate([[0.0], np.cumsum(values)])
    lo, hi = np.maximum(np.arange(len(values)) - h, 0), np.minimum(np.arange(len(values)) + h + 1, len(values))
    return (sums[hi] - sums[lo]) / (hi - lo)


def train_figure(records: list[dict]):
    """One panel per ``TRAIN_PANELS`` key that a train record holds; None without train records."""
    train = last_per_step([r for r in records if r.get("kind", "train") == "train"])
    series = {}
    for key, title, smoothed in TRAIN_PANELS:
        points = [(r["step"], r[key]) for r in train if isinstance(r.get(key), int | float)]
        if points:
            series[key] = (title, smoothed, np.array(points, dtype=float).T)
    if not series:
        return None
    fig = _figure(len(series))
    for ax, (title, smoothed, (steps, values)) in zip(fig.axes, series.values(), strict=True):
        if smoothed and len(values) >= 3:
            ax.plot(steps, values, marker=".", linewidth=0.5, alpha=0.3, color="C0")
            ax.plot(steps, smooth(values), linewidth=1.5, color="C0")
        else:
            ax.plot(steps, values, marker=".", linewidth=1, color="C0")
        ax.set_title(title)
        _step_axis(ax)
    return fig


def eval_figure(records: list[dict]):
    """Per benchmark: per-sample ``accuracy`` and pass@k by each estimator, in percent (as the console prints);
    beside it, for a benchmark with gold solutions, their log-likelihood under the base. None without eval records."""
    evals = last_per_step([r for r in records if r.get("kind") == "eval"], group="benchmark")
    benchmarks = list(dict.fromkeys(r.get("benchmark", "held_out") for r in evals))
    if not benchmarks:
        return None
    per_benchmark = {name: [r for r in evals if r.get("benchmark", "held_out") == name] for name in benchmarks}
    gold = {name: any(_number(r.get("gold_logprob")) for r in mine) for name, mine in per_benchmark.items()}
    cells = None
    if any(gold.values()):  # a row per benchmark, its gold panel beside its pass@k one (or an empty cell)
        cells = [2 * i + j for i, name in enumerate(benchmarks) for j in range(1 + gold[name])]
    fig = _figure(len(cells or benchmarks), columns=2, size=(6.5, 3.5), cells=cells)
    axes = iter(fig.axes)
    for name, mine in per_benchmark.items():
        _pass_panel(next(axes), name, mine)
        if gold[name]:
            _gold_panel(next(axes), name, mine)
    return fig


def _pass_panel(ax, name: str, records: list[dict]) -> None:
    # A broad translucent band: pass@1 (unbiased) equals it whenever every problem has the same n samples.
    _eval_line(ax, records, "accuracy", "accuracy (mean over samples)", color="0.5", linewidth=5, alpha=0.4)
    ks = sorted({int(k[5:]) for r in records for k in r if k.startswith("pass@") and k[5:].isdigit()})
    for i, k in enumerate(ks):
        _eval_line(ax, records, f"pass@{k}", f"pass@{k} (first-k)", color=f"C{i}")
        _eval_line(ax, records, f"pass@{k}_unbiased", f"pass@{k} (unbiased)", color=f"C{i}", linestyle="--")
    problems = records[-1].get("problems")
    ax.set_title(f"{name}: held-out" + (f", {problems} problems" if problems else ""))
    ax.set_ylabel("%")
    _step_axis(ax)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1))  # beside: never over the lines


def _gold_panel(ax, name: str, records: list[dict]) -> None:
    """``gold_logprob`` (nats per gold token) against the step; the right axis reads it per solution, which is the
    same curve times the benchmark's constant mean solution length (``gold_logprob_seq``)."""
    points = [(r["step"], r["gold_logprob"]) for r in records if _number(r.get("gold_logprob"))]
    ax.plot(*zip(*points, strict=True), marker="o", color="C3")
    last = records[-1]
    solutions, tokens = last.get("gold_solutions"), last.get("gold_tokens")
    ax.set_title(f"{name}: " + (f"{solutions} gold solutions" if solutions else "gold solutions"))
    ax.set_ylabel("log-likelihood, nats per token")
    if solutions and tokens:
        length = tokens / solutions
        ax.secondary_yaxis("right", functions=(lambda x: x * length, lambda y: y / length)).set_ylabel(
            "nats per solution"
        )
    _step_axis(ax)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _eval_line(ax, records: list[dict], key: str, label: str, **style) -> None:
    points = [(r["step"], 100 * r[key]) for r in records if isinstance(r.get(key), int | float)]
    if points:
        ax.plot(*zip(*points, strict=True), marker="o", label=label, **style)


def _figure(panels: int, columns: int = PANEL_COLUMNS, size: tuple[float, float] = (4, 3), cells=None):
    """A figure of exactly ``panels`` axes (``fig.axes``), row by row: no empty cells, or with ``cells`` (grid
    indices, row by row from 0) only those filled, so that rows can line up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(cells if cells is not None else range(panels))
    columns = min(columns, max(cells) + 1)
    rows = math.ceil((max(cells) + 1) / columns)
    fig = plt.figure(figsize=(size[0] * columns, size[1] * rows), layout="constrained")
    for i in cells:
        fig.add_subplot(rows, columns, i + 1)
    return fig


def _step_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # An offset turns a near-constant curve's ticks into "1e-5+5.5927"; print the values themselves.
    ax.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
