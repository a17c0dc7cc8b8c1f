"""Prompt sources that sample their own draw rounds: L2RR (``l2rr.enabled``) and DAPO's dynamic sampling
(``rollout.dynamic_sampling``).

A step with ``l2rr.enabled``:

    rounds   draw the shortfall of prompts from w, allocate n_i in [g_min, K] rollouts each, sample them
             (one sampler call per round, each prompt repeated n_i times), verify, and keep the prompts
             whose group has a learning signal, until B are kept or ``max_draw_rounds`` rounds are done
    batch    the kept prompts in draw order, then (if short) drawn-but-degenerate ones up to B, so every
             step has the same [B * K, T] shape; a group of n_i rollouts fills n_i of its K slots (``valid``)
    score    just before the update the step asks the learner for <g_tgt, g_i> of every prompt of the batch,
             one jvp (``TargetScorer``), and returns them
    observe  every drawn prompt's zero variance and score update w, the zero streaks and the rollouts spent

Dynamic sampling draws its rounds the same way from the epoch order, K rollouts a prompt and no weights.

With the scaffold on, a cliff whose prompt has a worked solution is kept: the scaffold can still rescue it,
while its zero streak (measured on the base rollouts, before any splice) still lowers its weight.
"""

from __future__ import annotations

import dataclasses
import sys
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
            rows, valid, zero_variance, usable = sample_round(
                learner, run, [self.examples[i] for i in indices], counts, jax.random.fold_in(draw_key, len(rounds)),
                phases,
            )  # fmt: skip
            rounds.append((rows, valid))
            return zero_variance, usable

        drawn = l2rr.collect_batch(self.sampler, run.rollout.prompts_per_step, rng, run_round, run.l2rr.max_draw_rounds)
        examples, rows, valid = assemble_batch(self.examples, drawn, rounds, run.rollout.prompts_per_step, k)
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


