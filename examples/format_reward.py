"""A format reward: 1.0 when a completion ends on exactly one complete ``\\boxed{...}`` answer, else 0.

Weighed beside the built-in verifier it pays for the form of an answer, right or wrong. It never decides which
rollouts are successes: that stays the verifier's 0/1 (``reward.functions`` in docs/options.md).

    reward:
      functions:
        - {fn: math_verify, weight: 1.0}
        - {fn: examples/format_reward.py:boxed_once, weight: 0.1, name: format}
"""

from __future__ import annotations

import re

_BOXED_END = re.compile(r"\\boxed\{[^{}]+\}\s*$")


def boxed_once(completions: list[str], **columns) -> list[float]:
    """TRL's reward-function convention: the completions, and the rows' columns (``answer``, ``problem``, ...) as
    keyword lists aligned with them, which this reward does not read."""
    return [float(text.count("\\boxed") == 1 and bool(_BOXED_END.search(text))) for text in completions]
