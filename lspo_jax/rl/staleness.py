"""Rollouts one update old (``rollout.max_staleness: 1``): the next step's rollouts sampled in a thread while this
step's update runs, from the base as it stood before that update.

The run draws the next step's prompts, with the key an on-policy run would use for them, once the step's last stop
check has passed, and starts a ``Prefetch``; the next step takes its rows (``Prefetch.rows``, in its ``sample``
phase: the wait for the thread) and goes on as any step does: it scores them, finds the cliffs in them, fits the
adapter on the base it updates and re-rolls with it. Their update is decoupled PPO: ``old_logp`` is the proximal
policy, the base's log-probs recomputed at the step's ``logprob`` phase, and ``loss.tis_cap`` weighs each token by
``min(pi_proximal / pi_behaviour, tis_cap)`` with ``pi_behaviour`` the sampler's own log-probs (``sampler_logp``) at
the weights that sampled (``corrections.importance_weights``).

The thread samples from its own copy of the base: the update donates the params it is given, so the live ones die
under a sampler that reads them. That is one more copy of the base on the devices while the update runs. JAX
releases the GIL while a program runs, so the two overlap as far as the devices let them; the overlap is measured
(``overlap_seconds``), not assumed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax

from lspo_jax.rl.packing import Rows
from lspo_jax.rl.prompts import Draw

RECORD_KEYS = ("rollout/staleness", "rollout/overlap_s", "rollout/overlap_share", "rollout/prefetch_s")


def base_snapshot(learner: Any) -> dict[str, Any]:
    """A copy of the learner's base on the devices, in its layout, that the next update cannot donate."""
    base = learner.base_params()
    return jax.device_put(base, jax.tree.map(lambda x: x.sharding, base), may_alias=False)


class Prefetch:
    """The rollouts of ``draw`` (its prompts x ``group_size``), sampled in a thread from a copy of the learner's
    base as it stands now. ``snapshot``: the prompt source's state before ``draw`` was taken, what a checkpoint
    written before the rows are used keeps (they are redrawn on resume)."""

    def __init__(self, learner: Any, draw: Draw, snapshot: dict[str, Any]):
        self.draw, self.snapshot, self.sampled_at = draw, snapshot, learner.state.step
        self.learner_done: float | None = None  # when the step it overlapped ended (``mark_learner_done``)
        self._params, self._result, self._error = base_snapshot(learner), None, None
        sample_key = jax.random.split(draw.key)[0]  # the key train_step would sample these prompts with
        prompts = [ex.prompt_ids for ex in draw.examples]
        self._thread = threading.Thread(target=self._sample, args=(learner, prompts, sample_key), daemon=True)
        self.start = time.perf_counter()
        self._thread.start()

    def _sample(self, learner: Any, prompts: list, key: jax.Array) -> None:
        try:
            self._result = learner.sample(prompts, key, lora_scale=0.0, params=self._params)
        except BaseException as err:  # re-raised on the main thread by ``rows``
            self._error = err
        finally:
            self.end, self._params = time.perf_counter(), None

    def mark_learner_done(self) -> None:
        """The step whose update the thread overlaps has ended."""
        self.learner_done = time.perf_counter()

    def wait(self) -> None:
        self._thread.join()

    def rows(self) -> Rows:
        """The sampled rows, once the thread is done; its error if it failed."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def record(self, step: int) -> dict[str, Any]:
        """``rollout/staleness`` (the updates between the weights that sampled and those the rows update, at the
        step ``step`` the learner is at), ``rollout/prefetch_s`` (the thread's sampling seconds), ``rollout/overlap_s``
        (of those, the seconds the step before was still running) and ``rollout/overlap_share`` (their ratio)."""
        self.wait()
        seconds = self.end - self.start
        overlap = overlap_seconds((self.start, self.end), (self.start, self.learner_done or self.start))
        return {"rollout/staleness": step - self.sampled_at, "rollout/overlap_s": overlap,
                "rollout/overlap_share": overlap / seconds if seconds > 0 else None,
                "rollout/prefetch_s": seconds}  # fmt: skip


def on_policy_record() -> dict[str, Any]:
    """The staleness record of rows sampled by their own step (a run's first, or the first after a checkpoint)."""
    return {"rollout/staleness": 0, "rollout/overlap_s": 0.0, "rollout/overlap_share": None, "rollout/prefetch_s": None}


def overlap_seconds(a: tuple[float, float], b: tuple[float, float]) -> float:
    """The seconds two intervals of ``time.perf_counter`` share."""
    return float(max(0.0, min(a[1], b[1]) - max(a[0], b[0])))
