"""The training loop's side of L2RR (``l2rr``): draw rounds with unequal groups, and the target's scores.

A step with ``l2rr.enabled``:

    rounds   draw the shortfall of prompts from w, allocate n_i in [g_min, K] rollouts each, sample them
             (one sampler call per round, each prompt repeated n_i times), verify, and keep the prompts
             whose group has a learning signal, until B are kept or ``max_draw_rounds`` rounds are done
    batch    the kept prompts in draw order, then (if short) drawn-but-degenerate ones up to B, so every
             step has the same [B * K, T] shape; a group of n_i rollouts fills n_i of its K slots (``valid``)
    score    just before the update: <g_tgt, g_i> for every prompt of the batch, one jvp (``l2rr.TargetSide``)
    observe  every drawn prompt's zero variance and score update w, the zero streaks and the rollouts spent

With the scaffold on, a cliff whose prompt has a worked solution is kept: the scaffold can still rescue it,
while its zero streak (measured on the base rollouts, before any splice) still lowers its weight.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from lspo_jax import data, l2rr
from lspo_jax.train import Policy, Sampled, StepAbandoned, TrainState, sample_rows, score_rows
from lspo_jax.train_config import TrainConfig


@dataclasses.dataclass
class Collected:
    """A step's batch from the draw rounds: its examples, its ``Sampled`` rollouts and the draw record."""

    examples: list[Any]
    sampled: Sampled
    drawn: l2rr.DrawResult
    kept: int  # the first ``kept`` groups of the batch are ``drawn.batch``; the rest fill the shape


def collect(run: TrainConfig, policy: Policy, state: TrainState, pool, examples, sampler, key, stop=None) -> Collected:
    """Draw rounds until ``prompts_per_step`` prompts with a learning signal (see the module docstring).

    ``stop`` (a ``train.StopFlag``) is asked before each round; a requested stop raises ``StepAbandoned``."""
    k, rounds = run.rollout.group_size, []
    seconds = {"time_sample": 0.0, "time_reward": 0.0}
    rng = np.random.default_rng([run.seed, state.step])  # a function of the step: resumes draw the same

    def run_round(indices: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if stop is not None and stop.agreed():
            raise StepAbandoned(f"stop requested before draw round {len(rounds) + 1}")
        start = time.perf_counter()
        prompts = [examples[i].prompt_ids for i, n in zip(indices, counts, strict=True) for _ in range(n)]
        key_round = jax.random.fold_in(key, len(rounds))
        compact = sample_rows(run, policy, state.params, prompts, key_round, lora_scale=0.0, n=1)
        seconds["time_sample"] += time.perf_counter() - start
        start = time.perf_counter()
        golds = [examples[i].answer for i, n in zip(indices, counts, strict=True) for _ in range(n)]
        score_rows(run, policy, pool, compact, golds, per_row=True)
        rows, valid = in_slots(compact, counts, k)
        rounds.append((indices, rows, valid))
        seconds["time_reward"] += time.perf_counter() - start
        zero_variance = _zero_variance(rows["accuracy"], valid, k)
        rescuable = np.array([examples[i].solution_ids is not None for i in indices]) & run.scaffold.enabled
        cliff = zero_variance & ~(rows["accuracy"].reshape(-1, k) > 0).any(axis=1)
        return zero_variance, ~zero_variance | (cliff & rescuable)

    batch_size = run.rollout.prompts_per_step
    drawn = l2rr.collect_batch(sampler, batch_size, rng, run_round, run.l2rr.max_draw_rounds)
    order = np.concatenate([np.flatnonzero(drawn.usable), np.flatnonzero(~drawn.usable)])[:batch_size]
    if len(order) < batch_size:
        raise RuntimeError(f"only {len(order)} prompts could be drawn for a batch of {batch_size}")
    rows = {name: np.concatenate([r[name] for _, r, _ in rounds]) for name in rounds[0][1]}
    valid = np.concatenate([v for _, _, v in rounds])
    slots = (order[:, None] * k + np.arange(k)).reshape(-1)
    sampled = Sampled({name: value[slots] for name, value in rows.items()}, valid[slots], seconds)
    return Collected([examples[i] for i in drawn.indices[order]], sampled, drawn, int(drawn.usable.sum()))


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


def scorer(run: TrainConfig, policy: Policy, state: TrainState, target: l2rr.TargetSide, sampler, collected):
    """``before_update`` for ``train_step``: score the batch's prompts against the target set, then end the
    sampler's step with every drawn prompt's zero variance and score. Returns the sampler's metrics."""
    # The scores are a forward-mode product (jax.jvp); cuDNN's attention has only a reverse-mode rule, and the
    # xla kernel is the same function with both.
    forward_config = policy.config
    if forward_config.attention == "cudnn":
        forward_config = dataclasses.replace(forward_config, attention="xla")
    losses_fn = l2rr.PolicyLosses(
        forward_config, run.rollout.group_size, normalise=run.l2rr.prompt_loss_norm, eps_low=run.loss.eps_low,
        eps_high=run.loss.eps_high, clip_c=run.loss.clip_c, temperature=run.rollout.temperature,
        chunk_size=run.loss.chunk_size, num_micro_batches=run.l2rr.score_micro_batches,
    )  # fmt: skip

    def before_update(batch: dict) -> dict[str, Any]:
        start = time.perf_counter()
        scores = target.directional_derivatives(state.params, losses_fn.bind(batch))[: collected.kept]
        drawn = collected.drawn
        sampler.observe(drawn.indices, drawn.zero_variance, drawn.scores_for_observe(scores))
        return {**sampler.metrics(), "sampler/draw_rounds": drawn.rounds, "time_target": time.perf_counter() - start}

    return before_update


def load_target(run: TrainConfig, policy: Policy, load_examples) -> l2rr.TargetSide:
    """The target side of ``l2rr.target`` (its first ``target_limit`` examples with worked solutions)."""
    from lspo_jax import evaluation

    path = evaluation.benchmark_path(run.l2rr.target, run.eval.data_dir)
    examples, report = load_examples(run, policy, path, run.seed)
    solved = [ex for ex in examples if ex.solution_ids is not None][: run.l2rr.target_limit]
    if not solved:  # a start-up error naming the file and what loading dropped, not a traceback from l2rr
        lost = data.DataReport(**report).losses()
        raise data.DataError(f"l2rr.target {path}: no example with a worked solution" + (f"; {lost}" if lost else ""))
    return l2rr.TargetSide.from_examples(
        policy.config, solved, run.data.max_prompt_tokens, run.data.max_solution_tokens,
        kind=run.l2rr.target_loss, num_micro_batches=run.l2rr.target_micro_batches, chunk_size=run.loss.chunk_size,
    )  # fmt: skip
