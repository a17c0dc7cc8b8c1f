"""A stop asked for by SIGTERM (a scheduler's preemption) or Ctrl-C, as a flag the run reads at its own points.

A handler that raised instead (``KeyboardInterrupt``) could land anywhere Python happens to be, JAX's garbage
collector callback among them, where the exception is printed as "Exception ignored" and dropped: the run then
trained to the end. The handler here only sets a flag; start-up asks ``startup_point()`` between its parts, the
loop asks ``agreed()`` before each step and phase. Imports nothing heavy, so ``lspo-train`` sets it before JAX loads.
"""

from __future__ import annotations

import signal


class StartupStopped(Exception):
    """A stop was asked for before training began: nothing was trained, and nothing needs resuming."""


class StopFlag:
    """Set by SIGTERM/SIGINT while entered: the loop abandons its step at the next phase (or finishes it once its
    update has begun), writes a checkpoint and exits cleanly; start-up ends at its next point (``startup_point``)."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def reclaim(self) -> None:
        """Set this flag's handlers again, after a library replaced them: ``jax.distributed.initialize`` installs
        its own SIGTERM handler (its preemption notice), which would take a scheduler's stop from the run."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        """Whether any process of the job was asked to stop. Every process gets the same answer, so they all
        leave the loop at the same point: a scheduler's signals reach the hosts at slightly different times,
        and one host leaving a collective the others entered would hang them. Each call is a collective when
        there are several processes: call it at the same points on all of them."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        if jax.process_count() == 1:
            return self.requested
        flags = multihost_utils.process_allgather(np.asarray(self.requested, np.int32))
        return bool(np.any(flags))

    def startup_point(self, single_process: bool = True) -> None:
        """Raise ``StartupStopped`` if a stop was asked for. ``single_process``: the caller runs alone (a job of
        several processes must agree first, ``agreed``, or the others would wait at their next collective)."""
        if single_process and self.requested:
            raise StartupStopped("interrupted during start-up; nothing was trained")

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
