"""Benchmarks by name: where a benchmark's rows are and the name its results are reported under."""

from __future__ import annotations

from pathlib import Path

# The project's shared data, beside the repository: ``../shared/data`` from its root.
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"


def benchmark_path(value: str, data_dir: str | Path | None = None) -> str:
    """Where a benchmark's rows are: a bare name (no directory, no suffix) is ``DATA_DIR/NAME.jsonl``
    (``data_dir``, else the project's ``../shared/data``); a path or a generated task (``toy:...``) as given."""
    if value.startswith("toy:") or "/" in value or Path(value).suffix:
        return value
    return str(Path(data_dir or DEFAULT_DATA_DIR) / f"{value}.jsonl")


def benchmark_name(value: str) -> str:
    """The name a benchmark is reported under: the file name without suffix (``math500``), ``toy_heldout``."""
    if value.startswith("toy:"):
        return value.replace(":", "_")
    name = Path(value).name
    return name[: -len(Path(name).suffix)] if Path(name).suffix else name
