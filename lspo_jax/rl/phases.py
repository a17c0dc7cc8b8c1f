"""A training step's phases, timed and with stop points: ``Phases`` times each stage of ``train.train_step`` under the
name its record reports (``time_<stage>``), and with a stop flag turns a stop asked for before the update into
``StepAbandoned``, raised where a phase starts or between the pieces of a long one."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable


class StepAbandoned(Exception):
    """A stop was requested before the step's update: nothing of the step reached the base or its optimizer."""


class Phases:
    """Wall-clock seconds per phase of a step (``time_sample``, ``time_reward``, ...).

    With ``stop`` (a ``StopFlag``, or anything with its ``agreed()``), entering a phase after a stop was
    requested raises ``StepAbandoned``: a preempted job checkpoints within one phase, not one whole step.
    """

    NAMES = ("sample", "reward", "sft", "reroll", "logprob", "judge", "update")

    def __init__(self, stop=None):
        # Every phase is reported, 0 when it did not run (a step without cliffs has no sft or reroll).
        self.seconds: dict[str, float] = {f"time_{name}": 0.0 for name in self.NAMES}
        self.stop = stop

    def check(self, name: str, *, during: bool = False) -> None:
        """``StepAbandoned`` if a stop was asked for (agreed by every process) before the ``name`` phase, or with
        ``during`` between two of its pieces."""
        if self.stop is not None and self.stop.agreed():
            raise StepAbandoned(f"stop requested {'during' if during else 'before'} the step's {name} phase")

    def within(self, name: str) -> Callable[[], None]:
        """The check a long piece of work before the update calls between its pieces (``check(name, during=True)``):
        each call is a collective on several processes, so the work must call it the same number of times on all."""
        return lambda: self.check(name, during=True)

    @contextlib.contextmanager
    def __call__(self, name: str, *, check_stop: bool = True):
        """Time the ``name`` phase; ``check_stop=False`` only times it (a phase entered right after a checked one:
        on several processes each check is a collective)."""
        if check_stop:
            self.check(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time_{name}"] += time.perf_counter() - start
