"""The horizon study's tables from finished runs: per held-out class and metric, each arm's peak (the paper's protocol),
value at the last validation and mean over the trained trace (steps > 0), over seeds, and each arm minus DAPO paired
by seed; then, per run, what the frontier class did (its pass@k peak and where, its last value, the entropy of its
sampled answers from start to end); then each arm's mechanism (cliff groups, the scaffold's surpass and re-roll pass
rates, rollouts spent per step, the spliced rows' mean importance ratio and gradient share, dynamic sampling's kept
groups and the steps it hit its bound, from each run's ``summary.json`` and training records); then, at the horizon,
each arm's gain on the frontier class (pass@8, coverage pass@256 where validation recorded a coverage pass, accuracy)
against its cost on the learned 3-digit class (accuracy), each minus DAPO paired by seed; and per run of the LSPO
family its adapter reliance (the mean over its steps of ``scaffold/adapter_reliance``) and its spliced rows' share of
the gradient norm at steps 50 and 150 (``spliced_grad_share``, recorded with ``scaffold.grad_share: true``) beside
its transfer, and Pearson's r between those figures and the transfer, pooled, within seed and within arm. Nothing
trains: the runs are ``OUT/ARM_seedSEED`` directories that ``tools.compare_arms`` wrote, and a run without
``summary.json`` (unfinished) is left out and named.

    .venv/bin/python -m tools.horizon_study --out runs/horizon --arms dapo lspo direct --seeds 42 43 44 45 46 \\
        [--horizon 200] [--metrics accuracy pass@8 gold_logprob] [--plot runs/horizon/study] [--json study.json] \\
        [--coverage-k 256] [--share-steps 50 150] [--earlier OLD.json:lspo=lspo_before ...]

``--earlier JSON:ARM[=NAME]`` adds an arm of an earlier study's ``--json`` (its runs no longer on disk) to the
gain-against-cost table and picture, when that study's baseline is this one's to the last digit on the seeds both
hold (the same runs, or runs that reproduce them); otherwise it refuses, naming the seeds that differ.

``--plot PREFIX`` draws ``PREFIX_KEY.png`` per metric: each arm's mean curve over its seeds and their range (the
seed band), one panel per class; and ``PREFIX_gain_cost.png``: per arm, its frontier gain against its 3-digit cost
(both minus DAPO), the bars its seeds' range. Figures are percentages for accuracy and pass@k, nats per token for
``gold_logprob``, nats for ``answer_entropy``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence

import numpy as np

from lspo_jax.train_config import ConfigError
from tools import tables

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/horizon_study.py: run it from the repository root as python -m tools.horizon_study ...")
from tools import run_main  # noqa: E402

STATS = ("peak", "last", "mean")
FRONTIER = "frontier"  # the demo's class at the edge of the base's reach: its benchmark name holds this word
ENTROPY = "answer_entropy"


def scale(metric: str) -> float:
    """Rates are shown as percentages; log-likelihoods and entropies as they are."""
    return 100.0 if metric == "accuracy" or metric.startswith("pass@") else 1.0


def summarize(run: tables.RunTrace, horizon: int | None, metrics: Sequence[str]) -> dict[str, dict[str, dict]]:
    """``{class: {metric: {"start", "peak", "last", "mean"}}}`` of one run's validations up to ``horizon``; the mean
    is over the validations after step 0, and every figure is scaled for display."""
    out: dict[str, dict[str, dict]] = {}
    within = [r for r in run.evals if horizon is None or r["step"] <= horizon]
    for benchmark in dict.fromkeys(map(tables.benchmark_of, within)):
        records = sorted((r for r in within if tables.benchmark_of(r) == benchmark), key=lambda r: r["step"])
        for metric in metrics:
            trace = [(r["step"], r[metric] * scale(metric)) for r in records if r.get(metric) is not None]
            if not trace:
                continue
            trained = [v for s, v in trace if s > 0]
            out.setdefault(benchmark, {})[metric] = {
                "start": trace[0][1],
                "start_step": trace[0][0],
                "peak": max(v for _, v in trace),
                "peak_step": max(trace, key=lambda sv: sv[1])[0],
                "last": trace[-1][1],
                "last_step": trace[-1][0],
                "mean": float(np.mean(trained)) if trained else math.nan,
            }
    return out


def spread(values: Sequence[float], digits: int, signed: bool = False) -> str:
    """``mean [min, max]`` of ``values`` (the range only with two or more), ``-`` when there are none."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    fmt = f"{{:{'+' if signed else ''}.{digits}f}}"
    text = fmt.format(float(np.mean(values)))
    return text + (f" [{fmt.format(min(values))}, {fmt.format(max(values))}]" if len(values) > 1 else "")


