"""SFT then RL: the base is fine-tuned on the training set's worked solutions before its first RL step, for
``scaffold.warmup_tokens`` solution tokens, and the steps that follow are DAPO's (``scaffold.supervise: sft_warmup``)
or LSPO's (``supervise: adapter``: SFT then LSPO).

The budget is meant to match what the direct-supervision control (``scaffold.supervise: base``) spends over a run
of the same config: the sum of its records' ``scaffold/sft_tokens`` (``sft_steps`` passes over each step's cliff
solutions), or, from a short run of it, their mean per step times ``steps``. The two arms then differ in when and
on which solutions the same SFT tokens are spent (all at the start, on the training set as drawn; or through the
run, on the prompts the base fails), not in how: both take AdamW steps of the base at ``optim.lr`` from a fresh
optimizer state, the RL optimizer's left as it is.

The order: every example with a worked solution, permuted by the run's seed (the file's order when
``data.shuffle`` is false), ``rollout.prompts_per_step`` to an update, taken until their solution tokens reach the
budget (the last example may pass it by less than its own length); a budget above the set's tokens goes round it
again in a new order. Solutions are tokenised as they are reached, not all at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from lspo_jax.rl.learner import Learner
from lspo_jax.rl.supervise import sft_batch
from lspo_jax.train_config import ConfigError, TrainConfig

RECORD_KIND = "warmup"  # the ``kind`` of the warm-up's one record in metrics.jsonl, at step 0


class WarmupStopped(Exception):
    """A stop was asked for during the warm-up: it ended before its next update, and nothing of it is kept (the base
    it changed is dropped; a run does the warm-up again whole). The message says how far it had come."""


def wanted(run: TrainConfig) -> bool:
    """Whether the run starts with the SFT warm-up."""
    return run.scaffold.enabled and run.scaffold.warmup_tokens is not None


def warmup_batches(run: TrainConfig, examples: Sequence[Any]) -> Iterator[list[Any]]:
    """The warm-up's updates as lists of examples (see the module docstring for the order and the budget)."""
    budget, size = run.scaffold.warmup_tokens, run.rollout.prompts_per_step
    rng = np.random.default_rng([run.seed, 1])  # a stream of its own: the prompt order is not moved by it
    taken, batch = 0, []
    while True:
        order = rng.permutation(len(examples)) if run.data.shuffle else np.arange(len(examples))
        found = False
        for i in order:
            solution = examples[i].solution_ids
            if solution is None:
                continue
            found = True
            batch.append(examples[i])
            taken += len(solution)
            if taken >= budget:
                yield batch
                return
            if len(batch) == size:
                yield batch
                batch = []
        if not found:
            raise ConfigError("scaffold.supervise: sft_warmup trains on worked solutions, and no prompt of data.train "
                              "has one (data.solution_field)")  # fmt: skip


def sft_warmup(learner: Learner, examples: Sequence[Any], stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The warm-up of ``learner``'s base on ``examples``' solutions (``Learner.base_sft_updates``). Returns its
    record: ``scaffold/warmup_tokens`` (the solution tokens read), ``scaffold/warmup_examples``,
    ``scaffold/warmup_updates``, ``updates_skipped`` (non-finite ones, skipped whole), the first and the last update's
    loss (``sft_loss_first``, ``sft_loss``) and ``time_warmup`` (seconds).

    ``stop`` is asked before each update (on every process alike: it may be a collective); when it answers true the
    warm-up ends there with ``WarmupStopped``, the learner's base left part-way, for the caller to drop. Each update is
    one program of ``rollout.prompts_per_step`` solutions, so a stop waits for one at most."""
    start, read = time.perf_counter(), {"tokens": 0, "examples": 0, "updates": 0}
    budget = learner.run.scaffold.warmup_tokens

    def batches() -> Iterator[dict[str, np.ndarray]]:
        for chosen in warmup_batches(learner.run, examples):
            if stop is not None and stop():
                done = read["updates"]
                raise WarmupStopped(f"after {done} update{'' if done == 1 else 's'}, {read['tokens']} of its {budget} "
                                    "solution tokens")  # fmt: skip
            read["updates"] += 1
            batch = sft_batch(learner, chosen)
            read["tokens"] += int(np.sum(batch["mask"]))
            read["examples"] += len(chosen)
            yield batch

    updates = list(learner.base_sft_updates(batches()))
    return {
        "scaffold/warmup_tokens": read["tokens"],
        "scaffold/warmup_examples": read["examples"],
        "scaffold/warmup_updates": len(updates),
        "updates_skipped": sum(not bool(u["finite"]) for u in updates),
        "sft_loss_first": float(updates[0]["sft_loss"]),
        "sft_loss": float(updates[-1]["sft_loss"]),
        "time_warmup": time.perf_counter() - start,
    }
