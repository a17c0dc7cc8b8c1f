"""Prompt sources: what the loop asks for each step's batch of prompts, and tells what the step found.

Every source has one interface:

    draw = source.next_batch(learner, key, phases)   # the step's prompts; maybe its rollouts already
    metrics = source.observe(draw, prompt_scores)    # after the step: the source's own update and metrics
    source.state_dict() / source.load_state_dict(s)  # JSON-able state: in checkpoints under source.meta_key,
                                                     # and put back when a step is abandoned

``ShuffledPrompts`` (here) is the default: a seeded permutation per epoch, ``group_size`` rollouts per prompt
sampled by the step itself. ``reweight.L2RRPrompts`` draws by learned weights, samples its draw rounds itself
and asks the step for the batch's target scores (``Draw.score_prompts``). The step never calls a source.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from lspo_jax import data


@dataclasses.dataclass
class Draw:
    """A step's prompts. ``key``: the step's own key (the source may have used another for its draws).

    ``rows`` and ``valid``: the step's rollouts when the source sampled and scored them itself, in
    ``group_size`` slots per prompt with ``valid`` marking the slots that hold one; None: the step samples.
    ``score_prompts``: the step returns the batch's target scores (``Learner.prompt_scores``) for ``observe``.
    ``record``: the source's own record of the draw, for its ``observe``.
    """

    examples: list[Any]
    key: jax.Array
    rows: dict[str, np.ndarray] | None = None
    valid: np.ndarray | None = None
    score_prompts: bool = False
    record: Any = None


class ShuffledPrompts:
    """``batch_size`` prompts a step in the order of ``data.PromptOrder`` (a seeded permutation per epoch)."""

    meta_key = "order"

    def __init__(self, examples: list[Any], batch_size: int, *, seed: int, shuffle: bool = True):
        self.examples, self.batch_size = examples, batch_size
        self.order = data.PromptOrder(len(examples), seed=seed, shuffle=shuffle)

    def next_batch(self, learner: Any, key: jax.Array, phases: Any) -> Draw:
        return Draw([self.examples[i] for i in self.order.take(self.batch_size)], key)

    def observe(self, draw: Draw, prompt_scores: np.ndarray | None) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return self.order.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.restore(state)