def table(study: dict, benchmark: str, metric: str, baseline: str) -> str:
    """One class and metric: per arm its seeds, each statistic over seeds, and each minus the baseline's paired by
    seed (over the seeds both arms finished)."""
    head = ["arm", "seeds", *STATS, *(f"{s} - {baseline}" for s in STATS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base, digits = study.get(baseline, {}), 1 if scale(metric) == 100.0 else 3
    for arm, runs in study.items():
        cells = {seed: run[benchmark][metric] for seed, run in runs.items() if metric in run.get(benchmark, {})}
        if not cells:
            continue
        row = [arm, " ".join(map(str, sorted(cells)))]
        row += [spread([c[s] for c in cells.values()], digits) for s in STATS]
        both = [seed for seed in cells if arm != baseline and metric in base.get(seed, {}).get(benchmark, {})]
        for stat in STATS:
            paired = [cells[seed][stat] - base[seed][benchmark][metric][stat] for seed in both]
            row.append(spread(paired, digits, signed=True) + _paired_on(both, cells) if paired else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _paired_on(paired: Sequence[int], seeds: Sequence[int]) -> str:
    """The seeds a difference is over, said where they are fewer than the arm's own (the baseline lacks some)."""
    return "" if len(paired) == len(seeds) else f" (seeds {' '.join(map(str, sorted(paired)))})"


def frontier_lines(study: dict, k_metric: str) -> list[str]:
    """Per run: the frontier class's pass@k peak and its step, its last value, and its answers' entropy then."""
    lines = []
    for arm, runs in study.items():
        for seed, run in sorted(runs.items()):
            benchmark = next((b for b in run if FRONTIER in b), None)
            if benchmark is None or k_metric not in run[benchmark]:
                continue
            p, e = run[benchmark][k_metric], run[benchmark].get(ENTROPY)
            text = (f"- {arm} seed {seed}: {k_metric} {p['start']:.1f} at {p['start_step']}, peak "
                    f"{p['peak']:.1f} at step {p['peak_step']}, {p['last']:.1f} at {p['last_step']} (mean "
                    f"{p['mean']:.1f})")  # fmt: skip
            if e is not None:
                text += f"; answer entropy {e['start']:.2f} -> {e['last']:.2f} nats (mean {e['mean']:.2f})"
            lines.append(text)
    return lines


MECHANISM = (  # (column, digits): each a per-run figure from ``mechanism``
    ("cliff groups", 0),
    ("surpassed %", 1),
    ("re-rolls verified %", 1),
    ("rollouts / step", 0),
    ("spliced ratio", 3),
    ("spliced grad share %", 1),
    ("kept groups / step", 1),
    ("steps at the bound", 0),
    ("minutes", 0),
)


def mechanism(run: tables.RunTrace) -> dict[str, float]:
    """One finished run's mechanism figures; a figure its arm does not have (a surpass rate without the scaffold,
    kept groups without dynamic sampling) is NaN. The spliced rows' figures are means over the steps that recorded
    them: the token-mean importance ratio pi_theta / pi_theta+phi before any correction (``spliced_ratio_mean``) and
    their share of the update's gradient norm (``spliced_grad_share``, with ``scaffold.grad_share: true``)."""
    with open(os.path.join(run.path, "summary.json")) as f:
        summary = json.load(f)
    train = [r for r in tables.read_metrics(os.path.join(run.path, "metrics.jsonl")) if r.get("kind") == "train"]
    kept = [r["sampler/kept"] for r in train if r.get("sampler/kept") is not None]

    def step_mean(key: str, times: float = 1.0) -> float:  # over the steps that recorded it (spliced rows, or shares)
        values = [r[key] for r in train if r.get(key) is not None]
        return times * float(np.mean(values)) if values else math.nan

    def rate(key: str) -> float:
        return 100.0 * summary[key] if summary.get(key) is not None else math.nan

    return {
        "cliff groups": float(summary.get("cliff_groups", math.nan)),
        "surpassed %": rate("surpass_rate"),
        "re-rolls verified %": rate("rescue_pass_rate"),
        "rollouts / step": summary["rollouts_spent"] / summary["steps"] if summary.get("steps") else math.nan,
        "spliced ratio": step_mean("spliced_ratio_mean"),
        "spliced grad share %": step_mean(GRAD_SHARE, 100.0),
        "kept groups / step": float(np.mean(kept)) if kept else math.nan,
        "steps at the bound": float(sum(r.get("sampler/filled", 0) > 0 for r in train)) if kept else math.nan,
        "minutes": summary.get("seconds", math.nan) / 60.0,
    }


def mechanism_table(runs: Sequence[tables.RunTrace]) -> str:
    """Per arm, each mechanism figure as ``mean [min, max]`` over its finished seeds."""
    per_arm: dict[str, list[dict[str, float]]] = {}
    for run in runs:
        per_arm.setdefault(run.arm, []).append(mechanism(run))
    head = ["arm", "runs", *(name for name, _ in MECHANISM)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, figures in per_arm.items():
        cells = [spread([f[name] for f in figures], digits) for name, digits in MECHANISM]
        lines.append("| " + " | ".join([arm, str(len(figures)), *cells]) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- gain against cost per arm
LEARNED = "3digit"  # the learned class whose accuracy is the cost: its benchmark name ends in this
BEYOND = "beyond"  # the class no sample of the base solves: its benchmark name holds this word
RELIANCE = "scaffold/adapter_reliance"
GRAD_SHARE = "spliced_grad_share"
STEPS = "steps"  # at_horizon's key for the step each column's value was read at


def horizon_columns(k_metric: str, coverage_k: int) -> tuple[tuple[str, str, str], ...]:
    """``(column, class, metric)`` of the gain-against-cost table: the frontier's ``k_metric`` (pass@8), coverage
    pass@k (``coverage/pass@K``, where the runs recorded a coverage pass) and accuracy, the beyond-reach class's
    accuracy and coverage pass@k (what a warm-up opened there, and what RL after it kept), then the cost: the 3-digit
    accuracy (the last column)."""
    return (
        (f"frontier {k_metric}", FRONTIER, k_metric),
        (f"frontier pass@{coverage_k}", FRONTIER, f"coverage/pass@{coverage_k}"),
        ("frontier accuracy", FRONTIER, "accuracy"),
        ("beyond-reach accuracy", BEYOND, "accuracy"),
        (f"beyond-reach pass@{coverage_k}", BEYOND, f"coverage/pass@{coverage_k}"),
        ("3-digit accuracy", LEARNED, "accuracy"),
    )


def at_horizon(run: tables.RunTrace, horizon: int | None, columns: Sequence[tuple[str, str, str]]) -> dict:
    """Column -> the run's value (in %) at its class's last validation <= ``horizon``; NaN where that validation
    did not record it. Not an earlier value instead: a coverage pass runs on fewer steps than validation (step 0,
    every ``eval.coverage_every`` and the last), and a figure from another step would not be at the horizon.
    ``STEPS`` -> column -> the step of that validation (``off_horizon`` names those short of the horizon)."""
    out: dict = {STEPS: {}}
    for column, cls, metric in columns:
        records = [r for r in run.evals
                   if _is_class(tables.benchmark_of(r), cls) and (horizon is None or r["step"] <= horizon)]  # fmt: skip
        last = max(records, key=lambda r: r["step"]) if records else {}
        value = last.get(metric)
        out[column] = math.nan if value is None else 100.0 * value
        out[STEPS][column] = last.get("step")
    return out


def earlier_arm(spec: str, figures: dict, baseline: str) -> tuple[str, dict[int, dict]]:
    """``JSON:ARM[=NAME]``: ``ARM``'s figures at the horizon from an earlier study's ``--json``, under ``NAME``, so
    that runs not on disk any more join the gain-against-cost table and picture. Paired with this study's baseline
    only where they can be: the earlier study's baseline must equal this one's on every seed and column both hold
    (the same runs, or runs that reproduce them), else nothing is read."""
    path, _, arm_spec = spec.rpartition(":")
    arm, _, name = arm_spec.partition("=")
    if not path or not arm:
        raise ConfigError(f"--earlier {spec!r}: expected JSON:ARM or JSON:ARM=NAME")
    with open(path) as f:
        try:
            saved = json.load(f)
        except ValueError as err:
            raise ConfigError(f"--earlier {spec}: {path} is not a study's --json ({err})") from None
    saved = saved.get("at_horizon", {}) if isinstance(saved, dict) else {}
    if arm not in saved or baseline not in saved:
        raise ConfigError(f"--earlier {spec}: {path} has no {arm if arm not in saved else baseline!r} at the horizon "
                       f"(it has {', '.join(saved) or 'no arm'})")  # fmt: skip
    ours, theirs = figures.get(baseline, {}), {int(seed): _nan(f) for seed, f in saved[baseline].items()}
    differ = sorted({seed for seed in ours.keys() & theirs.keys() for c, v in ours[seed].items()
                     if c != STEPS and not math.isnan(v) and not math.isnan(theirs[seed].get(c, math.nan))
                     and not math.isclose(v, theirs[seed][c], abs_tol=1e-9)})  # fmt: skip
    if differ:
        raise ConfigError(f"--earlier {spec}: its {baseline} differs from this study's on seeds "
                         f"{' '.join(map(str, differ))}, so its {arm} cannot be paired with it")  # fmt: skip
    unread = dict.fromkeys(next(iter(ours.values()), {}), math.nan)  # columns the earlier study did not have
    return name or arm, {int(seed): unread | {STEPS: {}} | _nan(f) for seed, f in saved[arm].items()}


def _nan(figures: dict) -> dict:
    """A saved run's figures with JSON's None (a value not recorded) back to NaN."""
    return {c: math.nan if v is None else v for c, v in figures.items()}


def off_horizon(figures: dict, horizon: int | None) -> list[str]:
    """``ARM seed SEED: COLUMN at step S`` for each value from a validation short of the horizon (a run that
    stopped early or lost its last record), which its cell then mixes with the others' at the horizon; without a
    horizon, short of the latest step any run reached."""
    steps = [s for runs in figures.values() for f in runs.values() for s in f[STEPS].values() if s is not None]
    target = horizon if horizon is not None else max(steps, default=None)
    return [f"{arm} seed {seed}: {column} at step {step}" for arm, runs in figures.items()
            for seed, f in sorted(runs.items()) for column, step in f[STEPS].items()
            if step is not None and step != target and not math.isnan(f[column])]  # fmt: skip


def _is_class(benchmark: str, cls: str) -> bool:
    return cls in benchmark if cls in (FRONTIER, BEYOND) else benchmark.endswith(cls)


def paired(figures: dict, arm: str, baseline: str, column: str) -> dict[int, float]:
    """Seed -> ``arm - baseline`` of one column, for each seed both recorded."""
    base = figures.get(baseline, {})
    return {seed: f[column] - base[seed][column] for seed, f in figures[arm].items()
            if seed in base and not math.isnan(f[column]) and not math.isnan(base[seed][column])}  # fmt: skip


def gain_cost_table(figures: dict, baseline: str, columns: Sequence[str]) -> str:
    """Per arm: each column's value ``mean [min, max]`` over seeds, and its difference from ``baseline`` paired by
    seed. ``figures``: ``{arm: {seed: at_horizon(...)}}``."""
    head = ["arm", "seeds", *(part for c in columns for part in (c, f"{c} - {baseline}"))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, runs in figures.items():
        row = [arm, " ".join(map(str, sorted(runs)))]
        for c in columns:
            row.append(spread([f[c] for f in runs.values()], 1))
            both = paired(figures, arm, baseline, c)
            if arm == baseline:
                row.append("")
            else:  # "-" where no seed recorded the column in both arms
                row.append(spread(list(both.values()), 1, True) + _paired_on(both, runs) if both else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def reliance(run: tables.RunTrace, share_steps: Sequence[int], horizon: int | None = None) -> dict[str, float] | None:
    """A scaffolded run's mean ``scaffold/adapter_reliance`` over its steps up to ``horizon``, and its
    ``spliced_grad_share`` at each of ``share_steps`` (NaN where that step did not record it); None for a run that
    never recorded a reliance (no adapter: not of the LSPO family)."""
    train = [r for r in tables.read_metrics(os.path.join(run.path, "metrics.jsonl"))
             if r.get("kind") == "train" and (horizon is None or r["step"] <= horizon)]  # fmt: skip
    values = [r[RELIANCE] for r in train if r.get(RELIANCE) is not None]
    if not values:
        return None
    shares = {r["step"]: r[GRAD_SHARE] for r in train if r.get(GRAD_SHARE) is not None}
    return {"reliance": float(np.mean(values)), **{f"share@{s}": shares.get(s, math.nan) for s in share_steps}}


def reliance_table(
    relied: dict, figures: dict, baseline: str, share_steps: Sequence[int], columns: Sequence[str]
) -> str:
    """Per LSPO-family run: its mean adapter reliance, its spliced rows' share of the gradient norm at
    ``share_steps`` (%), beside its transfer: the first two ``columns`` minus the baseline's of its seed.
    ``relied``: ``{arm: {seed: reliance(...)}}``."""
    gains = columns[:2]
    head = ["arm", "seed", "adapter reliance", *(f"grad share @{s} (%)" for s in share_steps),
            *(f"{c} - {baseline}" for c in gains)]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, per in relied.items():
        transfer = {c: paired(figures, arm, baseline, c) for c in gains}
        for seed, own in per.items():
            if own is None:
                continue
            cells = [f"{own['reliance']:.3f}", *(_figure(100.0 * own[f"share@{s}"], "") for s in share_steps)]
            cells += [_figure(transfer[c].get(seed, math.nan), "+") for c in gains]
            lines.append("| " + " | ".join([arm, str(seed), *cells]) + " |")
    return "\n".join(lines) if len(lines) > 2 else "No run recorded an adapter reliance."


def _pearson(x: Sequence[float], y: Sequence[float]) -> float:
    dx, dy = np.asarray(x, float) - np.mean(x), np.asarray(y, float) - np.mean(y)
    denom = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy) / denom if denom > 0 else math.nan


def _centred(values: Sequence[float], groups: Sequence) -> list[float]:
    """Each value less the mean of its group's values."""
    means = {g: np.mean([v for v, h in zip(values, groups, strict=True) if h == g]) for g in set(groups)}
    return [v - means[g] for v, g in zip(values, groups, strict=True)]


def association_table(
    relied: dict, figures: dict, baseline: str, share_steps: Sequence[int], columns: Sequence[str]
) -> str:
    """Pearson's r over the LSPO-family runs between each mechanism figure (the adapter reliance, the spliced rows'
    share at each of ``share_steps``) and each transfer (the first two ``columns`` minus the baseline's of the same
    seed): pooled; within seed (each seed's mean taken out first, so it compares arms on one seed); within arm (each
    arm's mean taken out, so it compares seeds of one arm). A run missing either figure is left out of that pair;
    under three runs, or with no spread, r is "-". Over a few runs this is an association, not a cause."""
    mechanisms = ["adapter reliance", *(f"grad share @{s}" for s in share_steps)]
    runs = []  # (arm, seed, {figure: value}) per LSPO-family run whose seed the baseline ran
    for arm, per in relied.items():
        transfer = {c: paired(figures, arm, baseline, c) for c in columns[:2]}
        for seed, own in per.items():
            if own is None or seed not in figures.get(baseline, {}):
                continue
            values = dict(zip(mechanisms, [own["reliance"], *(own[f"share@{s}"] for s in share_steps)], strict=True))
            values |= {c: transfer[c].get(seed, math.nan) for c in columns[:2]}
            runs.append((arm, seed, values))
    head = ["mechanism", "transfer", "runs", "r pooled", "r within seed", "r within arm"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in mechanisms:
        for c in columns[:2]:
            kept = [(a, s, v[m], v[c]) for a, s, v in runs if not (math.isnan(v[m]) or math.isnan(v[c]))]
            x, y = [k[2] for k in kept], [k[3] for k in kept]
            rs = [math.nan] * 3
            if len(kept) >= 3:
                by_seed, by_arm = [k[1] for k in kept], [k[0] for k in kept]
                rs = [_pearson(x, y), *(_pearson(_centred(x, g), _centred(y, g)) for g in (by_seed, by_arm))]
            cells = ["-" if math.isnan(r) else f"{r:+.2f}" for r in rs]
            lines.append("| " + " | ".join([m, f"{c} - {baseline}", str(len(kept)), *cells]) + " |")
    return "\n".join(lines) if runs else "No run recorded an adapter reliance."


def coverage_table(runs: Sequence[tables.RunTrace], horizon: int | None, coverage_k: int) -> str:
    """Per arm and class (frontier, beyond reach), at each step a coverage pass ran (up to ``horizon``): the mean
    over seeds of pass@1 (unbiased: the share of correct samples) / pass@``coverage_k``, in %."""
    cells: dict[tuple[str, str], dict[int, list[tuple[float, float]]]] = {}
    for run in runs:
        for r in run.evals:
            cls = next((c for c in (FRONTIER, BEYOND) if c in tables.benchmark_of(r)), None)
            one, at_k = r.get("coverage/pass@1_unbiased"), r.get(f"coverage/pass@{coverage_k}")
            if cls is None or one is None or at_k is None or (horizon is not None and r["step"] > horizon):
                continue
            cells.setdefault((run.arm, cls), {}).setdefault(r["step"], []).append((100.0 * one, 100.0 * at_k))
    if not cells:
        return "No run recorded a coverage pass."
    steps = sorted({step for per in cells.values() for step in per})
    head = ["arm", "class", "seeds", *(f"step {s}" for s in steps)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (arm, cls), per in cells.items():
        row = [arm, "frontier" if cls == FRONTIER else "beyond reach", str(max(map(len, per.values())))]
        row += [f"{np.mean([a for a, _ in per[s]]):.2f} / {np.mean([b for _, b in per[s]]):.1f}" if s in per else "-"
                for s in steps]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _json_ready(value):
    """``value`` with every NaN as None (JSON has no NaN) and int keys as strings."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _figure(value: float, sign: str) -> str:
    return "-" if math.isnan(value) else f"{value:{sign}.1f}"


def plot_gain_cost(figures: dict, baseline: str, columns: Sequence[str], path: str) -> str:
    """One panel per frontier gain (pass@8, coverage pass@k where recorded): each arm's mean gain over
    ``baseline`` against its mean 3-digit cost, over the seeds that recorded both, the error bars their [min, max]
    on both axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost, gains = columns[-1], [c for c in columns[:2] if any(paired(figures, a, baseline, c) for a in figures)]
    fig, axes = plt.subplots(1, max(len(gains), 1), figsize=(4.8 * max(len(gains), 1), 4), squeeze=False,
                             constrained_layout=True)  # fmt: skip
    for ax, gain in zip(axes[0], gains, strict=False):
        for index, arm in enumerate(figures):
            if arm == baseline:
                continue
            costs, gained = paired(figures, arm, baseline, cost), paired(figures, arm, baseline, gain)
            x, y = [costs[s] for s in gained if s in costs], [gained[s] for s in gained if s in costs]
            if not y:
                continue
            mx, my = float(np.mean(x)), float(np.mean(y))
            ax.errorbar(mx, my, xerr=[[mx - min(x)], [max(x) - mx]], yerr=[[my - min(y)], [max(y) - my]],
                        fmt="o", capsize=3, color=f"C{index % 10}",  # the arm's colour in the curves' pictures
                        label=f"{arm} ({len(y)} seed{'s' * (len(y) > 1)})")  # fmt: skip
        ax.axhline(0, color="grey", lw=0.8)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_xlabel(f"{cost} - {baseline} (points)")
        ax.set_ylabel(f"{gain} - {baseline} (points)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:  # one legend beside the panels, which show the same arms
        fig.legend(handles, labels, loc="outside right center", fontsize="small")
    fig.suptitle(f"Frontier gain against the learned class's cost, minus {baseline} paired by seed (mean, "
                 "bars = seed range)", fontsize=9)  # fmt: skip
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def load(out: str, arms: Sequence[str], seeds: Sequence[int]) -> tuple[dict, list[tables.RunTrace], list[str]]:
    """The finished runs (``summary.json`` written) among ``OUT/ARM_seedSEED``, and the names of those left out."""
    runs, missing = [], []
    for arm in arms:
        for seed in seeds:
            path = os.path.join(out, f"{arm}_seed{seed}")
            if os.path.exists(os.path.join(path, "summary.json")):
                runs.append(tables.read_run(path, arm, seed))
            else:
                missing.append(f"{arm}_seed{seed}")
    return runs, missing


def _recorded_keys(runs: Sequence[tables.RunTrace]) -> set[str]:
    return {key for run in runs for record in run.evals for key in record}


def recorded_metrics(runs: Sequence[tables.RunTrace], metrics: Sequence[str]) -> list[str]:
    """``metrics`` that some run's validation recorded; each of the others is said, once, in a line that names the
    pass@k the runs did record (runs validated with ``eval.n`` 4 hold no pass@8), instead of an empty table and a
    blank picture."""
    recorded = _recorded_keys(runs)
    held = sorted((k for k in recorded if re.fullmatch(r"pass@\d+", k)), key=lambda k: int(k[5:]))
    for metric in (m for m in metrics if m not in recorded):
        what = f"they recorded {', '.join(held)}" if held else "they recorded no pass@k"
        if held and metric.startswith("pass@"):
            what += f" (pass@k up to the eval.n they validated with: --metrics {held[-1]})"
        print(f"horizon_study: no run's validation recorded {metric}, left out of the tables and pictures; {what}",
              file=sys.stderr)  # fmt: skip
    return [metric for metric in metrics if metric in recorded]


def largest_pass_at(runs: Sequence[tables.RunTrace]) -> str | None:
    """The pass@k of the largest k the runs' validations recorded, None when they recorded none."""
    held = [k for k in _recorded_keys(runs) if re.fullmatch(r"pass@\d+", k)]
    return max(held, key=lambda k: int(k[5:])) if held else None


def main(argv: list[str] | None = None) -> int:
    return run_main("horizon_study", _study, argv)


def _study(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description="The horizon study's tables and seed bands from finished runs.")
    p.add_argument("--out", required=True, help="the directory compare_arms trained the arms into")
    p.add_argument("--arms", nargs="+", default=["dapo", "lspo"], help="the first is the baseline")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44, 45, 46])
    p.add_argument("--horizon", type=int, default=None, help="only validations at steps <= this (default: all)")
    p.add_argument("--metrics", nargs="+", default=["accuracy", "pass@8", "gold_logprob"])
    p.add_argument("--plot", default=None, help="PREFIX: draw PREFIX_METRIC.png per metric")
    p.add_argument("--json", default=None, help="write every run's figures here")
    p.add_argument("--coverage-k", type=int, default=256, help="the coverage pass@k in the gain-against-cost table")
    p.add_argument("--share-steps", type=int, nargs="+", default=[50, 150],
                   help="the steps whose spliced_grad_share the reliance table shows")  # fmt: skip
    p.add_argument("--earlier", action="append", default=[], metavar="JSON:ARM[=NAME]",
                   help="an arm's figures at the horizon from an earlier study's --json (runs no longer on disk), in "
                        "the gain-against-cost table and picture; its baseline must equal this one's")  # fmt: skip
    args = p.parse_args(argv)
    runs, missing = load(args.out, args.arms, args.seeds)
    if not runs:
        raise FileNotFoundError(f"no finished run under {args.out} for arms {args.arms}, seeds {args.seeds}")
    metrics = recorded_metrics(runs, list(dict.fromkeys([*args.metrics, ENTROPY])))
    study: dict[str, dict[int, dict]] = {}
    for run in runs:
        study.setdefault(run.arm, {})[run.seed] = summarize(run, args.horizon, metrics)
    baseline = args.arms[0]
    print(f"{len(runs)} finished runs; left out (unfinished or absent): {', '.join(missing) or 'none'}")
    benchmarks = list(dict.fromkeys(b for arm in study.values() for run in arm.values() for b in run))
    for benchmark in benchmarks:
        for metric in metrics:
            print(f"\n{benchmark}, {metric} (mean over seeds [min, max]; minus {baseline} paired by seed):\n")
            print(table(study, benchmark, metric, baseline))
    k_metric = next((m for m in metrics if m.startswith("pass@")), None) or largest_pass_at(runs) or "pass@8"
    print(f"\nThe frontier class per run ({k_metric} in %, from its validations):")
    print("\n".join(frontier_lines(study, k_metric)))
    print("\nThe mechanism per arm (mean over its runs [min, max]; wall minutes depend on the machine's load):\n")
    print(mechanism_table(runs))
    columns = horizon_columns(k_metric, args.coverage_k)
    figures: dict[str, dict[int, dict]] = {}
    for run in runs:
        figures.setdefault(run.arm, {})[run.seed] = at_horizon(run, args.horizon, columns)
    figures |= dict(earlier_arm(spec, figures, args.arms[0]) for spec in args.earlier)
    names = [c for c, _, _ in columns]
    where = "the last validation" if args.horizon is None else f"the last validation <= step {args.horizon}"
    print(f"\nFrontier gain against the 3-digit cost at {where} (%, mean over seeds [min, max]; minus {baseline} "
          "paired by seed):\n")  # fmt: skip
    print(gain_cost_table(figures, baseline, names))
    if short := off_horizon(figures, args.horizon):
        print(f"\nValues short of the horizon, in the cells above with the others: {'; '.join(short)}")
    print(f"\nCoverage by step (pass@1 / pass@{args.coverage_k} in %, mean over seeds):\n")
    print(coverage_table(runs, args.horizon, args.coverage_k))
    print("\nAdapter reliance (mean over the run) and the spliced rows' gradient-norm share, beside the transfer:\n")
    relied: dict[str, dict[int, dict | None]] = {}  # each run's records read once, for the table and the JSON
    for run in runs:
        relied.setdefault(run.arm, {})[run.seed] = reliance(run, args.share_steps, args.horizon)
    print(reliance_table(relied, figures, baseline, args.share_steps, names))
    print("\nPearson's r between the mechanism and the transfer over those runs (within seed: each seed's mean taken "
          "out, arms compared; within arm: each arm's mean taken out, seeds compared):\n")  # fmt: skip
    print(association_table(relied, figures, baseline, args.share_steps, names))
    if args.json:
        saved = {"classes": study, "at_horizon": figures, "reliance": relied}
        with open(args.json, "w") as f:
            json.dump(_json_ready(saved), f, indent=1)
        print(f"horizon_study: wrote {args.json}")
    if args.plot:
        for metric in metrics:
            path = tables.plot_curves(runs, f"{args.plot}_{metric.replace('@', '')}.png", key=metric,
                                      horizon=args.horizon)  # fmt: skip
            print(f"horizon_study: wrote {path}")
        print(f"horizon_study: wrote {plot_gain_cost(figures, baseline, names, f'{args.plot}_gain_cost.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
