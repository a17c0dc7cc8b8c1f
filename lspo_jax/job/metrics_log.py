"""Run metrics: one JSON line per record in ``metrics.jsonl``, with TensorBoard scalars and, optionally, a
Weights & Biases run beside it."""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Callable
from typing import Any

WANDB_ID_FILE = "wandb_id"  # in the run directory: a resumed run continues the same W&B run


class MetricsLog:
    """Append-only metrics of a run; a resumed run appends to the same files (and W&B run).

    ``wandb``: None, or keyword arguments of ``wandb.init`` (``project``, ``mode``, ``config``; see
    ``wandb_options``); the run directory, the stable id and ``resume="allow"`` are added here.
    """

    def __init__(
        self,
        directory: str,
        *,
        tensorboard: bool = True,
        wandb: dict[str, Any] | None = None,
        purge_step: int | None = None,
    ):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)  # line-buffered: nothing lost on a crash
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # A resumed run redoes the steps after its checkpoint: TensorBoard hides their first recording.
            self._tb = SummaryWriter(os.path.join(directory, "tensorboard"), purge_step=purge_step)
        self._wandb = None
        if wandb is not None:
            init = _import_wandb().init
            self._wandb = init(**wandb, dir=directory, id=_wandb_id(directory), resume="allow")
            # A resumed online run starts after its last logged step; steps below it are already there.
            self._wandb_step = getattr(self._wandb, "starting_step", 0) or 0

    def write(self, record: dict[str, Any]) -> None:
        """Write one record; it must hold ``step``. Non-finite floats are written as null in JSON."""
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        scalars = _scalars(clean)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, clean["step"])
        # W&B drops (with a warning) any step below the last one it logged: skip re-logged steps of a resume.
        if self._wandb is not None and clean["step"] >= self._wandb_step:
            self._wandb.log(scalars, step=clean["step"])
            self._wandb_step = clean["step"]

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class NullLog:
    """The metrics log of a process that does not write (every process of a multi-host job but the first)."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def wandb_options(run) -> dict[str, Any] | None:
    """``MetricsLog``'s ``wandb`` argument from a ``TrainConfig``: None unless ``log.wandb``.

    Checks that wandb is installed, so a run can fail on it before loading a model.
    """
    if not run.log.wandb:
        return None
    from lspo_jax.job.config_io import to_dict

    _import_wandb()
    return {"project": run.log.wandb_project, "mode": run.log.wandb_mode, "config": to_dict(run)}


def _import_wandb():
    try:
        import wandb
    except ImportError as err:
        from lspo_jax.train_config import ConfigError

        raise ConfigError("log.wandb: wandb is not installed (.venv/bin/pip install -e '.[wandb]')") from err
    return wandb


def _wandb_id(directory: str) -> str:
    path = os.path.join(directory, WANDB_ID_FILE)
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(uuid.uuid4().hex[:16])
    with open(path) as f:
        return f.read().strip()


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers under their logged names: train/loss, eval/math500/pass@1, ..."""
    # Validation records are per benchmark, so the benchmark is part of the prefix.
    prefix = "/".join(str(record[k]) for k in ("kind", "benchmark") if k in record) or "train"
    return {
        f"{prefix}/{key}": value
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
    }


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsError(ValueError):
    """A metrics file that cannot be read as records: the file and line are named."""


def read_metrics(path: str, say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``. A last line cut off mid-write (a kill or a full disk; no newline after
    it) is left out, and ``say`` told so; any other line that is not a JSON record is a ``MetricsError`` naming
    the file and line."""
    with open(path) as f:
        lines = f.read().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # the write of this line never finished
                if say is not None:
                    say(f"{path}: its last line was cut off mid-write ({len(line)} characters); it is left out")
                continue
            raise MetricsError(f"{path}: line {number} is not a JSON record ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise MetricsError(f"{path}: line {number} is not a metrics record (no integer step)")
        records.append(record)
    return records


def records_until(path: str, step: int, say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of ``path`` up to ``step``, what a checkpoint at ``step`` had seen ([] without a file)."""
    return [r for r in read_metrics(path, say) if r["step"] <= step] if os.path.exists(path) else []


def rewrite(path: str, records: list[dict[str, Any]]) -> None:
    """Replace the file by ``records`` at once: a kill mid-way leaves the old file whole."""
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(path + ".tmp", path)
