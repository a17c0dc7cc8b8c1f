"""Data sources read into one schema of rows.

A row is ``{"id", "problem", "answer", "solution", "source", "meta", "fields"}`` (the schema of the packaged
benchmarks; ``fields``: the record's other columns, for the reward functions). Files in that schema, in the hub's own
fields for it (MATH-500's ``unique_id``, MathArena's ``problem_idx``, or no id at all: the row's position), and
DeepMath-103K files (``question, final_answer, difficulty, topic, r1_solution_1..3``) are read into it, as JSONL,
parquet or a JSON array, from a file, a directory of them, or a hub dataset (``ORG/NAME[@REV][:PART]``,
``lspo_jax.hub``); ``toy:addition`` is the demo's generated task. ``data.fields`` names a file's own columns for the
roles problem, answer, solution and id.

A row lacking a required field, or with one of a type no grader reads (a list answer), is skipped and listed in the
``DataReport``; a source with records but none usable, or a file that cannot be read, is a ``DataError``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from lspo_jax import hub, options
from lspo_jax.tasks import toy
from lspo_jax.tasks.data_report import DataError, DataReport
from lspo_jax.tasks.text import error_cause
from lspo_jax.train_config import DataConfig, DataFields

ROLES = tuple(f.name for f in dataclasses.fields(DataFields))  # problem, answer, solution, id: ``data.fields``' keys


# The column each role is read from where ``data.fields`` names none, or a row lacks the one it names; a DeepMath
# row's solution is ``data.solution_field``'s trace.
COLUMNS = {"shared": {"problem": "problem", "answer": "answer", "solution": "solution"},
           "deepmath": {"problem": "question", "answer": "final_answer"}}  # fmt: skip


TRACES = options.choices(options.SolutionField)  # DeepMath's R1 traces: the unused two are never read


# The fields a row's id is taken from, first present first (the hub's MATH-500, MathArena); else its position.
ID_FIELDS = ("id", "unique_id", "problem_idx")


def is_generated(spec: str) -> bool:
    """True for the demo's generated tasks (``toy:...``), which carry their own prompt format."""
    return spec.startswith("toy:")


def read_rows(
    spec: str,
    config: DataConfig | None = None,
    *,
    seed: int = 0,
    report: DataReport | None = None,
    max_rows: int | None = None,
) -> list[dict[str, Any]]:
    """Rows in the shared schema from a JSONL or parquet file, a directory of them, or a generated task;
    with ``max_rows``, of its first that many records only (those skipped among them included).

    Records lacking a required field (or lines that are not JSON) are counted in ``report`` and skipped;
    a source with records but none usable is an error, since that is a wrong file rather than bad rows, and
    so is a file that cannot be opened or a parquet file that cannot be read (``DataError`` naming the file).
    """
    return list(iter_rows(spec, config, seed=seed, report=report, max_rows=max_rows))


def iter_rows(
    spec: str,
    config: DataConfig | None = None,
    *,
    seed: int = 0,
    report: DataReport | None = None,
    max_rows: int | None = None,
) -> Iterator[dict[str, Any]]:
    """``read_rows`` one row at a time: a parquet file is read a batch of rows at a time, so that a source of
    gigabytes of solutions is never held whole."""
    config = config or DataConfig()
    report = report if report is not None else DataReport()
    generated = {
        "toy:addition": lambda: toy.training_rows(seed=seed),
        "toy:heldout": lambda: toy.heldout_rows(seed=seed),
        "toy:target": lambda: toy.target_rows(seed=seed),
        **{f"toy:heldout_{name}": lambda name=name: toy.class_heldout_rows(name) for name in toy.CLASSES},
    }
    if spec in generated:
        yield from generated[spec]()[:max_rows]
        return
    path, files = source_files(spec)
    index, usable = 0, 0  # index: a DeepMath row's id when it has none, its position in the whole source
    for file in files:
        fmt = config.format if config.format != "auto" else _detect_format(file, config)
        report.solution_column = config.fields.solution or COLUMNS[fmt].get("solution", config.solution_field)
        name = file.name if path.is_dir() else ""
        for where, record in _records(file, fmt, config):
            if index == max_rows:
                break
            where = f"{name} {where}".strip()
            if record is None:
                report.invalid(where, "not a JSON object")
            elif (row := _to_shared(record, fmt, config, index, where, report)) is not None:
                usable += 1
                yield row
            index += 1
    if index and not usable:
        raise DataError(f"{spec}: none of its {index} rows is usable, e.g. {report.row_errors[:3]}")


