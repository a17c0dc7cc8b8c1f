"""Prompt sources that sample their own draw rounds, and DAPO's dynamic sampling (``rollout.dynamic_sampling``).

A draw round asks a sampler (``draw``, ``allocate``, ``remaining``) for the shortfall of prompts and how many
rollouts each gets, samples and verifies them (``sample_round``), and keeps the prompts whose group has a learning
signal; ``collect_batch`` repeats rounds until the batch is full or the bound is reached, and ``assemble_batch``
lays the kept groups (then, if short, drawn-but-degenerate ones) out as the step's ``[B * K, T]`` rows.
With the scaffold on, a cliff whose prompt has a worked solution is kept: the scaffold can still rescue it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from lspo_jax.rl.packing import Rows
from lspo_jax.rl.prompts import Draw, PromptOrder
from lspo_jax.train_config import TrainConfig

# ---------------------------------------------------------------------------------------- draw rounds
RoundFn = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


DRAWN_ARRAYS = ("indices", "rollouts", "zero_variance", "usable")  # ``DrawResult``'s per-prompt fields


@dataclasses.dataclass(frozen=True)
class DrawResult:
    """A step's draws: every drawn prompt with its rollouts, zero variance and whether it joined the batch."""

    indices: np.ndarray
    rollouts: np.ndarray
    zero_variance: np.ndarray
    usable: np.ndarray
    rounds: int

    @property
    def batch(self) -> np.ndarray:
        """The update batch's prompts, in draw order."""
        return self.indices[self.usable]

    def scores_for_observe(self, batch_scores: np.ndarray | None) -> np.ndarray | None:
        """Per-prompt scores of the batch (in ``batch`` order) spread over ``indices``, NaN where not in the batch."""
        if batch_scores is None:
            return None
        aligned = np.full(len(self.indices), np.nan)
        aligned[self.usable] = np.asarray(batch_scores, np.float64)
        return aligned


def collect_batch(
    sampler: Any,
    batch_size: int,
    rng: np.random.Generator,
    run_round: RoundFn,
    max_rounds: int,
    progress: Callable[[int, int], None] | None = None,
) -> DrawResult:
    """Draw rounds until ``batch_size`` usable prompts, ``max_rounds`` rounds, or no prompt is left. ``sampler``:
    anything with ``draw(count, rng)``, ``allocate(indices)`` (rollouts a prompt) and ``remaining()``.

    Each round draws the shortfall, allocates its rollouts and calls ``run_round(indices, rollouts) ->
    (zero_variance, usable)``, both ``[len(indices)]`` bool. The batch may come out short; the caller pads it.
    ``progress(round, kept)`` is called before each round (numbered from 1) with the usable prompts so far.
    """
    parts: list[tuple[np.ndarray, ...]] = []
    kept, rounds = 0, 0
    while rounds < max_rounds and kept < batch_size and sampler.remaining() > 0:
        if progress is not None:
            progress(rounds + 1, kept)
        indices = sampler.draw(min(batch_size - kept, sampler.remaining()), rng)
        rollouts = sampler.allocate(indices)
        zero_variance, usable = (np.asarray(x, bool) for x in run_round(indices, rollouts))
        parts.append((indices, rollouts, zero_variance, usable))
        kept += int(usable.sum())
        rounds += 1
    if not parts:
        parts.append((np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, bool)))
    return DrawResult(*(np.concatenate(column) for column in zip(*parts, strict=True)), rounds=rounds)


# A draw says where it is before round PROGRESS_FROM, then before every PROGRESS_EVERY-th: on data without a signal
# each round is a whole sampling of the batch, and a large bound would otherwise pass them in silence.
PROGRESS_FROM, PROGRESS_EVERY = 5, 10


def draw_progress(what: str, batch_size: int, max_rounds: int) -> Callable[[int, int], None]:
    """``collect_batch``'s ``progress`` for a draw of ``batch_size`` groups: a line on stderr before rounds 5, 10,
    20, 30, ... (``lspo-train: step 12: dynamic sampling round 40 of 1000, 3 of 16 groups with a signal so far``)."""

    def say(round_: int, kept: int) -> None:
        if round_ == PROGRESS_FROM or (round_ > PROGRESS_FROM and round_ % PROGRESS_EVERY == 0):
            # tqdm's write: the run's progress bar, if it shows one, is redrawn below the line instead of broken.
            tqdm.write(f"lspo-train: {what} round {round_} of {max_rounds}, {kept} of {batch_size} groups with a "
                       "signal so far", file=sys.stderr)  # fmt: skip

    return say


