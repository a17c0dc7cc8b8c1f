"""Rollouts one update old (``rollout.max_staleness: 1``): the next step's rollouts sampled in a thread while this
step's update runs, from the base as it stood before that update.

The run's ``Prefetcher`` keeps the schedule: once a step's last stop check has passed it draws the next step's prompts,
with the key an on-policy run would use for them, and starts a ``Prefetch``; the next step takes its rows
(``Prefetch.rows``, in its ``sample`` phase: the wait for the thread) and goes on as any step does: it scores them,
finds the cliffs in them, fits the adapter on the base it updates and re-rolls with it. Their update is decoupled PPO:
``old_logp`` is the proximal policy, the base's log-probs recomputed at the step's ``logprob`` phase, and
``loss.tis_cap`` weighs each token by ``min(pi_proximal / pi_behaviour, tis_cap)`` with ``pi_behaviour`` the sampler's
own log-probs (``sampler_logp``) at the weights that sampled (``corrections.importance_weights``).

The thread samples from its own copy of the base (``Sampling.push``): the update donates the params it is given, so
the live ones die under a sampler that reads them. Colocated (``rollout.placement``), the copy is one more base on
the learner's devices while the update runs, and both share them. Split, the copy is the push of the base to the
sampler's own devices (device to device: ``jax.device_put`` onto the sampler mesh's layout), where the thread
samples while the learner's devices update; a step with nothing sampled ahead (the first, one after a scheduled
checkpoint) samples there too, on-policy, and waits for it. JAX releases the GIL while a program runs, so the two
overlap as far as the devices let them; the overlap is measured (``overlap_seconds``), not assumed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from lspo_jax.models import sharding
from lspo_jax.rl.learner import Learner
from lspo_jax.rl.packing import Rows
from lspo_jax.rl.phases import Phases, StepAbandoned
from lspo_jax.rl.prompts import Draw
from lspo_jax.rl.train import StepResult, step_keys, train_step
from lspo_jax.rollout.generator import Generator
from lspo_jax.train_config import TrainConfig

RECORD_KEYS = ("rollout/staleness", "rollout/overlap_s", "rollout/overlap_share", "rollout/prefetch_s",
               "rollout/push_s")  # fmt: skip


class Sampling:
    """Where rollouts sampled ahead are drawn: the learner's own devices and generator (``own`` None: colocated), or
    the mesh ``own`` of devices of their own (``rollout.placement: split``), with a generator of its own there."""

    def __init__(self, learner: Any, own: Mesh | None = None):
        self.split = own is not None
        self.generator, self.layout = learner.generator, None  # colocated: the base's own layout
        if self.split:
            self.generator = Generator(learner.policy, own, compact_every=learner.run.rollout.compact_every)
            self.layout = {"base": sharding.param_shardings(learner.policy.config, own)["base"]}

    def push(self, learner: Any) -> tuple[dict[str, Any], float]:
        """A copy of the learner's base that the next update cannot donate, in the sampler's compute dtype, on the
        sampling devices in their layout, and the seconds it took to land there. The sampler reads the weights in
        that dtype anyway (it casts an fp32 master copy once a call): cast before the copy, a bfloat16 sampler's
        push moves half the bytes and leaves no fp32 copy beside the one it decodes with; the tokens are the same."""
        start, dtype = time.perf_counter(), jnp.dtype(learner.policy.config.compute_dtype)
        cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x
        base = jax.tree.map(cast, learner.base_params())
        layout = self.layout or jax.tree.map(lambda x: x.sharding, base)
        copy = jax.block_until_ready(jax.device_put(base, layout, may_alias=False))
        return copy, time.perf_counter() - start


class Prefetch:
    """The rollouts of ``draw`` (its prompts x ``group_size``), sampled in a thread from a copy of the learner's
    base as it stands now, where ``sampling`` puts it. ``snapshot``: the prompt source's state before ``draw`` was
    taken, what a checkpoint written before the rows are used keeps (they are redrawn on resume)."""

    def __init__(self, learner: Any, draw: Draw, snapshot: dict[str, Any], sampling: Sampling):
        self.draw, self.snapshot, self.sampled_at = draw, snapshot, learner.state.step
        self.learner_done: float | None = None  # when the step it overlapped ended (``mark_learner_done``)
        self._generator, self._result, self._error = sampling.generator, None, None
        self._cancelled = threading.Event()  # set by ``drop``: the sampling ends at its next decode segment
        self._params, self.push_s = sampling.push(learner)
        sample_key = step_keys(draw)[0]
        prompts = [ex.prompt_ids for ex in draw.examples]
        self._thread = threading.Thread(target=self._sample, args=(learner, prompts, sample_key), daemon=True)
        self.start = time.perf_counter()
        self._thread.start()

    def _sample(self, learner: Any, prompts: list, key: jax.Array) -> None:
        try:
            self._result = learner.sample_from(self._params, self._generator, prompts, key, lora_scale=0.0,
                                               cancel=self._cancelled.is_set)  # fmt: skip
        except BaseException as err:  # re-raised on the main thread by ``rows``
            self._error = err
        finally:
            self.end, self._params = time.perf_counter(), None

    def mark_learner_done(self) -> None:
        """The step whose update the thread overlaps has ended."""
        self.learner_done = time.perf_counter()

    def wait(self) -> None:
        self._thread.join()

    def drop(self) -> None:
        """End the sampling at its next decode segment (a few tokens: ``rollout.compact_every``) and wait for the
        thread: the rows will not be used (a stop, a failed step). A stop waits for that, not for the whole phase."""
        self._cancelled.set()
        self.wait()

    def rows(self) -> Rows:
        """The sampled rows, once the thread is done; its error if it failed."""
        if self._cancelled.is_set():
            raise RuntimeError("rollouts sampled ahead were dropped and cut short; they cannot be used")
        self.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def record(self, step: int) -> dict[str, Any]:
        """``rollout/staleness`` (the updates between the weights that sampled and those the rows update, at the
        step ``step`` the learner is at), ``rollout/prefetch_s`` (the thread's sampling seconds), ``rollout/overlap_s``
        (of those, the seconds the step before was still running), ``rollout/overlap_share`` (their ratio) and
        ``rollout/push_s`` (the seconds the copy of the base took to land where it samples)."""
        self.wait()
        seconds = self.end - self.start
        overlap = overlap_seconds((self.start, self.end), (self.start, self.learner_done or self.start))
        return {"rollout/staleness": step - self.sampled_at, "rollout/overlap_s": overlap,
                "rollout/overlap_share": overlap / seconds if seconds > 0 else None,
                "rollout/prefetch_s": seconds, "rollout/push_s": self.push_s}  # fmt: skip


class Prefetcher:
    """A run's schedule of rollouts sampled ahead of the update (``rollout.max_staleness: 1``): which steps sample the
    next one's during their update (``samples_ahead``), from which copy of the base and on which devices
    (``sampling``, its split made once), and the staleness record of each step's rows. Each step's draw goes
    through it: the rows sampled ahead by the step before when there are some, else the prompt source's draw, which a
    split placement samples on the sampler's devices too. At ``max_staleness: 0`` every step draws and samples its
    own rows and records nothing of this.

    ``prompts``: the run's prompt source; ``own``: the sampler's mesh of a split placement (None: colocated)."""

    def __init__(self, learner: Learner, prompts: Any, own: Mesh | None = None):
        self.learner, self.prompts, self.run = learner, prompts, learner.run
        self.enabled = bool(self.run.rollout.max_staleness)
        self.sampling = Sampling(learner, own) if self.enabled else None
        self.ahead: Prefetch | None = None  # the next step's rollouts, sampling

    def step(self, phases: Phases, *, stopping: bool) -> tuple[Draw, StepResult, dict[str, Any]]:
        """One training step (``train.train_step``) of the draw it takes, and the draw, the step's result and its
        staleness record. A step abandoned by ``phases`` leaves the prompt source as it found it, so a resume from the
        next checkpoint draws the same prompts. ``stopping``: a stop was asked for, so no rows are sampled ahead."""
        learner, step = self.learner, self.learner.state.step
        ahead, self.ahead = self.ahead, None
        snapshot = self.prompts.state_dict() if ahead is None else ahead.snapshot
        start_next = self.sample_ahead if samples_ahead(self.run, step, stopping) else None
        try:
            draw = self.prompts.next_batch(learner, step_key(self.run, step), phases) if ahead is None else ahead.draw
            if ahead is None and self.sampling is not None and self.sampling.split:  # on-policy, on the sampler's
                phases.check("sample")  # devices, waited for; a stop asked already abandons the step before it
                ahead = Prefetch(learner, draw, snapshot, self.sampling)
            result = train_step(learner, draw, phases, sampled=ahead, start_next=start_next)
        except BaseException as err:
            if ahead is not None:  # dropped: its thread ends before anything else samples or the run closes
                ahead.drop()
            if isinstance(err, StepAbandoned):  # before the update, so before this step sampled ahead
                self.prompts.load_state_dict(snapshot)
            raise
        if self.ahead is not None:
            self.ahead.mark_learner_done()
        return draw, result, self.record(ahead, step)

    def sample_ahead(self) -> None:
        """Draw the next step's prompts, with the key an on-policy run would give them, and start sampling them from
        the base as it stands (``Prefetch``)."""
        key = step_key(self.run, self.learner.state.step + 1)
        snapshot = self.prompts.state_dict()
        draw = self.prompts.next_batch(self.learner, key, Phases())
        self.ahead = Prefetch(self.learner, draw, snapshot, self.sampling)

    def record(self, ahead: Prefetch | None, step: int) -> dict[str, Any]:
        """The step's ``rollout/staleness`` and overlap figures (``RECORD_KEYS``) for its rows sampled ahead
        (``ahead``, None: by the step itself); none at ``rollout.max_staleness: 0``, whose rows are all on-policy."""
        if not self.enabled:
            return {}
        return on_policy_record() if ahead is None else ahead.record(step)

    def source_state(self) -> dict[str, Any]:
        """The prompt source's state a checkpoint keeps. Rollouts sampled ahead are not kept: the state from before
        their draw is, so a resumed run draws those prompts again and samples them from the base it resumes."""
        return self.prompts.state_dict() if self.ahead is None else self.ahead.snapshot

    def wait(self) -> None:
        """Wait for the rollouts sampling ahead, if any: the generator samples for one caller at a time."""
        if self.ahead is not None:
            self.ahead.wait()

    def close(self) -> None:
        """Cut the rollouts still sampling ahead short at their next decode segment, and drop them."""
        if self.ahead is not None:
            self.ahead, ahead = None, self.ahead
            ahead.drop()


def step_key(run: TrainConfig, done: int) -> jax.Array:
    """The key of the step that follows ``done`` steps: one function of the seed and the step, whether the step
    samples its rollouts itself or the step before samples them ahead."""
    return jax.random.fold_in(jax.random.key(run.seed), done)


def samples_ahead(run: TrainConfig, done: int, stopping: bool) -> bool:
    """Whether the step that follows ``done`` steps samples the next one's rollouts during its update
    (``rollout.max_staleness: 1``): not for a step a checkpoint follows on schedule, so a resumed run samples what an
    uninterrupted one did, and not for the last step; nor once a stop was asked for (``stopping``): the stop's
    checkpoint would drop those rollouts, and closing would wait for their sampling."""
    after = done + 1
    return bool(run.rollout.max_staleness) and after < run.steps and after % run.checkpoint.every != 0 and not stopping


def on_policy_record() -> dict[str, Any]:
    """The staleness record of rows sampled by their own step (a run's first, or the first after a checkpoint)."""
    return {"rollout/staleness": 0, "rollout/overlap_s": 0.0, "rollout/overlap_share": None, "rollout/prefetch_s": None,
            "rollout/push_s": None}  # fmt: skip


def overlap_seconds(a: tuple[float, float], b: tuple[float, float]) -> float:
    """The seconds two intervals of ``time.perf_counter`` share."""
    return float(max(0.0, min(a[1], b[1]) - max(a[0], b[0])))
