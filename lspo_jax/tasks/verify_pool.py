"""Batch scoring with math-verify in long-lived, killable worker processes.

math-verify can run for minutes on one pathological answer (sympy expanding ``9^{9^{9^{9}}}`` or
``(10^{10})!`` while comparing it with a number), and its own timeout relies on ``signal.alarm``, which
works only on the main thread. The one bound that always holds is a process that can be killed: every
item gets a deadline, and a worker that overruns it is killed and replaced while the other workers carry
on, so a bad answer costs at most the timeout, never the step.

Each worker imports math-verify and warms it up once, then serves one item at a time over its own pipe.
Items go only to workers that have reported ready, so start-up time never counts against an item.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait

import numpy as np

from lspo_jax.tasks.reward_functions import call_function
from lspo_jax.tasks.rewards import _math_verify, score_response

__all__ = ["VerifierPool", "VerifierStats"]

_READY = "ready"
_WARMUP = ("\\boxed{\\frac{1}{2}}", "0.5")  # loads the LaTeX grammar and sympy before the first timed item
_MAX_START_FAILURES = 3  # consecutive workers dying before ready: the environment is broken, stop


@dataclass
class VerifierStats:
    """Counters. ``scored`` counts every item (timeouts and errors included, which score 0)."""

    scored: int = 0
    timeouts: int = 0
    errors: int = 0
    restarts: int = 0
    error_types: list[str] = field(default_factory=list, repr=False)  # what the errors raised, for a message

    def add(self, other: VerifierStats) -> None:
        for key, value in self.as_dict().items():
            setattr(self, key, value + getattr(other, key))

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "error_types"}


def _score_item(function: str | None, response: str, arg, require_think_close: bool) -> float:
    """One item's score: math-verify against the gold ``arg`` (``function`` None), or the reward function at the path
    ``function`` on the row's fields ``arg`` (``reward_functions.call_function``)."""
    if function is None:
        return score_response(response, arg, require_think_close=require_think_close)
    return call_function(function, response, arg)


def _worker_main(conn) -> None:
    """Worker loop: report ready, then answer ``(index, score, error)`` for each ``(index, function, response, arg,
    require_think_close)`` task (``_score_item``) until ``None`` or a closed pipe."""
    # Ctrl-C reaches the whole process group; the parent decides what happens to workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    score_response(*_WARMUP)
    conn.send((_READY,))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, item = task[0], task[1:]
        try:
            result = (index, _score_item(*item), None)
        except BaseException as exc:  # math-verify's TimeoutException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            # Only the type name: str() of some sympy objects can itself take unbounded time.
            result = (index, 0.0, type(exc).__name__)
        try:
            conn.send(result)
        except OSError:  # the parent is gone (killed mid-batch): nobody is left to answer, nor to read a traceback
            return


class _Worker:
    """One worker process, its pipe, and the item it is working on (if any)."""

    def __init__(self, ctx) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child_conn,), daemon=True, name="lspo-verifier")
        self.process.start()
        child_conn.close()  # the child holds its end; closing ours lets EOF signal the child's death
        self.started = time.monotonic()
        self.ready = False
        self.task: int | None = None
        self.deadline = math.inf

    @property
    def idle(self) -> bool:
        return self.ready and self.task is None

    def submit(self, index: int, item: tuple, timeout: float) -> None:
        self.conn.send((index, *item))
        self.task = index
        self.deadline = time.monotonic() + timeout

    def finish(self) -> None:
        self.task = None
        self.deadline = math.inf

    def kill(self) -> None:
        """SIGTERM, then SIGKILL if it is still alive a second later; a stuck sympy call ignores neither."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)
        self.conn.close()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask an idle worker to exit; kill it if it does not."""
        try:
            if self.ready and self.task is None:
                self.conn.send(None)
                self.process.join(timeout)
        except (OSError, ValueError):
            pass
        self.kill()


