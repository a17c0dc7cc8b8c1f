"""The L2RR prompt sampler against the uniform order on the same task, seeds paired: rollouts spent and
held-out accuracy, with the scaffold's figures beside them (the two options compose).

    .venv/bin/python -m tools.compare_samplers --config configs/demo.yaml --seeds 42 --out runs/samplers \\
        [dotted.key=value ...]

Each seed trains twice from the same model, once with ``l2rr.enabled: false`` (uniform) and once with
``l2rr.enabled: true`` (its target set from the config, ``toy:target`` by default); everything else equal.
A finished run (its ``summary.json``) is reused, so an interrupted comparison resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from lspo_jax.job.config import load_config
from lspo_jax.job.config_io import apply_overrides, from_dict, to_dict
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run import train_run

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/compare_samplers.py: run it from the repository root as python -m tools.compare_samplers ...")
from tools import resume_or_restart, run_main  # noqa: E402

ARMS = {"uniform": ["l2rr.enabled=false"], "l2rr": ["l2rr.enabled=true"]}


def run_arm(base, arm: str, seed: int, out_root: str) -> dict:
    """Train one arm (or reuse its finished run) and return its summary and train records."""
    out = os.path.join(out_root, f"{arm}_seed{seed}")
    summary_path = os.path.join(out, "summary.json")
    if not _finished(summary_path):  # an interrupted comparison resumes where it stopped
        target = base.l2rr.target or "toy:target"
        data = apply_overrides(to_dict(base), [f"seed={seed}", f"l2rr.target={target}", *ARMS[arm]])
        train_run(from_dict(type(base), data), out, resume=resume_or_restart(out, "compare_samplers"))
    with open(summary_path) as f:
        summary = json.load(f)
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "train"]
    return {"summary": summary, "records": records}


def _finished(summary_path: str) -> bool:
    if not os.path.exists(summary_path):
        return False
    with open(summary_path) as f:
        return not json.load(f)["stopped_early"]


def row(arm: str, seed: int, result: dict) -> str:
    summary, records = result["summary"], result["records"]
    after = next(iter((summary.get("held_out_after") or {}).values()), {})
    before = next(iter((summary.get("held_out_before") or {}).values()), {})
    effective = float(np.mean([r["effective_prompt_ratio"] for r in records]))
    cells = [
        arm, str(seed), str(summary["steps"]), str(summary["rollouts_spent"]), str(summary["rollouts"]),
        f"{effective:.3f}", str(summary["cliff_groups"]), str(summary["surpassed_groups"]),
        _pct(before.get("accuracy")), _pct(after.get("accuracy")), f"{summary['seconds']:.0f}",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def main(argv: list[str] | None = None) -> int:
    return run_main("compare_samplers", _compare, argv)


def _compare(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--out", default="runs/samplers")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    base = load_config(args.config, args.overrides)
    lines = [
        "| sampler | seed | steps | rollouts spent | rollouts in updates | effective-prompt ratio | cliff groups "
        "| surpassed | held-out acc before | after | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seed in args.seeds:
        for arm in ARMS:
            lines.append(row(arm, seed, run_arm(base, arm, seed, args.out)))
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
