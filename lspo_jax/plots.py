"""Curves of a run's ``metrics.jsonl`` as PNG files (training and validation)."""

from __future__ import annotations

import os

from lspo_jax.metrics_log import read_metrics

TRAIN_PANELS = (
    ("accuracy_mean", "rollout accuracy"),
    ("cliff_groups", "cliff groups"),
    ("surpassed_groups", "surpassed groups"),
    ("rescue_pass_rate", "re-rollout pass rate"),
    ("entropy", "entropy"),
    ("response_len_mean", "response length"),
)


def plot_run(run_dir: str) -> list[str]:
    """Write ``train_curves.png`` (and ``eval_curves.png`` when there are validation records)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    written = []
    train = [r for r in records if r.get("kind", "train") == "train"]
    if train:
        fig, axes = plt.subplots(2, 3, figsize=(12, 6), constrained_layout=True)
        for ax, (key, title) in zip(axes.flat, TRAIN_PANELS, strict=True):
            points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", linewidth=1)
            ax.set_title(title)
            ax.set_xlabel("step")
        written.append(_save(fig, os.path.join(run_dir, "train_curves.png")))
    evals = [r for r in records if r.get("kind") == "eval"]
    benchmarks = list(dict.fromkeys(r.get("benchmark", "held_out") for r in evals))
    if benchmarks:
        fig, axes = plt.subplots(1, len(benchmarks), figsize=(5 * len(benchmarks), 4), constrained_layout=True,
                                 squeeze=False)  # fmt: skip
        for ax, name in zip(axes[0], benchmarks, strict=True):
            mine = [r for r in evals if r.get("benchmark", "held_out") == name]
            for key in sorted((k for k in mine[0] if k.startswith("pass@") and not k.endswith("unbiased")),
                              key=lambda k: int(k[5:])):  # fmt: skip
                points = [(r["step"], r[key]) for r in mine if r.get(key) is not None]
                ax.plot(*zip(*points, strict=True), marker="o", label=key)
            ax.set_xlabel("step")
            ax.set_title(f"{name}: held-out pass@k")
            ax.legend()
        written.append(_save(fig, os.path.join(run_dir, "eval_curves.png")))
    return written


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