class VerifierPool:
    """Score batches of responses against gold answers with math-verify, one killable process per worker.

    ``score(responses, golds)`` returns float32 accuracy (1.0 / 0.0). An item that runs past ``timeout``
    seconds scores 0 and counts as a timeout; its worker is killed and a replacement started. An exception
    in a worker (or a worker crash) scores 0 and counts as an error. Counters for the last batch are in
    ``last_stats`` and cumulative ones in ``stats``.

    ``workers=0`` scores in this process, without any timeout: for debugging only. With workers, the
    script that creates the pool needs the ``if __name__ == "__main__":`` guard, as for any spawned process.

    Args:
        workers: number of processes; defaults to ``min(cpu_count, 4)``.
        timeout: per-item wall-clock limit in seconds.
        require_think_close: grade only text after the last ``</think>`` (0 without one); ``score`` can
            override it per call.
        start_method: ``"spawn"`` (default) or ``"forkserver"``; never fork a process that runs JAX.
        start_timeout: seconds a new worker may take to import math-verify and report ready.
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout: float = 5.0,
        *,
        require_think_close: bool = False,
        start_method: str = "spawn",
        start_timeout: float = 120.0,
    ) -> None:
        if workers is None:
            workers = min(os.cpu_count() or 1, 4)
        if workers < 0 or timeout <= 0:
            raise ValueError(f"need workers >= 0 and timeout > 0, got workers={workers}, timeout={timeout}")
        _math_verify()  # a missing math-verify is an error here, not a worker dying or a score of 0
        self.num_workers = workers
        self.timeout = float(timeout)
        self.require_think_close = require_think_close
        self.start_timeout = float(start_timeout)
        self.stats = VerifierStats()
        self.last_stats = VerifierStats()
        self._ctx = mp.get_context(start_method)
        self._start_failures = 0
        self._workers = [_Worker(self._ctx) for _ in range(workers)]
        self._closed = False

    # -------------------------------------------------------------------------------------- public API
    def score(
        self, responses: Sequence[str], golds: Sequence[str], *, require_think_close: bool | None = None
    ) -> np.ndarray:
        """Accuracy per item, float32 of shape ``[len(responses)]``; golds are strings, one per response."""
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        think = self.require_think_close if require_think_close is None else require_think_close
        return self._score([(None, r, g, think) for r, g in zip(responses, golds, strict=True)])[0]

    def score_function(
        self, function: str, responses: Sequence[str], fields: Sequence[dict]
    ) -> tuple[np.ndarray, VerifierStats]:
        """The reward function at the path ``function`` (``options.load_function``) on each response and its row's
        ``fields``, one call an item with the pool's timeout: float32 ``[len(responses)]`` (a failed item scores 0)
        and the batch's counters, whose ``error_types`` name what the failed calls raised."""
        if len(responses) != len(fields):
            raise ValueError(f"{len(responses)} responses but {len(fields)} rows of fields")
        return self._score([(function, r, f, False) for r, f in zip(responses, fields, strict=True)])

    def _score(self, items: list[tuple]) -> tuple[np.ndarray, VerifierStats]:
        """Score ``(function, response, arg, require_think_close)`` items (``_score_item``)."""
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        batch = VerifierStats()
        accuracy = np.zeros(len(items), np.float32)
        try:
            if self.num_workers == 0:
                self._score_in_process(items, accuracy, batch)
            else:
                self._score_in_workers(items, accuracy, batch)
        except BaseException:
            # Results still in flight would be read as answers to the next batch: drop those workers.
            self._replace_busy_workers()
            raise
        finally:
            self.last_stats = batch
            self.stats.add(batch)
        return accuracy, batch

    def wait_ready(self) -> None:
        """Block until every worker has imported math-verify (e.g. before the first timed step)."""
        idle = VerifierStats()
        try:
            while any(not w.ready for w in self._workers):
                self._collect(np.zeros(0, np.float32), idle)
                self._check_start_timeouts()
        finally:
            self.stats.add(idle)

    def close(self) -> None:
        """Stop every worker; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------- internals
    @staticmethod
    def _score_in_process(items, accuracy, batch) -> None:
        for i, item in enumerate(items):
            try:
                accuracy[i] = _score_item(*item)
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                batch.errors += 1
                batch.error_types.append(type(exc).__name__)
            batch.scored += 1

    def _score_in_workers(self, items, accuracy, batch) -> None:
        pending = deque(range(len(items)))
        remaining = len(items)
        while remaining:
            for worker in list(self._workers):
                if pending and worker.idle:
                    i = pending[0]
                    try:
                        worker.submit(i, items[i], self.timeout)
                    except OSError:  # it died while idle: the item was never sent, so it waits for another
                        self._replace(worker)
                        batch.restarts += 1
                        continue
                    pending.popleft()
            remaining -= self._collect(accuracy, batch)
            remaining -= self._expire(batch)
            self._check_start_timeouts()

    def _collect(self, accuracy: np.ndarray, batch: VerifierStats) -> int:
        """Wait for messages until the nearest deadline; return the number of items finished."""
        now = time.monotonic()
        nearest = min((w.deadline for w in self._workers), default=math.inf)
        # Wake up at least every second to notice workers that never become ready.
        wait_s = max(0.0, min(nearest - now, 1.0))
        by_conn = {w.conn: w for w in self._workers}
        finished = 0
        for conn in wait(list(by_conn), timeout=wait_s):
            worker = by_conn[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                finished += self._on_death(worker, batch)
                continue
            if message[0] == _READY:
                worker.ready = True
                self._start_failures = 0
                continue
            index, value, error = message
            if index != worker.task:  # cannot happen with one task in flight per worker; fail loudly
                raise RuntimeError(f"worker answered item {index} while working on {worker.task}")
            accuracy[index] = value
            batch.scored += 1
            if error is not None:
                batch.errors += 1
                batch.error_types.append(error)
            worker.finish()
            finished += 1
        return finished

    def _expire(self, batch: VerifierStats) -> int:
        """Kill and replace workers past their deadline; their items score 0 as timeouts."""
        now = time.monotonic()
        expired = [w for w in self._workers if w.task is not None and now >= w.deadline]
        for worker in expired:
            self._replace(worker)
            batch.scored += 1
            batch.timeouts += 1
            batch.restarts += 1
        return len(expired)

    def _on_death(self, worker: _Worker, batch: VerifierStats) -> int:
        """A worker exited on its own: its item (if any) is an error; a worker dying before ready counts
        towards the start-failure limit."""
        had_task = worker.task is not None
        if not worker.ready:
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                raise RuntimeError(f"{self._start_failures} verifier workers died during start-up")
        self._replace(worker)
        batch.restarts += 1
        if had_task:
            batch.scored += 1
            batch.errors += 1
        return int(had_task)

    def _check_start_timeouts(self) -> None:
        now = time.monotonic()
        for worker in self._workers:
            if not worker.ready and now - worker.started > self.start_timeout:
                raise RuntimeError(f"a verifier worker did not start within {self.start_timeout:.0f} s")

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx)

    def _replace_busy_workers(self) -> None:
        for worker in list(self._workers):
            if worker.task is not None:
                self._replace(worker)
