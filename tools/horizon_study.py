"""The horizon study's tables from finished runs: per held-out class and metric, each arm's peak (the paper's
protocol), value at the last validation and mean over the trained trace (steps > 0), over seeds, and each arm minus
DAPO paired by seed; then, per run, what the frontier class did (its pass@k peak and where, its last value, the
entropy of its sampled answers from start to end); then each arm's mechanism (cliff groups, the scaffold's surpass and
re-roll pass rates, rollouts spent per step, dynamic sampling's kept groups and the steps it hit its bound, from each
run's ``summary.json`` and training records). Nothing trains: the runs are ``OUT/ARM_seedSEED`` directories
that ``tools.compare_arms`` wrote, and a run without ``summary.json`` (unfinished) is left out and named.

    .venv/bin/python -m tools.horizon_study --out runs/horizon --arms dapo lspo direct --seeds 42 43 44 45 46 \\
        [--horizon 200] [--metrics accuracy pass@8 gold_logprob] [--plot runs/horizon/study] [--json study.json]

``--plot PREFIX`` draws ``PREFIX_KEY.png`` per metric: each arm's mean curve over its seeds and their range (the
seed band), one panel per class. Figures are percentages for accuracy and pass@k, nats per token for
``gold_logprob``, nats for ``answer_entropy``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

import numpy as np

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
        for stat in STATS:
            paired = [c[stat] - base[seed][benchmark][metric][stat] for seed, c in cells.items()
                      if arm != baseline and metric in base.get(seed, {}).get(benchmark, {})]  # fmt: skip
            row.append(spread(paired, digits, signed=True) if paired else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def frontier_lines(study: dict, k_metric: str) -> list[str]:
    """Per run: the frontier class's pass@k peak and its step, its last value, and its answers' entropy then."""
    lines = []
    for arm, runs in study.items():
        for seed, run in sorted(runs.items()):
            benchmark = next((b for b in run if FRONTIER in b), None)
            if benchmark is None or k_metric not in run[benchmark]:
                continue
            p, e = run[benchmark][k_metric], run[benchmark].get(ENTROPY)
            text = (f"- {arm} seed {seed}: {k_metric} {p['start']:.1f} at 0, peak {p['peak']:.1f} at step "
                    f"{p['peak_step']}, {p['last']:.1f} at {p['last_step']} (mean {p['mean']:.1f})")  # fmt: skip
            if e is not None:
                text += f"; answer entropy {e['start']:.2f} -> {e['last']:.2f} nats (mean {e['mean']:.2f})"
            lines.append(text)
    return lines


MECHANISM = (  # (column, digits): each a per-run figure from ``mechanism``
    ("cliff groups", 0),
    ("surpassed %", 1),
    ("re-rolls verified %", 1),
    ("rollouts / step", 0),
    ("kept groups / step", 1),
    ("steps at the bound", 0),
    ("minutes", 0),
)


def mechanism(run: tables.RunTrace) -> dict[str, float]:
    """One finished run's mechanism figures; a figure its arm does not have (a surpass rate without the scaffold,
    kept groups without dynamic sampling) is NaN."""
    with open(os.path.join(run.path, "summary.json")) as f:
        summary = json.load(f)
    train = [r for r in tables.read_metrics(os.path.join(run.path, "metrics.jsonl")) if r.get("kind") == "train"]
    kept = [r["sampler/kept"] for r in train if r.get("sampler/kept") is not None]

    def rate(key: str) -> float:
        return 100.0 * summary[key] if summary.get(key) is not None else math.nan

    return {
        "cliff groups": float(summary.get("cliff_groups", math.nan)),
        "surpassed %": rate("surpass_rate"),
        "re-rolls verified %": rate("rescue_pass_rate"),
        "rollouts / step": summary["rollouts_spent"] / summary["steps"] if summary.get("steps") else math.nan,
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
    args = p.parse_args(argv)
    runs, missing = load(args.out, args.arms, args.seeds)
    if not runs:
        raise FileNotFoundError(f"no finished run under {args.out} for arms {args.arms}, seeds {args.seeds}")
    metrics = list(dict.fromkeys([*args.metrics, ENTROPY]))
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
    k_metric = next((m for m in args.metrics if m.startswith("pass@")), "pass@8")
    print(f"\nThe frontier class per run ({k_metric} in %, from its validations):")
    print("\n".join(frontier_lines(study, k_metric)))
    print("\nThe mechanism per arm (mean over its runs [min, max]; wall minutes depend on the machine's load):\n")
    print(mechanism_table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({arm: {str(s): r for s, r in per.items()} for arm, per in study.items()}, f, indent=1)
        print(f"horizon_study: wrote {args.json}")
    if args.plot:
        for metric in metrics:
            path = tables.plot_curves(runs, f"{args.plot}_{metric.replace('@', '')}.png", key=metric,
                                      horizon=args.horizon)  # fmt: skip
            print(f"horizon_study: wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
