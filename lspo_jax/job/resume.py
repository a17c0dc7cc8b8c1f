"""What a resumed run takes from its directory: the newest readable checkpoint (newer unreadable ones set aside) and
the records up to its step, each said on stderr where it is not what the run left."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax
from jax.experimental import multihost_utils

from lspo_jax.job.metrics_log import records_until
from lspo_jax.rl import warmup
from lspo_jax.rl.checkpoint import DIGEST, Checkpointer, CheckpointError, TrainState
from lspo_jax.train_config import ConfigError, TrainConfig


def restore(
    checkpointer: Checkpointer, fresh: TrainState, adapter: bool, run: TrainConfig, *, unchecked_model: str | None,
    data_digest: Any, writer: bool,
) -> tuple[TrainState, dict[str, Any]]:  # fmt: skip
    """The state of the newest readable checkpoint, in ``fresh``'s layout (``adapter``: whether it holds the
    adapter), and its meta; newer unreadable ones are set aside (and said so), so the run writes those steps again.
    ``unchecked_model``: a moved model whose shapes could not be compared, named if the checkpoint does not fit it;
    ``data_digest``: the training data's, said if the checkpoint was trained on other data."""
    try:
        state, meta, failures = checkpointer.restore_state(fresh, adapter=adapter)
    except CheckpointError as err:
        if unchecked_model is None:
            raise
        # One line a step, all alike: the newest step's cause, its first sentence (orbax's names the shapes).
        first = str(err).split("; ")[0]
        cause = first.partition(" is unreadable: ")[2].split(". ")[0] or first
        raise ConfigError(f"--resume: the run's checkpoint does not fit the model at model.path {run.model.path} "
                          f"({unchecked_model}): {cause}; resume with the run's own model") from None  # fmt: skip
    step = state.step
    if writer and holds_digest(checkpointer.directory, step) is False:
        print(f"lspo-train: checkpoint step {step} carries no digest of its arrays ({DIGEST}: written by an older "
              "version, or removed): it was restored unchecked, and damaged bytes in it would go unnoticed",
              file=sys.stderr)  # fmt: skip
    if step > run.steps:
        raise ConfigError(
            f"steps: {run.steps} is below the run's step {step} (its checkpoint); pass steps={step} or more"
        )
    if failures:
        _set_aside(checkpointer, step, failures, writer)
    if writer and meta.get("data") not in (None, data_digest):
        print(f"lspo-train: data.train {run.data.train} is not the data the run's checkpoint was trained on (its files "
              "changed): the run goes on from its place in the old data's order, in the new data",
              file=sys.stderr)  # fmt: skip
    return state, meta


def _set_aside(checkpointer: Checkpointer, step: int, failures: list[str], writer: bool) -> None:
    """Move the checkpoints newer than ``step``, which could not be read (``failures`` says why), out of the way."""
    unreadable = [s for s in checkpointer.steps() if s > step]
    if jax.process_count() > 1:  # every process has read before one moves the files
        multihost_utils.sync_global_devices("lspo_jax: unreadable checkpoints found")
    aside = checkpointer.set_aside(unreadable) if writer else checkpointer.directory
    if writer:
        for line in failures:
            print(f"lspo-train: {line}", file=sys.stderr)
        print(f"lspo-train: resuming from step {step}, the newest readable checkpoint; the unreadable ones are in "
              f"{aside}", file=sys.stderr)  # fmt: skip


def resumed_records(out_dir: str, step: int, warmed: dict[str, Any] | None, *, writer: bool) -> list[dict[str, Any]]:
    """The run's records up to ``step``, its checkpoint's: what followed it is redone. ``warmed``: the SFT warm-up's
    record the checkpoint keeps (``rl.warmup``), taken from there if the log lacks it."""
    records = os.path.join(out_dir, "metrics.jsonl")
    if writer and not os.path.exists(records):
        print(f"lspo-train: {records} is missing: the records of steps 1-{step} are lost, and the summary counts the "
              f"steps from {step + 1} on", file=sys.stderr)  # fmt: skip
    say = (lambda line: print(f"lspo-train: {line}", file=sys.stderr)) if writer else None
    history = records_until(records, step, say)
    if warmed is not None and not any(r["kind"] == warmup.RECORD_KIND for r in history):
        # Killed between the warm-up's checkpoint and its record: the record is the checkpoint's copy.
        history.insert(0, {"kind": warmup.RECORD_KIND, "step": 0, **warmed})
    return history


def holds_digest(directory: str, step: int) -> bool | None:
    """Whether checkpoint ``step``'s meta (orbax's ``STEP/meta/metadata``) holds the digest its restore checks the
    arrays against; None when the file cannot be read."""
    try:
        with open(os.path.join(directory, str(step), "meta", "metadata")) as f:
            return DIGEST in json.load(f)
    except (OSError, ValueError, TypeError):
        return None
