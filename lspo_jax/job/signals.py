"""A stop asked for by SIGTERM (a scheduler's preemption) or Ctrl-C, as a flag the run reads at its own points.

A handler that raised instead (``KeyboardInterrupt``) could land anywhere Python happens to be, JAX's garbage
collector callback among them, where the exception is printed as "Exception ignored" and dropped: the run then
trained to the end. The handler here only sets a flag; start-up asks ``startup_point()`` between its parts, the
loop asks ``agreed()`` before each step and phase. Imports nothing heavy, so ``lspo-train`` sets it before JAX loads.

A flag made with ``prog`` says at once, in one line, that it is stopping and after what (``expect``). Python runs a
signal's handler in the main thread between two bytecodes, so while that thread is inside native code (XLA compiling
a program for 20 s, a long decode) the handler waits; a ``signal.set_wakeup_fd`` byte is written by the C-level
handler as the signal lands, so a thread of the flag's own that reads it sets the flag and speaks then.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading

SIGNAL_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


class StartupStopped(Exception):
    """A stop was asked for before training began: nothing was trained, and nothing needs resuming."""


class StopFlag:
    """Set by SIGTERM/SIGINT while entered: the loop abandons its step at the next phase (or finishes it once its
    update has begun), writes a checkpoint and exits cleanly; start-up ends at its next point (``startup_point``).

    ``prog``: the command whose line announces a stop (``prog: SIGTERM received, stopping ...``), once, as the signal
    lands; None: silent (a flag that only holds stops off, around an export's renames)."""

    def __init__(self, prog: str | None = None):
        self.requested = False
        self.prog = prog
        self.plan = "at start-up's next point; nothing is trained"  # what a stop does now, after "stopping "
        self._previous = {}
        self._announced = threading.Lock()  # taken once, by whichever of the handler and the watcher speaks first
        self._wakeup: tuple[socket.socket, socket.socket, int, threading.Thread] | None = None

    def __enter__(self):
        for sig in SIGNAL_NAMES:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.prog is not None:
            self._watch()
        return self

    def expect(self, plan: str) -> None:
        """What a stop asked for from now on does, as the announcement says it after "stopping " (e.g. "after
        validation's current batch; its records are not written")."""
        self.plan = plan

    def reclaim(self) -> None:
        """Set this flag's handlers again, after a library replaced them: ``jax.distributed.initialize`` installs
        its own SIGTERM handler (its preemption notice), which would take a scheduler's stop from the run."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self._stop(signum)

    def _stop(self, signum: int) -> None:
        self.requested = True
        if self.prog is not None and self._announced.acquire(blocking=False):
            print(f"{self.prog}: {SIGNAL_NAMES.get(signum, signum)} received, stopping {self.plan}", file=sys.stderr,
                  flush=True)  # fmt: skip

    def _watch(self) -> None:
        """Read the wakeup bytes in a thread of their own (see the module docstring). Only the main thread may set
        the wakeup descriptor; elsewhere the handler alone speaks, when it runs."""
        if threading.current_thread() is not threading.main_thread():
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the C handler must never block on a full buffer
        try:
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            reader.close()
            writer.close()
            return

        def watch() -> None:
            while True:
                try:
                    got = reader.recv(64)
                except OSError:
                    return
                if not got:  # the writer closed: the flag was left
                    return
                for signum in got:
                    if signum in SIGNAL_NAMES:
                        self._stop(signum)

        thread = threading.Thread(target=watch, name="stop-flag-watcher", daemon=True)
        thread.start()
        self._wakeup = (reader, writer, previous, thread)

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
        if self._wakeup is not None:
            reader, writer, previous, thread = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(previous)
            writer.close()  # the watcher reads the end of the stream and returns
            thread.join(timeout=1.0)
            reader.close()
