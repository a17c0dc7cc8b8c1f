"""The run's reward: the built-in verifier and the user's reward functions, weighed into the shaped reward.

A reward function follows TRL's convention, ``fn(completions, **columns) -> list[float]``: ``completions`` the
response texts, and one list per row field aligned with them (``answer``, ``problem``, ``solution``, ``id`` and the
data file's other columns). ``reward.functions`` names each by an importable path (``package.module:function`` or
``file.py:function``, ``options.load_function``); the verifier's worker pool imports it in each worker and calls it
one completion at a time (``VerifierPool.score_function``), so a call that raises or hangs costs that completion
alone: it scores 0, is counted, and the run goes on.

Two signals come out of scoring, kept apart on purpose (``Scored``):

    correct   0/1 per rollout: the built-in verifier's, or the function marked ``correctness`` (score >= 0.5).
              Cliffs, the scaffold's verified re-rolls, dynamic sampling and the judge's failed rows read this.
    reward    sum_i weight_i * f_i: what the advantages are computed from (the overlong penalty is added after).

A peer's recipe that filtered groups on a shaped score (a format bonus makes an all-wrong group's rewards unequal)
kept groups with nothing to learn and collapsed; the shaped sum never decides what counts as a success here.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lspo_jax.options import load_function

BUILTIN = "math_verify"  # ``step_config.BUILTIN_REWARD``: the built-in verifier's name in ``reward.functions``
ROW_FIELDS = ("answer", "problem", "solution", "id")


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """One weighed term of the reward: ``fn`` a path (``options.load_function``) or ``math_verify``."""

    name: str
    fn: str
    weight: float = 1.0
    correctness: bool = False

    @classmethod
    def of(cls, entry: Any) -> RewardFunction:
        """From a ``step_config.RewardFunctionConfig`` (or anything with its fields)."""
        return cls(entry.name, entry.fn, entry.weight, entry.correctness)


class Scored:
    """A batch's scores: ``correct`` ``[N]`` 0/1, ``reward`` ``[N]`` the weighed sum (before the overlong penalty),
    and per function its scores and failures (``record()``: ``reward/<name>`` means, ``reward/<name>_failed``)."""

    def __init__(self, correct: np.ndarray, reward: np.ndarray, scores: dict[str, np.ndarray], failed: dict[str, int]):
        self.correct, self.reward, self.scores, self.failed = correct, reward, scores, failed

    def record(self, rows: np.ndarray | None = None) -> dict[str, float | int]:
        """Each function's mean score over ``rows`` (a bool mask; None: all) and its failures in the batch."""
        keep = slice(None) if rows is None else rows
        means = {f"reward/{name}": float(np.mean(s[keep])) if len(s[keep]) else 0.0 for name, s in self.scores.items()}
        return {**means, **{f"reward/{name}_failed": count for name, count in self.failed.items()}}


def row_fields(example: Any) -> dict[str, Any]:
    """The fields a reward function receives of one row: its gold ``answer``, ``problem``, ``solution`` and ``id``, and
    the data file's other columns (``Example.fields``); a plain gold string gives ``answer`` alone."""
    if isinstance(example, str):
        return {"answer": example}
    fields = dict(getattr(example, "fields", None) or {})
    fields.update(answer=example.answer, problem=getattr(example, "problem", None),
                  solution=getattr(example, "solution", None), id=getattr(example, "id", None))  # fmt: skip
    return fields


def call_function(path: str, completion: str, fields: Mapping[str, Any]) -> float:
    """``fn([completion], **{k: [v]})[0]`` as a float: the unit of work of the pool's workers. None is 0 (TRL's "does
    not apply"); anything that is not one finite number raises, and the caller counts it as a failure."""
    value = load_function(path)([completion], **{key: [v] for key, v in fields.items()})
    if isinstance(value, Sequence | np.ndarray) and not isinstance(value, str):
        if len(value) != 1:
            raise ValueError(f"returned {len(value)} scores for 1 completion")
        value = value[0]
    if value is None:
        return 0.0
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return value


