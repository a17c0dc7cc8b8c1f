"""Run metrics: one JSON line per record in ``metrics.jsonl`` and TensorBoard scalars beside it."""

from __future__ import annotations

import json
import math
import os
from typing import Any


class MetricsLog:
    """Append-only metrics of a run; a resumed run appends to the same files."""

    def __init__(self, directory: str, *, tensorboard: bool = True):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)  # line-buffered: nothing lost on a crash
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(directory, "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        """Write one record; it must hold ``step``. Non-finite floats are written as null in JSON."""
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            # Validation records are per benchmark: eval/math500/pass@1, eval/aime24/pass@1, ...
            prefix = "/".join(str(clean[k]) for k in ("kind", "benchmark") if k in clean) or "train"
            for key, value in clean.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(f"{prefix}/{key}", value, clean["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class NullLog:
    """The metrics log of a process that does not write (every process of a multi-host job but the first)."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
