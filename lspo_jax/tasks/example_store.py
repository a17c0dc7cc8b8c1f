"""A data file's encoded examples on disk: a run starts in seconds and tokenises only the solutions it uses.

The first load of a source reads it a batch of rows at a time, checks every row as ``data.load_examples`` does
(required fields, the gold answer, the prompt's length, each counted in the same ``DataReport``), tokenises the
prompts and writes what it keeps to an Arrow file: the texts, the prompt's ids, the solution's text and the row's
other columns (``Example.fields``, as one JSON text). A later load (a second run, a resume) memory-maps that file
and re-parses nothing. A solution is tokenised when the run first asks for it (``Example.solution_ids``): the
scaffold reads one only for a cliff prompt, a few a step of a source that holds hundreds of millions of solution
tokens. The examples and their order are exactly those of ``data.load_examples``.

A store is keyed by what its content depends on: the bytes of each data file (sha256), the tokenizer (its
serialised model without the padding and truncation that calls set, its chat template and special ids, the
versions of ``transformers`` and ``tokenizers``), the data settings that shape a prompt, ``max_rows``, the
version of math-verify (it decides which gold answers parse) and ``FORMAT_VERSION``. Anything else changed is a
new key, so a stale store is never read; a store cut short, unreadable or changed on disk (its files are checked
against the digest written beside them) is rebuilt, with a line saying so. A
store is written to a temporary directory and renamed when complete, so a crash mid-build leaves nothing half
written. A tokenizer without a serialised form (a slow one) gets no store: its examples live in memory.

Arrow, through pyarrow, is the format of Hugging Face ``datasets``' cache; ``datasets`` itself is not used: its
``map`` fingerprints the transform by pickling it, and a tokenizer's pickle changes between processes and after
calls, so its cache is missed (or, where pickling fails, keyed at random); and its ``map`` would tokenise every
solution up front, the cost this module exists to avoid.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from lspo_jax.config import cache_root
from lspo_jax.tasks import data, data_report, rewards, sources, templates
from lspo_jax.tasks.text import error_cause
from lspo_jax.train_config import DataConfig

# 2: a content digest beside the files; 3: rows typed (a number answer, a list refused), hub ids; 4: the rows' other
# columns (``Example.fields``), the prompt's template and system prompt, the longest prompt in the report.
FORMAT_VERSION = 4
CONTENT_FILES = ("examples.arrow", "report.json")
DIGEST_FILE = "content.sha256"
PROMPT_FIELDS = ("format", "solution_field", "instruction", "instruction_position", "fields", "system_prompt",
                 "template", "max_prompt_tokens", "prompt_policy")  # fmt: skip
PROGRESS_S = 15.0  # a line this often while a store is built
MEMO = 4096  # examples kept built (a solution's ids included) for the steps that draw them again


def store_dir(setting: str | None) -> Path | None:
    """Where stores live for ``data.cache_dir``: ``default`` is ``cache_root()/examples``; null keeps none."""
    if setting is None:
        return None
    return cache_root() / "examples" if setting == "default" else Path(setting).expanduser()


def load_examples(
    spec: str,
    tokenizer: Any,
    config: DataConfig,
    *,
    seed: int = 0,
    max_rows: int | None = None,
    quiet: bool = False,
) -> tuple[Sequence[data.Example], data_report.DataReport]:
    """``data.load_examples``' examples and report, from the source's store (built on first use) for a file or
    directory, and in memory for a generated task or when ``config.cache_dir`` is null. Building a store, or
    rebuilding one found unreadable, is said on stderr unless ``quiet``."""
    if sources.is_generated(spec):
        return data.load_examples(spec, tokenizer, config, seed=seed, max_rows=max_rows)
    log = None if quiet else sys.stderr
    directory = store_dir(config.cache_dir)
    key = None if directory is None else store_key(spec, tokenizer, config, max_rows)
    if key is None:
        table, report = build(spec, tokenizer, config, max_rows=max_rows)
    else:
        table, report = _open_or_build(directory / key, spec, tokenizer, config, max_rows, log)
    return StoredExamples(table, SolutionEncoder(tokenizer, config, report)), report


def _open_or_build(
    path: Path, spec: str, tokenizer: Any, config: DataConfig, max_rows: int | None, log: Any
) -> tuple[Any, data_report.DataReport]:
    if path.is_dir():
        try:
            return open_store(path)
        except (OSError, ValueError, KeyError) as err:  # pyarrow's errors are OSError and ValueError kinds
            _say(log, f"the example store {path} is unreadable ({error_cause(err)}); rebuilding it")
            shutil.rmtree(path, ignore_errors=True)
    _say(log, f"encoding the prompts of {spec} once, into {path}")
    start = time.perf_counter()
    temp = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    try:
        report = build(spec, tokenizer, config, max_rows=max_rows, into=temp, log=log)[1]
        try:
            os.replace(temp, path)
        except OSError:
            if not path.is_dir():  # else another process built the same store first: the same content
                raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    _say(log, f"{report.kept} of {report.rows} rows kept, {time.perf_counter() - start:.1f} s")
    return open_store(path)


def _say(log: Any, line: str) -> None:
    if log is not None:
        print(f"lspo_jax: {line}", file=log, flush=True)


# ------------------------------------------------------------------------------------------------ the key
def store_key(spec: str, tokenizer: Any, config: DataConfig, max_rows: int | None) -> str | None:
    """The store's name: a digest of everything its content depends on; None for a tokenizer that cannot be
    serialised (it is not a fast one)."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return None
    path, files = sources.source_files(spec)
    parts = {
        "format_version": FORMAT_VERSION,
        "files": [[str(f.relative_to(path)) if path.is_dir() else f.name, file_digest(f)] for f in files],
        "tokenizer": fingerprint,
        "data": {name: _plain(getattr(config, name)) for name in PROMPT_FIELDS},
        "max_rows": max_rows,
        "math_verify": importlib.metadata.version("math-verify"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _plain(value: Any) -> Any:
    """A setting as JSON writes it: a section (``data.fields``) as its mapping."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def source_digest(spec: str) -> str | None:
    """One digest of a data source's files (names and bytes); None for a generated task. A resumed run compares it
    with its checkpoint's: a changed file would give another order of prompts at the same position."""
    if sources.is_generated(spec):
        return None
    path, files = sources.source_files(spec)
    return hashlib.sha256(json.dumps([[f.name, file_digest(f)] for f in files]).encode()).hexdigest()[:32]


def file_digest(path: Path) -> str:
    try:
        stat = path.stat()
        return _file_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    except OSError as err:
        raise data_report.DataError(f"{path}: cannot be opened ({error_cause(err)})") from err


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """Read once per version of a file in a process (the store's key and the run's source digest both ask)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = backend.to_str()
    if backend.padding is not None or backend.truncation is not None:  # set and cleared by calls: not the model
        model = json.dumps({k: v for k, v in json.loads(model).items() if k not in ("padding", "truncation")})
    extra = [getattr(tokenizer, "chat_template", None), tokenizer.bos_token_id, tokenizer.eos_token_id,
             importlib.metadata.version("transformers"), importlib.metadata.version("tokenizers")]  # fmt: skip
    return hashlib.sha256(json.dumps([model, extra]).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------- building
def build(
    spec: str,
    tokenizer: Any,
    config: DataConfig,
    *,
    max_rows: int | None = None,
    into: Path | None = None,
    log: Any = None,
) -> tuple[pa.Table | None, data_report.DataReport]:
    """Read, check and encode the prompts of ``spec`` a chunk of rows at a time; the kept examples as an Arrow
    table, written to ``into`` (with the report beside it) when given, and the report.

    Rows whose gold answer does not parse are left out, then the prompt length policy applies, as in
    ``data.load_examples``; each distinct gold answer is parsed once. ``log`` gets a line every
    ``PROGRESS_S`` seconds.
    """
    report = data_report.DataReport()
    rows = sources.iter_rows(spec, config, report=report, max_rows=max_rows)
    parses: dict[str, bool] = {}
    batches, writer, read = [], None, 0
    if into is not None:
        into.mkdir(parents=True)
    shown = time.perf_counter()
    for chunk in _chunks(rows, data.ENCODE_CHUNK):
        read += len(chunk)
        if time.perf_counter() - shown > PROGRESS_S:
            _say(log, f"... {read} rows read")
            shown = time.perf_counter()
        answers = {str(r["answer"]) for r in chunk} - parses.keys()
        bad = rewards.parse_golds((a, a) for a in answers).bad
        parses.update((a, a not in bad) for a in answers)
        report.gold_unparseable += [str(r["id"]) for r in chunk if not parses[str(r["answer"])]]
        batch = _encode_chunk([r for r in chunk if parses[str(r["answer"])]], tokenizer, config, report)
        if into is None:
            batches.append(batch)
            continue
        writer = writer or pa.ipc.new_file(str(into / "examples.arrow"), _schema())
        writer.write_batch(batch)
    report.rows = read + report.rows_invalid
    table = pa.Table.from_batches(batches, _schema()) if into is None else None
    if into is not None:
        (writer or pa.ipc.new_file(str(into / "examples.arrow"), _schema())).close()
        (into / "report.json").write_text(json.dumps(dataclasses.asdict(report)))
        (into / DIGEST_FILE).write_text(content_digest(into))
    return table, report


def content_digest(path: Path) -> str:
    """sha256 over the store's files: a store changed in place (a flipped byte, a gold answer edited) is found
    before pyarrow reads it, which for some damage aborts the process instead of raising."""
    digest = hashlib.sha256()
    for name in CONTENT_FILES:
        with (path / name).open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def _schema() -> pa.Schema:
    return pa.schema([("id", pa.string()), ("answer", pa.string()), ("problem", pa.large_string()),
                      ("solution", pa.large_string()), ("prompt_ids", pa.list_(pa.int32())),
                      ("fields", pa.large_string())])  # fmt: skip


def _chunks(rows: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_chunk(
    rows: list[dict[str, Any]], tokenizer: Any, config: DataConfig, report: data_report.DataReport
) -> Any:
    """The rows whose prompt passes the length policy, as a record batch; the solutions stay text."""
    prompts = templates.render_prompts(tokenizer, [templates.prompt_text(r["problem"], config) for r in rows], config)
    kept = []
    for row, prompt in zip(rows, prompts, strict=True):
        if (prompt := data.checked_prompt(prompt, config, report)) is not None:
            kept.append((row, prompt))
            report.solution_missing += not row.get("solution")
    report.kept += len(kept)
    columns = {
        "id": [str(r["id"]) for r, _ in kept],
        "answer": [str(r["answer"]) for r, _ in kept],
        "problem": [str(r["problem"]) for r, _ in kept],
        "solution": [r.get("solution") or None for r, _ in kept],
        "prompt_ids": [p for _, p in kept],
        "fields": [json.dumps(r["fields"]) if r.get("fields") else None for r, _ in kept],  # JSON: any column's type
    }
    return pa.record_batch(columns, schema=_schema())


# ----------------------------------------------------------------------------------------------- reading
def open_store(path: Path) -> tuple[Any, data_report.DataReport]:
    """A built store, memory-mapped, and its report; ``ValueError`` when its content is not what was written (its
    digest differs) or the two files disagree."""
    if content_digest(path) != (path / DIGEST_FILE).read_text().strip():
        raise ValueError("its files changed after it was built (their digest differs)")
    report = data_report.DataReport(**json.loads((path / "report.json").read_text()))
    table = pa.ipc.open_file(pa.memory_map(str(path / "examples.arrow"))).read_all()
    if table.num_rows != report.kept or table.schema != _schema():
        raise ValueError(f"it holds {table.num_rows} examples of {report.kept}")
    return table, report


class SolutionEncoder:
    """``Example.encode`` for a store's examples: tokenise a solution on first use and apply the length policy,
    counting in the store's report; a solution that fails to tokenise is counted, listed and left out."""

    def __init__(self, tokenizer: Any, config: DataConfig, report: data_report.DataReport):
        self.tokenizer, self.config, self.report = tokenizer, config, report

    def __call__(self, example: data.Example) -> np.ndarray | None:
        try:
            ids = templates.encode_texts(self.tokenizer, [example.solution])[0]
        except Exception as err:  # a tokenizer's own failure on one text: that row is no scaffold target
            self.report.solution_errors += 1
            if len(self.report.row_errors) < data_report.MAX_LISTED:
                self.report.row_errors.append(f"id {example.id}: solution not tokenised ({error_cause(err)})")
            return None
        return data.fit_solution(ids, self.tokenizer.eos_token_id, self.config, self.report)


class StoredExamples(Sequence):
    """The examples of an Arrow table, built on access (and the last ``MEMO`` kept); slices share the table."""

    def __init__(self, table: Any, encode: SolutionEncoder, rows: range | None = None, memo: Any = None):
        self.table, self.encode = table, encode
        self.rows = range(table.num_rows) if rows is None else rows
        self.columns = {name: table.column(name) for name in table.column_names}
        self.memo = collections.OrderedDict() if memo is None else memo

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return StoredExamples(self.table, self.encode, self.rows[index], self.memo)
        row = self.rows[index]  # IndexError past the end, as a list
        if (example := self.memo.get(row)) is not None:
            self.memo.move_to_end(row)
            return example
        value = {name: column[row].as_py() for name, column in self.columns.items()}
        fields = json.loads(value["fields"]) if value["fields"] else None
        example = data.Example(value["id"], value["answer"], tuple(value["prompt_ids"]), None, value["problem"],
                               value["solution"], fields=fields, encode=self.encode)  # fmt: skip
        self.memo[row] = example
        if len(self.memo) > MEMO:
            self.memo.popitem(last=False)
        return example
