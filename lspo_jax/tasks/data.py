"""Training data: rows read into one schema, tokenised into prompts and SFT targets, drawn in a resumable order.

A row is ``{"id", "problem", "answer", "solution", "source", "meta", "fields"}`` (the schema of the packaged
benchmarks; ``fields``: the record's other columns, for the reward functions). Files in that schema, in the hub's own
fields for it (MATH-500's ``unique_id``, MathArena's ``problem_idx``, or no id at all: the row's position), and
DeepMath-103K files (``question, final_answer, difficulty, topic, r1_solution_1..3``) are read into it, as JSONL,
parquet or a JSON array, from a file, a directory of them, or a hub dataset (``ORG/NAME[@REV][:PART]``,
``lspo_jax.hub``); ``toy:addition`` is the demo's generated task. ``data.fields`` names a file's own columns for the
roles problem, answer, solution and id.

Bad rows never crash a run: a row lacking a required field, or with one of a type no grader reads (a list
answer), is skipped and listed, a prompt over the token limit is skipped or truncated per config, a solution over
its limit likewise, and a row without a solution stays a training prompt but is never a scaffold target. Every
such case is counted in ``DataReport``. Gold answers are parsed once here, and rows whose gold does not parse are
left out (they would be permanent cliffs that no rollout can pass).

Prompts are rendered per ``data.template`` (``TEMPLATES``): by default with the tokenizer's chat template when it has
one. For DeepSeek-R1-Distill-Qwen that gives ``<｜begin▁of▁sentence｜><｜User｜>{problem}<｜Assistant｜><think>\n``,
as ``r1`` does for any tokenizer with those tokens: the prompt already opens the thought, which is why a DeepMath
``r1_solution_*`` trace (no opening ``<think>``, one ``</think>``, then the written solution) is the SFT target as
it is, followed by EOS. A trace cut to ``max_solution_tokens`` gets no EOS
(unless ``data.eos_after_truncated``): the cut is mid-thought, and an EOS there would teach the adapter to stop.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lspo_jax import hub, options
from lspo_jax.tasks import rewards, toy
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
MAX_LISTED = 100  # rows named in ``DataReport.row_errors``; the count is always complete


class Example:
    """One training prompt: token ids of the prompt and of its worked solution (EOS appended unless it was
    truncated), if any; the problem and solution texts for a judge that reads them (``first_mistake``); ``fields``,
    the row's other columns as JSON values (``difficulty``, ``test_cases``), which the reward functions receive:
    read them, never change them (the examples are shared by every step that draws them).

    ``solution_ids`` is given, or made on first use by ``encode(example)`` (``example_store``: a run's prompts
    are tokenised up front, its solutions only when the scaffold needs one).
    """

    __slots__ = ("id", "answer", "prompt_ids", "problem", "solution", "fields", "_solution_ids", "_encode")

    def __init__(
        self,
        id: str,
        answer: str,
        prompt_ids: tuple[int, ...],
        solution_ids: np.ndarray | None = None,
        problem: str = "",
        solution: str | None = None,
        *,
        fields: dict[str, Any] | None = None,
        encode: Callable[[Example], np.ndarray | None] | None = None,
    ):
        self.id, self.answer, self.prompt_ids, self.problem, self.solution = id, answer, prompt_ids, problem, solution
        self.fields = {} if fields is None else fields
        self._solution_ids, self._encode = solution_ids, encode if solution else None

    @property
    def solution_ids(self) -> np.ndarray | None:  # int32
        if self._encode is not None:
            encode, self._encode = self._encode, None
            self._solution_ids = encode(self)
        return self._solution_ids

    def __repr__(self) -> str:
        return f"Example(id={self.id!r}, answer={self.answer!r}, {len(self.prompt_ids)} prompt tokens)"


class DataError(ValueError):
    """A data file that cannot be used as a whole (no usable row, an unknown format, unreadable): the commands
    print it alone."""


@dataclasses.dataclass
class DataReport:
    """What loading did to the rows, for the run's log.

    ``rows`` counts every record of the source; ``rows_invalid`` those skipped for a missing field, a field of a
    type no grader reads (a list answer, a dict problem) or a line that is not JSON, the first ``MAX_LISTED`` of
    them described in ``row_errors`` (with rows kept whose solution was not a string). Solutions are counted
    as they are tokenised (``solutions_encoded``): a file's at start, a cached source's when first used, so
    ``solution_skipped``, ``solution_truncated`` and ``solution_errors`` (a solution that failed to tokenise:
    never a scaffold target, listed in ``row_errors``) count those so far. ``prompt_longest`` is the longest prompt
    rendered (tokens), ``max_prompt_tokens`` the limit it was held to (0: a report not made by loading), and
    ``solution_column`` the column the worked solutions were read from.
    """

    rows: int = 0
    kept: int = 0
    rows_invalid: int = 0
    row_errors: list[str] = dataclasses.field(default_factory=list)
    prompt_skipped: int = 0
    prompt_truncated: int = 0
    solution_missing: int = 0
    solutions_encoded: int = 0
    solution_skipped: int = 0
    solution_truncated: int = 0
    solution_errors: int = 0
    gold_unparseable: list[str] = dataclasses.field(default_factory=list)
    prompt_longest: int = 0
    max_prompt_tokens: int = 0
    solution_column: str = ""

    def losses(self) -> str | None:
        """One line on the rows that loading dropped or cut, for the console; None when it kept them all whole."""
        lost = {k: getattr(self, k) for k in ("rows_invalid", "prompt_skipped", "prompt_truncated") if getattr(self, k)}
        if self.gold_unparseable:
            lost["gold_unparseable"] = len(self.gold_unparseable)
        if not lost:
            return None
        example = f"; e.g. {self.row_errors[0]}" if self.row_errors else ""
        length = f"; {line}" if (line := self.too_long()) else ""
        return f"{self.kept} of {self.rows} rows kept; {lost}{example}{length}"

    def too_long(self) -> str | None:
        """The prompts over ``data.max_prompt_tokens``, the longest, and the key that keeps them; None when none
        was (or the report names no limit)."""
        over = self.prompt_skipped + self.prompt_truncated
        if not over or not self.max_prompt_tokens:
            return None
        limit = self.max_prompt_tokens
        said = (f"{over} of {self.kept + self.prompt_skipped} prompts are longer than data.max_prompt_tokens={limit} "
                f"(the longest {self.prompt_longest} tokens, with the template and instruction)")  # fmt: skip
        if self.prompt_skipped:
            return f"{said}; raise data.max_prompt_tokens or set data.prompt_policy: truncate"
        return f"{said}, cut to their last {limit} tokens; raise data.max_prompt_tokens to keep them whole"

    def no_solution(self) -> str | None:
        """A line when no kept row has a worked solution: the scaffold has nothing to learn a cliff from."""
        if not self.kept or self.solution_missing < self.kept:
            return None
        column = f" (column {self.solution_column!r})" if self.solution_column else ""
        return (
            f"no row has a worked solution{column}: cliffs cannot be rescued, as the LSPO scaffold learns "
            "from worked solutions, so the run behaves as DAPO on them; name the column in data.fields.solution"
        )

    def warnings(self, scaffold: bool = True) -> list[str]:
        """The lines a run prints on its training source: what loading dropped or cut (``losses``), and for a run
        whose scaffold learns from worked solutions, a source that has none (``no_solution``)."""
        lines = [self.losses(), self.no_solution() if scaffold else None]
        return [line for line in lines if line]

    def check_kept(self, what: str) -> None:
        """``DataError`` saying why, when loading kept no row of ``what`` (``data.train FILE``): the prompts' length
        and the key that fixes it, else what was lost."""
        if not self.kept:
            raise DataError(f"{what}: {self.too_long() or self.losses() or 'it holds no rows'}")

    def invalid(self, where: str, problem: str) -> None:
        self.rows_invalid += 1
        self.note(where, problem)

    def note(self, where: str, problem: str) -> None:
        """List a problem of a row that is kept (a solution of the wrong type), up to ``MAX_LISTED``."""
        if len(self.row_errors) < MAX_LISTED:
            self.row_errors.append(f"{where}: {problem}")


# ------------------------------------------------------------------------------------------------ reading
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


# ---------------------------------------------------------------------------------------------- encoding
def prompt_text(problem: str, config: DataConfig) -> str:
    """The user turn: the problem with the instruction after or before it (one newline between), or alone."""
    if config.instruction_position == "none" or not config.instruction:
        return problem
    if config.instruction_position == "before":
        return f"{config.instruction}\n{problem}"
    return f"{problem}\n{config.instruction}"


def render_prompt(tokenizer: Any, text: str, config: DataConfig | None = None) -> list[int]:
    """Prompt token ids of one user turn ``text`` per ``config``'s template and system prompt (None: the
    tokenizer's chat template when it has one, else BOS + the text; no system prompt).

    The prompt is rendered to text and then encoded without special tokens, since the template writes its own BOS
    (the way transformers tokenizes a rendered chat).
    """
    return render_prompts(tokenizer, [text], config)[0]


def render_texts(tokenizer: Any, texts: Sequence[str], config: DataConfig | None = None) -> list[str]:
    """The prompts as text, one per user turn in ``texts``, per ``data.template`` and ``data.system_prompt``
    (``config`` None: the generated tasks' own format, the tokenizer's template and no system prompt)."""
    template, system = ("tokenizer", None) if config is None else (config.template, config.system_prompt)
    if template == "tokenizer" and not getattr(tokenizer, "chat_template", None):
        template = "plain"
    return TEMPLATES.resolve(template)(tokenizer, texts, system)


TEMPLATES = options.Registry(options.PromptTemplate, "prompt template")


@TEMPLATES.register("tokenizer")
def _chat_template(tokenizer: Any, texts: Sequence[str], system: str | None) -> list[str]:
    """The tokenizer's own chat template: a system turn (when set), the user turn, the generation prompt."""
    import jinja2

    head = [{"role": "system", "content": system}] if system else []
    try:
        rendered = [
            tokenizer.apply_chat_template([*head, {"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=False)
            for text in texts
        ]  # fmt: skip
    except (jinja2.TemplateError, ValueError) as err:  # a template that refuses a system turn raises
        raise DataError(f"data.template: the tokenizer's chat template failed ({error_cause(err)}); set "
                        "data.template: r1 or plain, or data.system_prompt: null") from err  # fmt: skip
    # A template written for user turns alone (some ports of R1's) drops a system turn without a word.
    if system and rendered and system.strip() not in rendered[0]:
        raise DataError("data.system_prompt: the tokenizer's chat template leaves the system turn out; set "
                        "data.template: r1 or plain, or data.system_prompt: null")  # fmt: skip
    return rendered


# DeepSeek-R1-Distill's markup; its chat template puts a system prompt right after BOS, with no separator.
R1_BOS, R1_USER, R1_ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


@TEMPLATES.register("r1")
def _r1_template(tokenizer: Any, texts: Sequence[str], system: str | None) -> list[str]:
    """``<｜begin▁of▁sentence｜>{system}<｜User｜>{text}<｜Assistant｜><think>`` and a newline, as DeepSeek-R1-Distill's
    template renders one turn; each of its three marks must be one token of the tokenizer, not text."""
    marks = (R1_BOS, R1_USER, R1_ASSISTANT)
    lacking = [mark for mark, ids in zip(marks, encode_texts(tokenizer, marks), strict=True) if len(ids) != 1]
    if lacking:
        raise DataError(f"data.template: r1 needs the tokens {', '.join(lacking)}, which the tokenizer does not "
                        "have; set data.template: tokenizer or plain")  # fmt: skip
    return [f"{R1_BOS}{system or ''}{R1_USER}{text}{R1_ASSISTANT}<think>\n" for text in texts]


@TEMPLATES.register("plain")
def _plain_template(tokenizer: Any, texts: Sequence[str], system: str | None) -> list[str]:
    """No chat markup: BOS (when the tokenizer has one), the system prompt and a newline (when set), the text."""
    head = (tokenizer.bos_token if tokenizer.bos_token_id is not None else "") + (f"{system}\n" if system else "")
    return [head + text for text in texts]


def encode_rows(
    rows: Sequence[dict[str, Any]],
    tokenizer: Any,
    config: DataConfig,
    report: DataReport | None = None,
    *,
    instruction: bool = True,
) -> tuple[list[Example], DataReport]:
    """Tokenise rows into ``Example``s, applying the length policies and counting what they did.

    ``instruction=False`` sends the problem text alone, in the tokenizer's template with no system prompt (the
    generated tasks' own format). Rows are encoded ``ENCODE_CHUNK`` at a time through the fast tokenizer's batch
    call (its Rust threads share the work), and a solution's ids are kept as an int32 array: at DeepMath-103K's
    scale, with R1 traces of thousands of tokens, tuples of Python ints would hold some 36 bytes a token.
    """
    report = report or DataReport()
    examples = []
    for first in range(0, len(rows), ENCODE_CHUNK):
        chunk = rows[first : first + ENCODE_CHUNK]
        texts = [prompt_text(row["problem"], config) if instruction else row["problem"] for row in chunk]
        prompts = render_prompts(tokenizer, texts, config if instruction else None)
        solutions = encode_texts(tokenizer, [row.get("solution") or "" for row in chunk])
        for row, prompt, solution in zip(chunk, prompts, solutions, strict=True):
            report.rows += 1
            if (prompt := checked_prompt(prompt, config, report)) is None:
                continue
            solution_ids = _solution(row, solution, tokenizer, config, report)
            text = row.get("solution") or None
            examples.append(Example(str(row["id"]), str(row["answer"]), tuple(prompt), solution_ids,
                                    str(row["problem"]), text, fields=row.get("fields")))  # fmt: skip
    report.kept = len(examples)
    return examples, report


ENCODE_CHUNK = 512


def checked_prompt(prompt: list[int], config: DataConfig, report: DataReport) -> list[int] | None:
    """The prompt under ``max_prompt_tokens`` per ``prompt_policy`` (None: skipped), counted in ``report`` with
    the longest seen and the limit, which its console line names."""
    report.prompt_longest, report.max_prompt_tokens = max(report.prompt_longest, len(prompt)), config.max_prompt_tokens
    if len(prompt) <= config.max_prompt_tokens:
        return prompt
    if config.prompt_policy == "skip":
        report.prompt_skipped += 1
        return None
    report.prompt_truncated += 1
    return prompt[-config.max_prompt_tokens :]  # keep the end: the template's assistant turn


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added: one batch call where the tokenizer is a fast one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # transformers clears a backend's own padding and truncation on each call; a batch call here would apply them.
    if backend is not None and backend.padding is None and backend.truncation is None:
        return [encoding.ids for encoding in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def render_prompts(tokenizer: Any, texts: Sequence[str], config: DataConfig | None = None) -> list[list[int]]:
    """``render_prompt`` of each text, encoded in one batch."""
    return encode_texts(tokenizer, render_texts(tokenizer, texts, config))


def _solution(
    row: dict[str, Any], ids: list[int], tokenizer: Any, config: DataConfig, report: DataReport
) -> np.ndarray | None:
    if not row.get("solution"):
        report.solution_missing += 1
        return None
    return fit_solution(ids, tokenizer.eos_token_id, config, report)


def fit_solution(ids: list[int], eos: int, config: DataConfig, report: DataReport) -> np.ndarray | None:
    """A solution's ids with EOS, under ``max_solution_tokens`` per ``solution_policy`` (None: skipped); counted."""
    report.solutions_encoded += 1
    if len(ids) + 1 <= config.max_solution_tokens:  # the whole solution and its EOS fit
        return np.asarray(ids + [eos], np.int32)
    if config.solution_policy == "skip":
        report.solution_skipped += 1
        return None
    report.solution_truncated += 1
    if config.eos_after_truncated:
        return np.asarray(ids[: config.max_solution_tokens - 1] + [eos], np.int32)
    return np.asarray(ids[: config.max_solution_tokens], np.int32)


def load_examples(
    spec: str, tokenizer: Any, config: DataConfig, *, seed: int = 0, max_rows: int | None = None
) -> tuple[list[Example], DataReport]:
    """Read, check and tokenise ``spec`` (its first ``max_rows`` records when given): gold answers are parsed once
    and rows whose gold does not parse are left out and listed, then the length policies apply. ``report.rows``
    counts every record read."""
    report = DataReport()
    rows = read_rows(spec, config, seed=seed, report=report, max_rows=max_rows)
    bad = rewards.parse_golds((i, str(r["answer"])) for i, r in enumerate(rows)).bad  # per row: ids may repeat
    examples, report = encode_rows(
        [r for i, r in enumerate(rows) if i not in bad], tokenizer, config, report, instruction=not is_generated(spec)
    )
    report.gold_unparseable = [str(rows[i]["id"]) for i in bad]
    report.rows = len(rows) + report.rows_invalid
    return examples, report
