"""A run's ``summary.json``: the whole run's figures, from its records (those logged before a resume included)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from lspo_jax.rl import warmup
from lspo_jax.rl.checkpoint import TrainState
from lspo_jax.tasks.data import DataReport

# Train-record counts the summary adds up over the run.
SUMMED = ("cliff_groups", "scaffold_attempted", "scaffold_no_solution", "surpassed_groups", "rerolls",
          "rerolls_passed", "rollouts")  # fmt: skip


def run_summary(
    history: list[dict[str, Any]], state: TrainState, *, stopped: bool, seconds: float, seconds_before: float,
    held_out_data: dict[str, dict], data_report: DataReport, warmed: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The summary of a run at ``state`` with records ``history``: ``seconds`` this session's wall time,
    ``seconds_before`` the sessions' before a resume; ``stopped``: it ended early, so not validated at its end."""
    train = [r for r in history if r["kind"] == "train"]
    totals = {key: sum(int(r.get(key) or 0) for r in train) for key in SUMMED}
    # Rollouts drawn, every L2RR draw round's included (the update batch holds ``rollouts`` of them).
    totals["rollouts_spent"] = sum(int(r.get("sampler/rollouts_step", r["rollouts"])) for r in train)
    attempted = totals["scaffold_attempted"]
    summary = {
        "steps": state.step,
        "stopped_early": stopped,
        "seconds": round(seconds_before + seconds, 1),  # every session's, a resume's before it included
        "seconds_session": round(seconds, 1),
        **totals,
        # The paper's definition: surpassed over the cliff groups the scaffold attempted (those with a
        # worked solution); cliff groups without one are counted in scaffold_no_solution.
        "surpass_rate": totals["surpassed_groups"] / attempted if attempted else None,
        "rescue_pass_rate": totals["rerolls_passed"] / totals["rerolls"] if totals["rerolls"] else None,
        "surpass_rate_per_step": surpass_distribution(train),
        "held_out_before": held_out_at(history, 0),
        "held_out_after": None if stopped else held_out_at(history, state.step),
        "held_out_data": held_out_data,
        "nonfinite_updates": state.nonfinite_total,
        "data": dataclasses.asdict(data_report),
    }
    if warmed is not None:
        summary[warmup.RECORD_KIND] = warmed
    return summary


def held_out_at(history: list[dict[str, Any]], step: int) -> dict[str, dict] | None:
    """Benchmark -> its validation figures at ``step``, from the run's records (None: not validated)."""
    found = {
        r["benchmark"]: {k: v for k, v in r.items() if k not in ("kind", "step", "benchmark")}
        for r in history
        if r["kind"] == "eval" and r["step"] == step
    }
    return found or None


def surpass_distribution(train: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How the per-step surpass rate spreads over the steps whose scaffold attempted a cliff: their number and
    the shares at exactly 0 and 1 (the paper's figure: 31% of them at 0.0, 21% at 1.0); None without any."""
    rates = [r["surpass_rate"] for r in train if r.get("scaffold_attempted") and r.get("surpass_rate") is not None]
    if not rates:
        return None
    return {"steps": len(rates), "at_0": sum(x == 0 for x in rates) / len(rates),
            "at_1": sum(x == 1 for x in rates) / len(rates)}  # fmt: skip


def seconds_so_far(out_dir: str) -> float:
    """The wall time the run's earlier sessions spent, from the summary the last of them wrote (0 without one: a run
    killed before its summary leaves its time uncounted)."""
    try:
        with open(os.path.join(out_dir, "summary.json")) as f:
            return float(json.load(f).get("seconds") or 0.0)
    except (OSError, ValueError, AttributeError):
        return 0.0