class DynamicSamplingPrompts:
    """DAPO's dynamic sampling: the epoch order's next prompts, ``group_size`` rollouts each, sampled and verified in
    rounds; a group whose rollouts all pass or all fail carries no GRPO signal and is dropped, and the shortfall
    drawn, until the batch holds ``prompts_per_step`` groups with a signal or ``rollout.max_draw_rounds`` rounds are
    done. A batch still short then is filled with dropped groups (zero advantages; the step's shapes never change),
    and the record counts it. A dropped prompt is consumed, as in DAPO: the order moves past it.

    The first round is the call a step without dynamic sampling makes (its key, its prompts, K rollouts each), so
    a batch whose groups all carry a signal is that step's batch exactly; later rounds fold the round into the key.
    Every draw is a function of the step's key and the order's position: a resumed run draws what an uninterrupted
    one did, and an abandoned step puts the order back (``state_dict``). A draw of many rounds says where it is
    (``draw_progress``)."""

    meta_key = "order"  # the same state as ``prompts.ShuffledPrompts``': a run may turn the option on or off

    def __init__(self, run: TrainConfig, examples: list[Any]):
        self.run, self.examples = run, examples
        self.order = PromptOrder(len(examples), seed=run.seed, shuffle=run.data.shuffle)

    def next_batch(self, learner: Any, key: jax.Array, phases: Any) -> Draw:
        run, k, rounds, sizes = self.run, self.run.rollout.group_size, [], []
        batch_size, max_rounds = run.rollout.prompts_per_step, run.rollout.max_draw_rounds
        sample_key = jax.random.split(key)[0]  # ``train.train_step``'s own sampling key
        fillers = 0  # dropped groups in the rounds kept: the first ``batch_size`` of them may fill the batch

        def run_round(indices: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            nonlocal fillers
            round_key = sample_key if not rounds else jax.random.fold_in(sample_key, len(rounds))
            rows, valid, zero_variance, usable = sample_round(
                learner, run, [self.examples[i] for i in indices], counts, round_key, phases, per_prompt=True
            )
            # A round without a usable group, once a batch's worth of dropped groups came before it, can never enter
            # the batch (``assemble_batch`` fills with the first dropped ones): its rows are let go, so a draw of
            # many rounds holds at most about 2 x ``batch_size`` rounds' rows, not one per round.
            needed = bool(usable.any()) or fillers < batch_size
            fillers += int((~usable).sum()) if needed else 0
            rounds.append((rows, valid) if needed else None)
            sizes.append(len(indices))
            return zero_variance, usable

        say = draw_progress(f"step {learner.state.step + 1}: dynamic sampling", batch_size, max_rounds)
        say = say if jax.process_index() == 0 else None  # every process draws the same rounds; one says so
        drawn = collect_batch(_OrderDraws(self.order, k), batch_size, None, run_round, max_rounds, progress=say)
        held = np.repeat([r is not None for r in rounds], sizes).astype(bool)
        held_drawn = dataclasses.replace(drawn, **{name: getattr(drawn, name)[held] for name in DRAWN_ARRAYS})
        examples, rows, valid = assemble_batch(
            self.examples, held_drawn, [r for r in rounds if r is not None], batch_size, k
        )
        return Draw(examples, key, rows=rows, valid=valid, record=drawn)

    def observe(self, draw: Draw, observation: Any) -> dict[str, Any]:
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
    """``PromptOrder`` as ``collect_batch``'s sampler: the order's next prompts, K rollouts each; the
    order never runs out (it moves into the next epoch)."""

    def __init__(self, order: PromptOrder, k: int):
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
            rows, valid = dict(learner.score(compact, picked)), np.ones(len(picked) * k, bool)
        else:
            compact = learner.score(compact, repeated, per_row=True)
            rows, valid = in_slots(compact, counts, k)
    zero_variance = _zero_variance(rows["accuracy"], valid, k)
    rescuable = np.array([ex.solution_ids is not None for ex in picked], bool) & run.scaffold.uses_cliffs
    cliff = zero_variance & ~(rows["accuracy"].reshape(-1, k) > 0).any(axis=1)
    return rows, valid, zero_variance, ~zero_variance | (cliff & rescuable)


def assemble_batch(
    examples: list[Any], drawn: DrawResult, rounds: list, batch_size: int, k: int
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
