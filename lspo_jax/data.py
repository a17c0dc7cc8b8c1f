"""Training data: rows in the shared schema, tokenised into prompts and SFT targets, drawn in a resumable order.

A row is ``{"id", "problem", "answer", "solution"}`` (the schema of ``../shared/data``); ``toy:addition``
is the demo's generated task. Bad rows never crash a run: a prompt over the token limit is skipped or
truncated per config, a solution over its limit likewise, and a row without a solution stays a training
prompt but is never a scaffold target. Every such case is counted in ``DataReport``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lspo_jax import toy
from lspo_jax.train_config import DataConfig


@dataclasses.dataclass(frozen=True)
class Example:
    """One training prompt: token ids of the prompt and of its worked solution (EOS appended), if any."""

    id: str
    answer: str
    prompt_ids: tuple[int, ...]
    solution_ids: tuple[int, ...] | None


@dataclasses.dataclass
class DataReport:
    """What loading did to the rows, for the run's log."""

    rows: int = 0
    kept: int = 0
    prompt_skipped: int = 0
    prompt_truncated: int = 0
    solution_missing: int = 0
    solution_skipped: int = 0
    solution_truncated: int = 0
    gold_unparseable: list[str] = dataclasses.field(default_factory=list)


def read_rows(spec: str, *, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of a JSONL file in the shared schema, or of a generated task (``toy:addition``)."""
    if spec == "toy:addition":
        return toy.addition_rows(2000, (2, 4), seed=seed, prefix="train")
    if spec == "toy:heldout":
        return toy.heldout_rows(seed=seed)
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"data.train: no such file {spec}")
    rows = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{spec}:{line_no}: not JSON: {err}") from err
            missing = [k for k in ("id", "problem", "answer") if k not in row]
            if missing:
                raise ValueError(f"{spec}:{line_no}: row lacks field(s) {missing}")
            rows.append(row)
    return rows


def render_prompt(tokenizer: Any, problem: str) -> list[int]:
    """Prompt token ids: the tokenizer's chat template when it has one, else BOS + the problem text."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": problem}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    ids = tokenizer.encode(problem, add_special_tokens=False)
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + list(ids)


def encode_rows(
    rows: Sequence[dict[str, Any]], tokenizer: Any, config: DataConfig, report: DataReport | None = None
) -> tuple[list[Example], DataReport]:
    """Tokenise rows into ``Example``s, applying the length policies and counting what they did."""
    report = report or DataReport()
    examples = []
    for row in rows:
        report.rows += 1
        prompt = render_prompt(tokenizer, row["problem"])
        if len(prompt) > config.max_prompt_tokens:
            if config.prompt_policy == "skip":
                report.prompt_skipped += 1
                continue
            report.prompt_truncated += 1
            prompt = prompt[-config.max_prompt_tokens :]  # keep the end: the template's assistant turn
        examples.append(
            Example(str(row["id"]), str(row["answer"]), tuple(prompt), _solution(row, tokenizer, config, report))
        )
    report.kept = len(examples)
    return examples, report


def _solution(row: dict[str, Any], tokenizer: Any, config: DataConfig, report: DataReport) -> tuple[int, ...] | None:
    text = row.get("solution")
    if not text:
        report.solution_missing += 1
        return None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) + 1 > config.max_solution_tokens:
        if config.solution_policy == "skip":
            report.solution_skipped += 1
            return None
        report.solution_truncated += 1
        ids = ids[: config.max_solution_tokens - 1]
    return tuple(ids) + (tokenizer.eos_token_id,)


class PromptOrder:
    """The order in which prompts are drawn: a seeded permutation per epoch, resumable from its state."""

    def __init__(self, size: int, *, seed: int, shuffle: bool = True):
        if size == 0:
            raise ValueError("no training prompts left after loading; see the data report")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _permutation(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.size)

    def take(self, count: int) -> list[int]:
        """The next ``count`` prompt indices, moving into the next epoch when one runs out."""
        out: list[int] = []
        while len(out) < count:
            perm = self._permutation()
            take = min(count - len(out), self.size - self.position)
            out.extend(int(i) for i in perm[self.position : self.position + take])
            self.position += take
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