def source_files(spec: str) -> tuple[Path, list[Path]]:
    """The path of a file, directory or hub dataset source and the data files it holds, in the order they are
    read (a hub dataset's: its snapshot in the Hugging Face cache, fetched on first use)."""
    if hub.is_hub_name(spec):
        return hub.dataset_files(spec, key=None)
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"no such data file or directory: {spec}")
    try:
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".parquet")) if path.is_dir() else [path]
    except OSError as err:
        raise DataError(f"{spec}: cannot list the directory ({error_cause(err)})") from err
    if not files:
        raise FileNotFoundError(f"no .jsonl or .parquet files in {spec}")
    return path, files


def _parquet(file: Path, read: Callable[..., Any], **kwargs: Any) -> Any:
    """``read(file, **kwargs)``; a file pyarrow cannot open or read (cut short, not parquet) is a ``DataError``."""
    import pyarrow as pa

    try:
        return read(file, **kwargs)
    except (pa.ArrowException, OSError) as err:  # ArrowInvalid for a missing footer, OSError for bad metadata
        raise DataError(f"{file}: not a readable parquet file ({error_cause(err)})") from err


def _open(file: Path) -> BinaryIO:
    """The file in binary mode: ``json.loads`` decodes each line, so bytes that are not UTF-8 make a bad row."""
    try:
        return file.open("rb")
    except OSError as err:
        raise DataError(f"{file}: cannot be opened ({error_cause(err)})") from err


def _detect_format(file: Path, config: DataConfig) -> str:
    """``shared`` or ``deepmath``, from the fields of the file's first record (parquet: its schema): a file with
    ``problem``, or the column ``data.fields.problem`` names, is read as ``shared``."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        fields = set(_parquet(file, pq.read_schema).names)
    elif _is_json_array(file):
        fields = next((set(r) for r in _json_array(file) if isinstance(r, dict)), set())
    else:
        fields = set()
        with _open(file) as f:
            for line in f:
                try:
                    record = json.loads(line) if line.strip() else None
                except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError)
                    continue
                if isinstance(record, dict):
                    fields = set(record)
                    break
    if "problem" in fields or config.fields.problem in fields or not fields:  # no record: nothing to read either way
        return "shared"
    if "question" in fields:
        return "deepmath"
    raise DataError(f"{file}: cannot tell the format from its fields {sorted(fields)}; set data.format, or name the "
                    "problem's column in data.fields.problem")  # fmt: skip


def _records(file: Path, fmt: str, config: DataConfig) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """``(where, record)`` per record of a file; ``record`` is None for a JSONL line that is not an object."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        # Not the traces that are not used: the three R1 traces of DeepMath-103K run to gigabytes in memory.
        unused = set(TRACES) - {config.solution_field, config.fields.solution} if fmt == "deepmath" else set()
        columns = [n for n in _parquet(file, pq.read_schema).names if n not in unused]
        batches = _parquet(file, lambda f: pq.ParquetFile(f).iter_batches(PARQUET_BATCH, columns=columns))
        i = 0
        while (batch := _parquet(file, lambda _: next(batches, None))) is not None:
            for record in batch.to_pylist():
                yield f"row {i}", record
                i += 1
        return
    if _is_json_array(file):
        for i, record in enumerate(_json_array(file)):
            yield f"item {i}", record if isinstance(record, dict) else None
        return
    with _open(file) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError): a bad row, counted
                record = None
            yield f"line {line_no}", record if isinstance(record, dict) else None


def _is_json_array(file: Path) -> bool:
    """A ``.json`` file holding one array of records (DeepScaleR's ``deepscaler.json``); any other file is read
    as JSONL, one record a line."""
    if file.suffix != ".json":
        return False
    with _open(file) as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def _json_array(file: Path) -> list[Any]:
    with _open(file) as f:
        try:
            records = json.load(f)
        except ValueError as err:
            raise DataError(f"{file}: not a readable JSON array ({error_cause(err)})") from err
    if not isinstance(records, list):
        raise DataError(f"{file}: a .json data file must hold an array of records")
    return records


