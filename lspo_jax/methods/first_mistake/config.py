"""First-mistake advantages' section of a run's config, ``first_mistake`` (composed into the run's config by
``job.config``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

from lspo_jax import options

# The judge's reference solution: the teacher's own verified one, or the dataset's.
Reference = Literal["teacher", "ground_truth"]


@dataclasses.dataclass(frozen=True)
class FirstMistakeConfig:
    """First-mistake advantages (see ``advantages``' docstring); ``enabled: false`` leaves GRPO advantages alone.

    ``judge_path``: a Hugging Face directory of the teacher; None judges with the policy itself (the run
    also takes ``toy:judge``, the demo task's scripted teacher).
    ``reference``: ``teacher`` (the teacher's verified solution) or ``ground_truth`` (the dataset's).
    ``lam``: the weight of ``|A_i|`` on a failed rollout's valid prefix. ``max_new_tokens``,
    ``teacher_temperature`` (0: greedy; 0.6, the method's own setting) and ``seed``: the teacher's sampling, in
    both stages. ``max_sentences``: sentences numbered per rollout. ``judge_correct``: also judge passing
    rollouts (for the agreement metric only).
    ``max_batch``: prompts per teacher call (``generate``, one sampler call); a stop waits for the current one.
    ``sentence_breaks``: characters that also end a sentence (``split_sentences``), for tasks whose steps are not
    written as sentences.
    """

    enabled: bool = False
    """Use first-mistake advantages; false leaves GRPO's advantages alone."""
    judge_path: str | None = None
    """The teacher's Hugging Face directory (null: the policy judges itself; `toy:judge` is the demo's scripted
    teacher)."""
    reference: Reference = "teacher"
    """The judge's reference solution: the `teacher`'s own verified one or the dataset's (`ground_truth`)."""
    lam: float = 0.0
    """The weight of `abs(A_i)` on a failed rollout's valid prefix."""
    max_new_tokens: int = 2048
    """The teacher's longest response, in tokens, in both stages."""
    teacher_temperature: float = 0.6
    """The teacher's sampling temperature (0: greedy; 0.6, the method's own)."""
    seed: int = 0
    """The seed of the teacher's sampling."""
    max_sentences: int = 256
    """Sentences numbered per rollout for the judge."""
    judge_correct: bool = False
    """Also judge passing rollouts, for the agreement metric only."""
    max_batch: int = 64
    """Prompts per teacher call (one sampler call); a stop during the step's judging waits for the current call only."""
    sentence_breaks: str = ""
    """Characters that also end a sentence, for tasks whose steps are not written as sentences."""
    # Keys of an earlier version that a run's own config.yaml may hold: read under their new names.
    RENAMED: ClassVar[dict[str, str]] = {"temperature": "teacher_temperature"}

    def __post_init__(self) -> None:
        options.check(self, "first_mistake")
        checks = {
            "judge_path": (self.judge_path is None or bool(self.judge_path.strip()), "must be a path or null"),
            "lam": (math.isfinite(self.lam) and self.lam >= 0, "must be a finite number >= 0"),
            "max_new_tokens": (self.max_new_tokens > 0, "must be positive"),
            "teacher_temperature": (
                math.isfinite(self.teacher_temperature) and self.teacher_temperature >= 0,
                "must be >= 0",
            ),
            "max_sentences": (self.max_sentences > 0, "must be positive"),
            "max_batch": (self.max_batch > 0, "must be positive"),
        }
        options.check_fields(self, checks)
