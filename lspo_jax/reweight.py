"""L2RR as a prompt source (``prompts``): draw rounds with unequal groups, and the target's scores.

A step with ``l2rr.enabled``:

    rounds   draw the shortfall of prompts from w, allocate n_i in [g_min, K] rollouts each, sample them
             (one sampler call per round, each prompt repeated n_i times), verify, and keep the prompts
             whose group has a learning signal, until B are kept or ``max_draw_rounds`` rounds are done
    batch    the kept prompts in draw order, then (if short) drawn-but-degenerate ones up to B, so every
             step has the same [B * K, T] shape; a group of n_i rollouts fills n_i of its K slots (``valid``)
    score    just before the update the step asks the learner for <g_tgt, g_i> of every prompt of the batch,
             one jvp (``TargetScorer``), and returns them
    observe  every drawn prompt's zero variance and score update w, the zero streaks and the rollouts spent

With the scaffold on, a cliff whose prompt has a worked solution is kept: the scaffold can still rescue it,
while its zero streak (measured on the base rollouts, before any splice) still lowers its weight.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from lspo_jax import data, distributed, l2rr, losses, sharding
from lspo_jax.packing import Rows
from lspo_jax.prompts import Draw
from lspo_jax.train_config import TrainConfig


@dataclasses.dataclass(frozen=True)
class DrawRecord:
    """The source's record of a step's draw: the draw rounds and how many groups of the batch were kept."""

    drawn: l2rr.DrawResult
    kept: int  # the first ``kept`` groups of the batch are ``drawn.batch``; the rest fill the shape


class L2RRPrompts:
    """The L2RR sampler (``l2rr.L2RRSampler``) over ``examples`` as a prompt source (see the module docstring)."""

    meta_key = "sampler"

    def __init__(self, run: TrainConfig, examples: list[Any]):
        if len(examples) < run.rollout.prompts_per_step:
            raise data.DataError(f"l2rr draws rollout.prompts_per_step = {run.rollout.prompts_per_step} distinct "
                                 f"prompts a step, but data.train {run.data.train} has {len(examples)} "
                                 "usable ones")  # fmt: skip
        self.run, self.examples = run, examples
        self.sampler = l2rr.L2RRSampler(len(examples), run.rollout.group_size, run.l2rr)

    def next_batch(self, learner: Any, key: jax.Array, phases: Any) -> Draw:
        """Draw rounds until ``prompts_per_step`` prompts with a learning signal; each round's sampling and scoring
        are timed (and a requested stop honoured) as the step's ``sample`` and ``reward`` phases."""
        run, k, rounds = self.run, self.run.rollout.group_size, []
        draw_key, step_key = jax.random.split(key)
        rng = np.random.default_rng([run.seed, learner.state.step])  # a function of the step: resumes draw the same

        def run_round(indices: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            picked = [self.examples[i] for i, n in zip(indices, counts, strict=True) for _ in range(n)]
            with phases("sample"):
                compact = learner.sample([ex.prompt_ids for ex in picked], jax.random.fold_in(draw_key, len(rounds)),
                                         lora_scale=0.0, n=1)  # fmt: skip
            with phases("reward", check_stop=False):  # one stop check per round, before its sampling
                compact = learner.score(compact, [ex.answer for ex in picked], per_row=True)
                rows, valid = in_slots(compact, counts, k)
            rounds.append((rows, valid))
            zero_variance = _zero_variance(rows["accuracy"], valid, k)
            rescuable = np.array([self.examples[i].solution_ids is not None for i in indices]) & run.scaffold.enabled
            cliff = zero_variance & ~(rows["accuracy"].reshape(-1, k) > 0).any(axis=1)
            return zero_variance, ~zero_variance | (cliff & rescuable)

        batch_size = run.rollout.prompts_per_step
        drawn = l2rr.collect_batch(self.sampler, batch_size, rng, run_round, run.l2rr.max_draw_rounds)
        order = np.concatenate([np.flatnonzero(drawn.usable), np.flatnonzero(~drawn.usable)])[:batch_size]
        if len(order) < batch_size:
            raise RuntimeError(f"only {len(order)} prompts could be drawn for a batch of {batch_size}")
        slots = (order[:, None] * k + np.arange(k)).reshape(-1)
        rows = Rows({name: np.concatenate([r[name] for r, _ in rounds])[slots] for name in rounds[0][0]})
        valid = np.concatenate([v for _, v in rounds])[slots]
        examples = [self.examples[i] for i in drawn.indices[order]]
        record = DrawRecord(drawn, int(drawn.usable.sum()))
        return Draw(examples, step_key, rows=rows, valid=valid, score_prompts=True, record=record)

    def observe(self, draw: Draw, prompt_scores: np.ndarray | None) -> dict[str, Any]:
        """End the sampler's step with every drawn prompt's zero variance and the kept prompts' scores."""
        drawn, kept = draw.record.drawn, draw.record.kept
        scores = None if prompt_scores is None else prompt_scores[:kept]
        self.sampler.observe(drawn.indices, drawn.zero_variance, drawn.scores_for_observe(scores))
        return {**self.sampler.metrics(), "sampler/draw_rounds": drawn.rounds}

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()  # fresh JSON-able values

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def in_slots(compact: dict, counts: np.ndarray, k: int) -> tuple[dict, np.ndarray]:
    """Rows of ``counts[j]`` rollouts per prompt (consecutive) placed in K slots per prompt, and ``valid``."""
    dest = np.concatenate([j * k + np.arange(n) for j, n in enumerate(counts)]).astype(np.int64)
    rows = {}
    for name, value in compact.items():
        slots = np.zeros((len(counts) * k, *value.shape[1:]), value.dtype)
        slots[dest] = value
        rows[name] = slots
    valid = np.zeros(len(counts) * k, bool)
    valid[dest] = True
    return rows, valid


def _zero_variance(accuracy: np.ndarray, valid: np.ndarray, k: int) -> np.ndarray:
    """Per group: all valid rows pass or all fail (GRPO's advantages are then all zero)."""
    acc_GK = np.where(valid, accuracy, np.nan).reshape(-1, k)
    return ~(np.nanmax(acc_GK, axis=1) > np.nanmin(acc_GK, axis=1))


# The scores are a forward-mode product (jax.jvp), and cuDNN's attention, the blocked one and the Pallas and splash
# kernels are custom_vjp functions, which jvp refuses: each is replaced by the written-out function of the same
# rows that has both rules. cuDNN's by ``xla`` (jax.nn.dot_product_attention's own einsums, one sequence a row);
# the segment-id ones by ``einsum``, which takes the padded rows as they come (``xla`` would rotate every row to
# right padding and back, and hold the same scores). Neither keeps memory O(T x block): a layer holds
# [rows, H, T, T] float32 scores and their tangents, so at long rows ``l2rr.score_micro_batches`` bounds the rows.
FORWARD_MODE_ATTENTION = {"cudnn": "xla", "blocked": "einsum", "pallas": "einsum", "splash": "einsum"}


class TargetScorer:
    """``<g_tgt, g_i>`` of every prompt of an RL batch: the target side's directional derivatives of the batch's
    per-prompt policy losses (``l2rr.PolicyLosses``, with the run's ``losses.LossSpec``, the update's), on the mesh
    of the params they are taken at."""

    def __init__(self, run: TrainConfig, config: Any, target: l2rr.TargetSide):
        attention = FORWARD_MODE_ATTENTION.get(config.attention, config.attention)
        config = dataclasses.replace(config, attention=attention)
        self.target = target
        self.losses = l2rr.PolicyLosses(
            config, run.rollout.group_size, normalise=run.l2rr.prompt_loss_norm, spec=losses.LossSpec.of(run),
            num_micro_batches=run.l2rr_score_micro_batches(),
        )  # fmt: skip

    def scores(self, params: Any, batch: dict, target_params: Any = None) -> np.ndarray:
        rows = sharding.global_batch(distributed.mesh_of(params["base"]), batch)  # split over the data axes
        return self.target.directional_derivatives(params, self.losses.bind(rows), target_params)


def load_target(run: TrainConfig, config: Any, load_examples) -> TargetScorer:
    """The scorer of ``l2rr.target`` (its first ``target_limit`` examples with worked solutions)."""
    from lspo_jax import evaluation

    path = evaluation.benchmark_path(run.l2rr.target, run.eval.data_dir)
    examples, report = load_examples(path)
    solved = [ex for ex in examples if ex.solution_ids is not None][: run.l2rr.target_limit]
    if not solved:  # a start-up error naming the file and what loading dropped, not a traceback from l2rr
        lost = report.losses()
        raise data.DataError(f"l2rr.target {path}: no example with a worked solution" + (f"; {lost}" if lost else ""))
    target = l2rr.TargetSide.from_examples(
        config, solved, run.data.max_prompt_tokens, run.data.max_solution_tokens,
        kind=run.l2rr.target_loss, num_micro_batches=run.l2rr_target_micro_batches(len(solved)),
        chunk_size=run.loss.chunk_size,
    )  # fmt: skip
    return TargetScorer(run, config, target)