PARQUET_BATCH = 1024  # rows of a parquet file in memory at once while it is read


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _to_shared(
    record: dict[str, Any], fmt: str, config: DataConfig, index: int, where: str, report: DataReport
) -> dict[str, Any] | None:
    """The record in the shared schema, or None (counted and listed) when a required field is missing or of a
    type no grader reads (``_field_error``). A record with no id field (``ID_FIELDS``, or the one ``data.fields.id``
    names) takes its position in the source, as a DeepMath row does. Each role is read from its ``_column``."""
    problem_key, answer_key, solution_key = (_column(record, role, fmt, config) for role in ROLES[:3])
    id_key = next((k for k in (config.fields.id, *ID_FIELDS) if k is not None and not _missing(record.get(k))), None)
    ident = index if id_key is None else record[id_key]
    where = f"{where} (id {ident})"
    if (error := _field_error(record, problem_key, answer_key)) is not None:
        report.invalid(where, error)
        return None
    row = {"id": str(ident), "problem": record[problem_key], "answer": _answer_text(record[answer_key]),
           "solution": _solution_text(record.get(solution_key), solution_key, where, report)}  # fmt: skip
    used = {problem_key, answer_key, solution_key, id_key}
    fields = _json_values({k: v for k, v in record.items() if k not in used and (fmt == "shared" or k not in TRACES)})
    if fmt == "shared":
        meta = record.get("meta")
        if meta is None:  # a hub file's own fields (subject, level, url, ...) kept as the schema keeps them
            meta = {k: v for k, v in record.items() if k not in SHARED_FIELDS and k not in ID_FIELDS and k not in used}
        return {**record, **row, "meta": meta, "fields": fields}
    meta = {"difficulty": record.get("difficulty"), "topic": record.get("topic")}
    return {**row, "source": "deepmath", "meta": meta, "fields": fields}


def _column(record: dict[str, Any], role: str, fmt: str, config: DataConfig) -> str:
    """The column ``role`` is read from: the one ``data.fields`` names where the record has it, else the format's;
    the named one again when the record has neither, so that a row missing it is listed by the user's name."""
    named = getattr(config.fields, role)
    if named is not None and named in record:
        return named
    default = COLUMNS[fmt].get(role, config.solution_field)
    return default if named is None or default in record else named


def _json_values(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` as JSON would give them back (a parquet date as its text, a tuple as a list): the same values
    whether the examples were kept in memory or read back from their store."""
    return json.loads(json.dumps(fields, default=str)) if fields else {}


def _field_error(record: dict[str, Any], problem_key: str, answer_key: str) -> str | None:
    """Why ``record`` cannot be a row, or None. A required field that is missing, a problem that is not a string,
    or an answer that is neither a string nor a number: ``str`` of a list answer (``["3", "4"]``, common in math
    datasets) is a gold no rollout can match, so the row would be a cliff on every step with accuracy 0."""
    missing = [k for k in (problem_key, answer_key) if _missing(record.get(k))]
    if missing:
        return f"missing {', '.join(missing)}"
    if not isinstance(record[problem_key], str):
        return f"{problem_key} is {_a_type(record[problem_key])}, not a string"
    if _answer_text(record[answer_key]) is None:
        return f"{answer_key} is {_a_type(record[answer_key])}, not a string or number"
    return None


def _answer_text(value: Any) -> str | None:
    """A gold answer as text: a string as it is, a number by ``str``, an integral float as its int (AIME answers
    read from parquet are floats: ``70.0`` is written ``70``); None for anything else (a bool is no answer)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _solution_text(value: Any, key: str, where: str, report: DataReport) -> str | None:
    """A worked solution, or None: missing, or not a string (listed; the row stays a prompt with no solution)."""
    if _missing(value):
        return None
    if not isinstance(value, str):
        report.note(where, f"{key} is {_a_type(value)}, not a string: kept without a solution")
        return None
    return value


def _a_type(value: Any) -> str:
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


SHARED_FIELDS = ("id", "problem", "answer", "solution", "source", "meta")
