"""L2RR as a prompt source (``l2rr.enabled``): learned draws, and the target's scores around the update.

A step with ``l2rr.enabled``:

    rounds   draw the shortfall of prompts from w, allocate n_i in [g_min, K] rollouts each, sample them
             (one sampler call per round, each prompt repeated n_i times), verify, and keep the prompts
             whose group has a learning signal, until B are kept or ``max_draw_rounds`` rounds are done
             (``rl.rounds``, as dynamic sampling draws its rounds)
    batch    the kept prompts in draw order, then (if short) drawn-but-degenerate ones up to B, so every
             step has the same [B * K, T] shape; a group of n_i rollouts fills n_i of its K slots (``valid``)
    score    around the update (the draw's hook, ``TargetScores``): <g_tgt, g_i> of every prompt of the batch,
             one jvp (``target.TargetScorer``), before the update or with ``lookahead`` after it
    observe  every drawn prompt's zero variance and score update w, the zero streaks and the rollouts spent

With the scaffold on, a cliff whose prompt has a worked solution is kept: the scaffold can still rescue it,
while its zero streak (measured on the base rollouts, before any splice) still lowers its weight.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax.methods.l2rr.draws import L2RRSampler
from lspo_jax.methods.l2rr.target import TargetScorer, load_target
from lspo_jax.rl.prompts import Draw
from lspo_jax.rl.rounds import DrawResult, assemble_batch, collect_batch, sample_round
from lspo_jax.tasks import data_report
from lspo_jax.train_config import TrainConfig


@dataclasses.dataclass(frozen=True)
class DrawRecord:
    """The source's record of a step's draw: the draw rounds and how many groups of the batch were kept."""

    drawn: DrawResult
    kept: int  # the first ``kept`` groups of the batch are ``drawn.batch``; the rest fill the shape


class TargetScores:
    """The hook an L2RR draw puts around the step's update (``prompts.UpdateHook``): the batch's target scores
    ``<g_tgt, g_i>``, before the update, which donates the base it scores, or with ``lookahead`` after it, from a
    copy of the base that sampled (the prompts' gradients are taken there, the target's at the updated base,
    t + 1). Its record is ``time_target``, the seconds the scores took.

    ``before`` runs ahead of the step's last stop check, and checks the stop between the target's gradient and the
    jvp (``checks_stop``): a stop there abandons the step. With ``lookahead`` the scores come after the update, which
    cannot be abandoned: a stop during them is taken once the step is recorded, with a checkpoint."""

    checks_stop = True

    def __init__(self, scorer: TargetScorer, lookahead: bool):
        self.scorer, self.lookahead = scorer, lookahead
        self.scores: np.ndarray | None = None
        self._sampled_base: Any = None
        self._seconds = 0.0

    def before(self, learner: Any, batch: dict[str, np.ndarray], check=None) -> None:
        start = time.perf_counter()
        if self.lookahead:
            self._sampled_base = {"base": jax.tree.map(jnp.copy, learner.state.params["base"])}
        else:
            self.scores = self.scorer.scores(learner.state.params, batch, check=check)
        self._seconds = time.perf_counter() - start

    def after(self, learner: Any, batch: dict[str, np.ndarray]) -> tuple[np.ndarray | None, dict[str, float]]:
        if self.lookahead:
            start = time.perf_counter()
            self.scores = self.scorer.scores(self._sampled_base, batch, learner.state.params)
            self._sampled_base = None  # a copy of the whole base: not kept past the update that needed it
            self._seconds += time.perf_counter() - start
        return self.scores, {"time_target": self._seconds}


class L2RRPrompts:
    """The L2RR sampler (``draws.L2RRSampler``) over ``examples`` as a prompt source, its draws scored by
    ``scorer`` around each update (see the module docstring)."""

    meta_key = "sampler"

    def __init__(self, run: TrainConfig, examples: list[Any], scorer: TargetScorer):
        self.run, self.examples, self.scorer = run, examples, scorer
        self.sampler = L2RRSampler(len(examples), run.rollout.group_size, run.l2rr)

    def next_batch(self, learner: Any, key: jax.Array, phases: Any) -> Draw:
        """Draw rounds until ``prompts_per_step`` prompts with a learning signal; each round's sampling and scoring
        are timed (and a requested stop honoured) as the step's ``sample`` and ``reward`` phases."""
        run, k, rounds = self.run, self.run.rollout.group_size, []
        draw_key, step_key = jax.random.split(key)
        rng = np.random.default_rng([run.seed, learner.state.step])  # a function of the step: resumes draw the same

        def run_round(indices: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            rows, valid, zero_variance, usable = sample_round(
                learner, run, [self.examples[i] for i in indices], counts, jax.random.fold_in(draw_key, len(rounds)),
                phases,
            )  # fmt: skip
            rounds.append((rows, valid))
            return zero_variance, usable

        drawn = collect_batch(self.sampler, run.rollout.prompts_per_step, rng, run_round, run.l2rr.max_draw_rounds)
        examples, rows, valid = assemble_batch(self.examples, drawn, rounds, run.rollout.prompts_per_step, k)
        record = DrawRecord(drawn, int(drawn.usable.sum()))
        hook = TargetScores(self.scorer, run.l2rr.lookahead)
        return Draw(examples, step_key, rows=rows, valid=valid, update_hook=hook, record=record)

    def observe(self, draw: Draw, observation: np.ndarray | None) -> dict[str, Any]:
        """End the sampler's step with every drawn prompt's zero variance and the kept prompts' scores (the
        observation: the draw's ``TargetScores``)."""
        drawn, kept = draw.record.drawn, draw.record.kept
        scores = None if observation is None else observation[:kept]
        self.sampler.observe(drawn.indices, drawn.zero_variance, drawn.scores_for_observe(scores))
        return {**self.sampler.metrics(), "sampler/draw_rounds": drawn.rounds}

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()  # fresh JSON-able values

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def check_enough_prompts(run: TrainConfig, examples: list[Any]) -> None:
    """A ``DataError`` unless the source has a step's worth of distinct prompts to draw."""
    if len(examples) < run.rollout.prompts_per_step:
        raise data_report.DataError(f"l2rr draws rollout.prompts_per_step = {run.rollout.prompts_per_step} distinct "
                             f"prompts a step, but data.train {run.data.train} has {len(examples)} "
                             "usable ones")  # fmt: skip


def make_prompt_source(run: TrainConfig, examples: list[Any], config: Any, load_examples) -> L2RRPrompts | None:
    """The prompt source of a run with ``l2rr.enabled`` (None otherwise): the prompts are checked before the
    target loads (``load_examples(path)``, the run's loader; ``config``: the policy's model config)."""
    if not run.l2rr.enabled:
        return None
    check_enough_prompts(run, examples)
    return L2RRPrompts(run, examples, load_target(run, config, load_examples))
