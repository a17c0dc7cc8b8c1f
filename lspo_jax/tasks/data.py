"""Training data: a source's rows (``sources``) tokenised into ``Example``s, prompts (``templates``) and SFT targets,
with what loading did counted in a ``DataReport`` (``data_report``); ``load_examples`` does it all in one call.

Bad rows never crash a run: a row lacking a required field, or with one of a type no grader reads (a list
answer), is skipped and listed, a prompt over the token limit is skipped or truncated per config, a solution over
its limit likewise, and a row without a solution stays a training prompt but is never a scaffold target. Every
such case is counted in ``DataReport``. Gold answers are parsed once here, and rows whose gold does not parse are
left out (they would be permanent cliffs that no rollout can pass).

A worked solution is the SFT target as it is, followed by EOS (the prompt already opens the thought:
``templates``). A trace cut to ``max_solution_tokens`` gets no EOS (unless ``data.eos_after_truncated``): the cut
is mid-thought, and an EOS there would teach the adapter to stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lspo_jax.tasks import rewards
from lspo_jax.tasks.data_report import DataReport
from lspo_jax.tasks.sources import is_generated, read_rows
from lspo_jax.tasks.templates import encode_texts, prompt_text, render_prompts
from lspo_jax.train_config import DataConfig


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