class DynamicSamplingPrompts:
    """DAPO's dynamic sampling: the epoch order's next prompts, ``group_size`` rollouts each, sampled and verified in
    rounds; a group whose rollouts all pass or all fail carries no GRPO signal and is dropped, and the shortfall
    drawn, until the batch holds ``prompts_per_step`` groups with a signal or ``rollout.max_draw_rounds`` rounds are
    done. A batch still short then is filled with dropped groups (zero advantages; the step's shapes never change),
    and the record counts it. A dropped prompt is consumed, as in DAPO: the order moves past it.

    The first round is the call a step without dynamic sampling makes (its key, its prompts, K rollouts each), so
    a batch whose groups all carry a signal is that step's batch exactly; later rounds fold the round into the key.
    Every draw is a function of the step's key and the order's position: a resumed run draws what an uninterrupted
    one did, and an abandoned step puts the order back (``state_dict``)."""

    meta_key = "order"  # the same state as ``prompts.ShuffledPrompts``': a run may turn the option on or off

    def __init__(self, run: TrainConfig, examples: list[Any]):
        self.run, self.examples = run, examples
        self.order = data.PromptOrder(len(examples), seed=run.seed, shuffle=run.data.shuffle)

    def next_batch(self, learner: Any, key: jax.Array, phases: Any) -> Draw:
        run, k, rounds = self.run, self.run.rollout.group_size, []
        sample_key = jax.random.split(key)[0]  # ``train.train_step``'s own sampling key

        def run_round(indices: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            round_key = sample_key if not rounds else jax.random.fold_in(sample_key, len(rounds))
            rows, valid, zero_variance, usable = sample_round(
                learner, run, [self.examples[i] for i in indices], counts, round_key, phases, per_prompt=True
            )
            rounds.append((rows, valid))
            return zero_variance, usable

        batch_size = run.rollout.prompts_per_step
        drawn = l2rr.collect_batch(_OrderDraws(self.order, k), batch_size, None, run_round, run.rollout.max_draw_rounds)
        examples, rows, valid = assemble_batch(self.examples, drawn, rounds, batch_size, k)
        return Draw(examples, key, rows=rows, valid=valid, record=drawn)

    def observe(self, draw: Draw, prompt_scores: np.ndarray | None) -> dict[str, Any]:
        drawn, batch_size = draw.record, self.run.rollout.prompts_per_step
        kept = min(int(drawn.usable.sum()), batch_size)
        return {
            "sampler/draw_rounds": drawn.rounds,
            "sampler/drawn": len(drawn.indices),  # prompts sampled this step, each with K rollouts
            "sampler/dropped": int((~drawn.usable).sum()),  # groups without a signal (some may fill the batch)
            "sampler/kept": kept,
            "sampler/filled": batch_size - kept,  # dropped groups back in the batch: the bound was reached
            "sampler/rollouts_step": int(drawn.rollouts.sum()),
        }

    def state_dict(self) -> dict[str, Any]:
        return self.order.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.restore(state)


class _OrderDraws:
    """``data.PromptOrder`` as ``l2rr.collect_batch``'s sampler: the order's next prompts, K rollouts each; the
    order never runs out (it moves into the next epoch)."""

    def __init__(self, order: data.PromptOrder, k: int):
        self.order, self.k = order, k

    def draw(self, count: int, rng: Any) -> np.ndarray:
        return np.asarray(self.order.take(count), np.int64)

    def allocate(self, indices: np.ndarray) -> np.ndarray:
        return np.full(len(indices), self.k, np.int64)

    def remaining(self) -> int:
        return sys.maxsize


def sample_round(
    learner: Any,
    run: TrainConfig,
    picked: list[Any],
    counts: np.ndarray,
    key: jax.Array,
    phases: Any,
    per_prompt: bool = False,
) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """One draw round: ``counts[j]`` rollouts of ``picked[j]`` sampled, verified and placed in K slots a prompt.
    Returns the rows, ``valid``, each group's zero variance, and whether it joins the batch: a signal, or (with
    the scaffold on) a cliff whose prompt has a worked solution. ``per_prompt``: full groups, sampled as the step
    samples them (``n = K`` a prompt); otherwise each prompt repeated ``counts[j]`` times."""
    k = run.rollout.group_size
    with phases("sample"):
        if per_prompt:
            compact = learner.sample([ex.prompt_ids for ex in picked], key, lora_scale=0.0)
        else:
            repeated = [ex for ex, n in zip(picked, counts, strict=True) for _ in range(n)]
            compact = learner.sample([ex.prompt_ids for ex in repeated], key, lora_scale=0.0, n=1)
    with phases("reward", check_stop=False):  # one stop check per round, before its sampling
        if per_prompt:
            rows, valid = dict(learner.score(compact, [ex.answer for ex in picked])), np.ones(len(picked) * k, bool)
        else:
            compact = learner.score(compact, [ex.answer for ex in repeated], per_row=True)
            rows, valid = in_slots(compact, counts, k)
    zero_variance = _zero_variance(rows["accuracy"], valid, k)
    rescuable = np.array([ex.solution_ids is not None for ex in picked], bool) & run.scaffold.enabled
    cliff = zero_variance & ~(rows["accuracy"].reshape(-1, k) > 0).any(axis=1)
    return rows, valid, zero_variance, ~zero_variance | (cliff & rescuable)


def assemble_batch(
    examples: list[Any], drawn: l2rr.DrawResult, rounds: list, batch_size: int, k: int
) -> tuple[list[Any], Rows, np.ndarray]:
    """The batch of a draw: its usable groups in draw order, then drawn-but-degenerate ones up to ``batch_size``."""
    order = np.concatenate([np.flatnonzero(drawn.usable), np.flatnonzero(~drawn.usable)])[:batch_size]
    if len(order) < batch_size:
        raise RuntimeError(f"only {len(order)} prompts could be drawn for a batch of {batch_size}")
    slots = (order[:, None] * k + np.arange(k)).reshape(-1)
    rows = Rows({name: np.concatenate([r[name] for r, _ in rounds])[slots] for name in rounds[0][0]})
    valid = np.concatenate([v for _, v in rounds])[slots]
    return [examples[i] for i in drawn.indices[order]], rows, valid


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
