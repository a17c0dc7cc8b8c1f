"""A length-aware reward: a correct answer earns more the shorter its completion, a wrong one nothing.

    score = correct * (1 - alpha * min(1, words / budget))

with ``correct`` the built-in verifier's 0/1 on the completion and the row's gold ``answer``, ``words`` the
completion's whitespace-separated words (a tokenizer-free length). At alpha 0.5 a correct answer of ``budget``
words or more scores 0.5, one of no words 1.0, so among correct answers the short ones are preferred, and a short
wrong answer is never paid. Used in place of the verifier's score, it keeps the verifier as the correctness signal:

    reward:
      functions:
        - {fn: examples/length_reward.py:concise_correct, name: concise}
"""

from __future__ import annotations

from lspo_jax.tasks.rewards import math_reward

ALPHA = 0.5
BUDGET = 200  # words


def concise_correct(completions: list[str], answer: list[str], **columns) -> list[float]:
    """One score a completion; ``answer`` holds the rows' gold answers, aligned with ``completions``."""
    scores = []
    for text, gold in zip(completions, answer, strict=True):
        correct = math_reward(text, gold)
        scores.append(correct * (1.0 - ALPHA * min(1.0, len(text.split()) / BUDGET)))
    return scores
