"""Benchmarks by name: where a benchmark's rows are and the name its results are reported under.

A bare name (``math500``: no directory, no suffix) is looked for, in this order:

1. ``DATA_DIR/NAME.jsonl`` (or ``.parquet``), ``DATA_DIR`` being the explicit directory (``eval.data_dir``,
   ``lspo-eval --data-dir``), else ``$LSPO_JAX_DATA_DIR`` when set;
2. the benchmarks that ship inside the package (``manifest()``: MATH-500, AIME 2024, AIME 2025, each checked
   against the sha256 of its manifest before it is read);
3. the Hugging Face hub, for the names with a known dataset there (``HUB_NAMES``).

A path (``dir/file.jsonl``), a hub name (``ORG/NAME[@REV][:PART]``, see ``lspo_jax.hub``) or a generated task
(``toy:...``) is taken as given. A name found nowhere is one error naming every place it was looked for.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from lspo_jax import hub

DATA_DIR_VAR = "LSPO_JAX_DATA_DIR"
PACKAGED_DIR = Path(__file__).resolve().parents[1] / "assets" / "benchmarks"
# Bare names that the package does not ship but the hub holds, in a schema ``tasks.data`` reads as it is. AIME 2026
# (MathArena's: ``problem_idx, problem, answer``) is CC BY-NC-SA 4.0, which the package's Apache-2.0 cannot carry.
HUB_NAMES = {"aime26": "MathArena/aime_2026"}


class BenchmarkNotFound(FileNotFoundError):
    """A benchmark name found in none of the places it is looked for (the message lists them)."""


@functools.cache
def manifest() -> dict[str, dict]:
    """The packaged benchmarks: name -> ``{file, rows, sha256, license, license_files, origin}``."""
    return json.loads((PACKAGED_DIR / "manifest.json").read_text())["benchmarks"]


def is_bare(value: str) -> bool:
    """A name to look up (``math500``), not a path, a hub name or a generated task."""
    return not (value.startswith("toy:") or "/" in value or Path(value).suffix)


def benchmark_path(value: str, data_dir: str | Path | None = None) -> str:
    """Where a benchmark's rows are (see the module docstring for the order a bare name is looked up in); a path,
    hub name or generated task as given."""
    if not is_bare(value):
        return value
    looked = []
    data_dir = data_dir or os.environ.get(DATA_DIR_VAR) or None
    if data_dir is not None:
        for suffix in (".jsonl", ".parquet"):
            candidate = Path(data_dir) / f"{value}{suffix}"
            if candidate.exists():
                return str(candidate)
        looked.append(f"{Path(data_dir) / value}.jsonl")
    if value in manifest():
        return str(packaged_file(value))
    looked.append(f"the package's benchmarks ({', '.join(manifest())})")
    if value in HUB_NAMES:
        try:
            hub.dataset_files(HUB_NAMES[value], key=None)  # fetched now, so that a failure names every place
        except FileNotFoundError as err:
            raise BenchmarkNotFound(f"benchmark {value!r} not found in {'; '.join(looked)}; {err}") from None
        return HUB_NAMES[value]
    looked.append(f"the hub names known here ({', '.join(HUB_NAMES)})")
    raise BenchmarkNotFound(
        f"benchmark {value!r} not found; looked in {'; '.join(looked)}. Name a file, a hub dataset (ORG/NAME), or a "
        f"directory holding {value}.jsonl with --data-dir / eval.data_dir / ${DATA_DIR_VAR}"
    )


def packaged_file(name: str) -> Path:
    """A packaged benchmark's file, after checking its bytes against the manifest (a damaged install is refused:
    a benchmark that lost a problem is not the benchmark the field reports on)."""
    entry = manifest()[name]
    path = PACKAGED_DIR / entry["file"]
    digest = _sha256(str(path))
    if digest != entry["sha256"]:
        raise BenchmarkNotFound(f"{path}: its sha256 {digest[:12]}... is not the manifest's {entry['sha256'][:12]}...; "
                                "the installed package is damaged, reinstall lspo_jax")  # fmt: skip
    return path


@functools.cache
def _sha256(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as err:
        raise BenchmarkNotFound(
            f"{path}: a packaged benchmark cannot be read ({err.strerror}); reinstall lspo_jax"
        ) from err


def benchmark_name(value: str) -> str:
    """The name a benchmark is reported under: the file name without suffix (``math500``), ``toy_heldout``, or a
    hub dataset's name (``MATH-500``; its part appended, ``MATH-500_test``, when one is named)."""
    if value.startswith("toy:"):
        return value.replace(":", "_")
    if hub.is_hub_name(value):
        repo, _, part = hub.parse(value)
        name = repo.split("/")[1]
        return f"{name}_{Path(part).stem}" if part else name
    name = Path(value).name
    return name[: -len(Path(name).suffix)] if Path(name).suffix else name
