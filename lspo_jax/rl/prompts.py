"""Prompt sources: what the loop asks for each step's batch of prompts, and tells what the step found.

Every source has one interface:

    draw = source.next_batch(learner, key, phases)   # the step's prompts; maybe its rollouts already
    metrics = source.observe(draw, observation)      # after the step: the source's own update and metrics
    source.state_dict() / source.load_state_dict(s)  # JSON-able state: in checkpoints under source.meta_key,
                                                     # and put back when a step is abandoned

``ShuffledPrompts`` (here) is the default: a seeded permutation per epoch, ``group_size`` rollouts per prompt
sampled by the step itself. ``rounds.DynamicSamplingPrompts`` samples its draw rounds itself. A source that
learns from the update puts a hook around it (``Draw.update_hook``, an ``UpdateHook``); what the hook returns
after the update is the ``observation`` its ``observe`` gets. The step never calls a source.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

from lspo_jax.tasks import data_report


class UpdateHook(Protocol):
    """What a prompt source puts around a step's update of the base, e.g. scores of the batch's prompts taken at
    the base before the update (which donates it) or after it. ``batch``: the update's rows and advantages.

    ``before`` runs before the step's last stop check, so a stop asked for during it abandons the step. A hook whose
    ``before`` comes in pieces sets ``checks_stop = True`` and gets ``check=``, a function to call between them that
    raises ``phases.StepAbandoned`` once a stop is asked for; one without the attribute is called as before."""

    def before(self, learner: Any, batch: dict[str, np.ndarray]) -> None:
        """Runs before the update, at the base that sampled the rows."""

    def after(self, learner: Any, batch: dict[str, np.ndarray]) -> tuple[Any, dict[str, Any]]:
        """Runs just after the update; returns the source's observation of the step and the step record's
        additions."""


@dataclasses.dataclass
class Draw:
    """A step's prompts. ``key``: the step's own key (the source may have used another for its draws).

    ``rows`` and ``valid``: the step's rollouts when the source sampled and scored them itself, in
    ``group_size`` slots per prompt with ``valid`` marking the slots that hold one; None: the step samples.
    ``update_hook``: what the step runs around its update of the base (``UpdateHook``); None: nothing.
    ``record``: the source's own record of the draw, for its ``observe``.
    """

    examples: list[Any]
    key: jax.Array
    rows: dict[str, np.ndarray] | None = None
    valid: np.ndarray | None = None
    update_hook: UpdateHook | None = None
    record: Any = None


class PromptOrder:
    """The order in which prompts are drawn: a seeded permutation per epoch, resumable from its state."""

    def __init__(self, size: int, *, seed: int, shuffle: bool = True):
        if size == 0:
            raise data_report.DataError("no training prompts left after loading; see the data report")
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


class ShuffledPrompts:
    """``batch_size`` prompts a step in the order of ``PromptOrder`` (a seeded permutation per epoch)."""

    meta_key = "order"

    def __init__(self, examples: list[Any], batch_size: int, *, seed: int, shuffle: bool = True):
        self.examples, self.batch_size = examples, batch_size
        self.order = PromptOrder(len(examples), seed=seed, shuffle=shuffle)

    def next_batch(self, learner: Any, key: jax.Array, phases: Any) -> Draw:
        return Draw([self.examples[i] for i in self.order.take(self.batch_size)], key)

    def observe(self, draw: Draw, observation: Any) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return self.order.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.restore(state)