class Rewards:
    """The run's reward functions over its verifier (``VerifierPool``, or any object with ``score(responses,
    golds)``; ``score_function`` where it has one, else the functions run in this process).

    ``functions`` empty is the built-in verifier alone, weight 1 (the shaped reward is the accuracy, as in DAPO).
    ``say``: where a function's first failure is said (once per function; every failure is counted in the records).
    """

    def __init__(
        self, verifier: Any, functions: Sequence[RewardFunction] = (), say: Callable[[str], None] | None = None
    ):
        self.verifier = verifier
        self.functions = tuple(functions) or (RewardFunction(BUILTIN, BUILTIN),)
        judges = [f for f in self.functions if f.correctness]
        self.judge = judges[0] if judges else None
        self.say = say or (lambda line: print(f"lspo_jax: {line}", file=sys.stderr, flush=True))
        self._said: set[str] = set()

    @classmethod
    def of(cls, verifier: Any, reward_config: Any) -> Rewards:
        """From a run's ``reward`` section."""
        return cls(verifier, [RewardFunction.of(entry) for entry in reward_config.functions])

    def score(self, texts: Sequence[str], examples: Sequence[Any]) -> Scored:
        """Score ``texts``, one example (or gold string) a text: every function, then the correctness signal."""
        if len(texts) != len(examples):
            raise ValueError(f"{len(texts)} texts but {len(examples)} examples")
        scores, failed = {}, {}
        verified = None
        fields = [row_fields(ex) for ex in examples]  # once a batch, whatever the number of functions
        for function in self.functions:
            if function.fn == BUILTIN:
                verified = scores[function.name] = self._verify(texts, fields)
                failed[function.name] = self._failures()
            else:
                scores[function.name], failed[function.name] = self._call(function, texts, fields)
        if self.judge is not None:
            correct = (scores[self.judge.name] >= 0.5).astype(np.float32)
        else:
            correct = verified if verified is not None else self._verify(texts, fields)
        reward = sum((np.float32(f.weight) * scores[f.name] for f in self.functions), np.zeros(len(texts), np.float32))
        return Scored(correct.astype(np.float32), reward.astype(np.float32), scores, failed)

    def _verify(self, texts: Sequence[str], fields: Sequence[dict]) -> np.ndarray:
        golds = [str(row["answer"]) for row in fields]
        return np.asarray(self.verifier.score(list(texts), golds), np.float32)

    def _failures(self) -> int:
        stats = getattr(self.verifier, "last_stats", None)
        return 0 if stats is None else int(stats.timeouts + stats.errors)

    def _call(self, function: RewardFunction, texts, fields: Sequence[dict]) -> tuple[np.ndarray, int]:
        if hasattr(self.verifier, "score_function"):
            values, stats = self.verifier.score_function(function.fn, list(texts), fields)
            failures, kinds = stats.timeouts + stats.errors, stats.error_types
            if stats.timeouts:
                kinds = [*kinds, f"over the {self.verifier.timeout:g} s timeout"]
        else:
            values, failures, kinds = np.zeros(len(texts), np.float32), 0, []
            for i, (text, row) in enumerate(zip(texts, fields, strict=True)):
                try:
                    values[i] = call_function(function.fn, text, row)
                except Exception as err:
                    failures, kinds = failures + 1, [*kinds, type(err).__name__]
        if failures and function.name not in self._said:
            self._said.add(function.name)
            self.say(f"reward function {function.name} ({function.fn}) failed on {failures} of {len(texts)} "
                     f"completions ({', '.join(sorted(set(kinds)))}): each scores 0 and the run goes on; every "
                     f"failure is counted in reward/{function.name}_failed")  # fmt: skip
        return np.asarray(values, np.float32), int(failures)
