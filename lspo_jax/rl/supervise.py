"""What a step's cliffs' worked solutions train (``scaffold.supervise``): each arm a function of ``SUPERVISORS``
that ``train.scaffold_cliffs`` calls with the cliffs it found, returning ``Scaffolded``.

    adapter      LSPO: a fresh adapter fitted on the solutions (``fit_adapter``), the cliffs re-rolled with it on
                 (``reroll``), the verified re-rolls spliced into failed rows (``scaffold.splice``)
    base         the direct control: SFT steps of the base itself on the solutions, just before the RL update
    mixed        CHORD's mixed objective: the solutions' SFT term in the RL update's own loss
    sft_warmup   SFT then RL: the solutions trained the base before the first step (``rl.warmup``, which packs them
                 with ``sft_batch``); each step is DAPO's

With an external engine, ``engine_adapter_check`` proves from the log-probs that it sampled the re-rolls with the
adapter on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from lspo_jax import options
from lspo_jax.rl import packing, scaffold
from lspo_jax.rl.learner import Learner, SFTTerm
from lspo_jax.rl.packing import Rows
from lspo_jax.rl.phases import Phases
from lspo_jax.train_config import TrainConfig


@dataclasses.dataclass
class Scaffolded:
    """What the scaffold made of a step's rows (``train.scaffold_cliffs``): the rows the update takes (with
    ``adapter_logp``, the re-rollouts' adapter-on log-probs on spliced rows and 0 elsewhere, when the adapter rescued
    any), which of them are spliced, the step's counts, and what a supervision of the base adds to the update:
    ``before_update``, run just before it and returning its metrics (the direct control's base SFT), or ``sft_term``,
    an SFT term in its loss (the mixed objective)."""

    rows: Rows
    spliced_rows: np.ndarray
    counts: dict[str, Any]
    before_update: Callable[[], dict[str, Any]] | None = None
    sft_term: SFTTerm | None = None

    @classmethod
    def unchanged(cls, rows: Rows, counts: dict[str, Any], **supervision: Any) -> Scaffolded:
        """The step's rows as they came, none spliced (a step without cliffs, or a supervision that splices none)."""
        return cls(rows, np.zeros(len(rows["accuracy"]), bool), counts, **supervision)


# What the worked solutions train (``scaffold.supervise``): ``(learner, rows, cliff_examples, usable, key, phases,
# valid, counts) -> Scaffolded``, called on every step of a run with the scaffold on, with or without cliffs.
SUPERVISORS = options.Registry(options.Supervise, "scaffold supervision")


@SUPERVISORS.register("adapter")
def rescue_with_adapter(learner: Learner, rows: Rows, cliff_examples, usable, key, phases: Phases, valid, counts):
    """LSPO: fit the adapter on the solutions, re-roll the cliffs with it on, splice the verified re-rolls."""
    if not cliff_examples:
        return Scaffolded.unchanged(rows, counts)
    run, k = learner.run, learner.run.rollout.group_size
    adapter_key, reroll_key = jax.random.split(key)
    n, scale, temperature = _reroll_settings(run)
    with phases("sft"):
        # At scale 0 the re-rolls are the base's own (the compute-matched control): no adapter to fit.
        counts["sft_loss"] = fit_adapter(learner, cliff_examples, adapter_key) if scale else None
    with phases("reroll"):
        rerolls, slots = reroll(learner, cliff_examples, reroll_key)
    with phases("reward"):
        rerolls = learner.score(rerolls, [ex for ex in cliff_examples for _ in range(n)], per_row=True)
    with phases("logprob"):
        # The spliced rows' importance-ratio denominator: the adapter-on policy that sampled them.
        logp = learner.logprobs(rerolls, lora_scale=scale, min_rows=slots * n, temperature=temperature)
    spliced, spliced_rows, stats = scaffold.splice(
        rows, rerolls.replace(adapter_logp=logp), usable, k, valid, variant=learner.splice_variant, reroll_n=n,
        carry=("adapter_logp",),
    )  # fmt: skip
    counts.update(surpassed_groups=stats.num_surpassed, spliced_rows=stats.num_spliced, rerolls=stats.num_rerolls,
                  rerolls_passed=stats.num_passing_rerolls)  # fmt: skip
    return Scaffolded(Rows(spliced), spliced_rows, counts)


@SUPERVISORS.register("base")
def supervise_base(learner: Learner, rows: Rows, cliff_examples, usable, key, phases: Phases, valid, counts):
    """The direct-supervision control: ``scaffold.sft_steps`` SFT steps of the base itself on the rows the adapter
    would have been fitted on, nothing re-rolled or spliced. The SFT runs just before the RL update (timed as
    ``sft``): after the rows' log-probs, so their importance ratios keep the base that sampled them as the
    denominator, and after the step's last stop check, so an abandoned step leaves the base as it came. No surpass
    rate: the groups are counted as ``supervised_groups``, not as attempted. ``scaffold/sft_tokens``: the solution
    tokens its updates read (``sft_steps`` passes over them), what ``scaffold.warmup_tokens`` is matched to."""
    if not cliff_examples:
        return Scaffolded.unchanged(rows, counts)
    batch = sft_batch(learner, cliff_examples)
    steps = learner.run.scaffold.sft_steps
    counts.update({"scaffold_attempted": 0, "supervised_groups": len(cliff_examples),
                   "scaffold/sft_tokens": steps * int(np.sum(batch["mask"]))})  # fmt: skip

    def before_update() -> dict:
        return {"sft_loss": float(learner.base_sft_steps(batch, steps)["sft_loss"])}

    return Scaffolded.unchanged(rows, counts, before_update=before_update)


@SUPERVISORS.register("mixed")
def supervise_mixed(learner: Learner, rows: Rows, cliff_examples, usable, key, phases: Phases, valid, counts):
    """CHORD's mixed objective: the cliffs' worked solutions enter the RL update's own loss, ``L_RL + mu_t * L_SFT``
    (``losses.mixed_loss``), in one gradient step of the base; nothing is re-rolled or spliced, no adapter is fitted.
    ``mu_t`` follows ``scaffold.mix_schedule`` from ``scaffold.mix_mu`` over the run's ``steps``
    (``losses.MIX_SCHEDULES``, t the steps done), and ``scaffold.mix_token_weight`` weighs the SFT tokens. A step
    without cliffs has no SFT term: its update is DAPO's. Records ``scaffold/mix_mu``, ``scaffold/mix_sft_tokens``
    (the solution tokens of the term, 0 without cliffs) and ``scaffold/mix_sft_loss`` (L_SFT, from the update; None
    without cliffs); the groups are ``supervised_groups``, as the direct control's."""
    scaffold_ = learner.run.scaffold
    mu = learner.mix_schedule(scaffold_.mix_mu, learner.state.step, learner.run.steps)
    term = SFTTerm(sft_batch(learner, cliff_examples), mu) if cliff_examples else None
    tokens = int(np.sum(term.batch["mask"])) if term is not None else 0
    counts.update({"scaffold_attempted": 0, "supervised_groups": len(cliff_examples), "scaffold/mix_mu": mu,
                   "scaffold/mix_sft_tokens": tokens, "scaffold/mix_sft_loss": None})  # fmt: skip
    return Scaffolded.unchanged(rows, counts, sft_term=term)


@SUPERVISORS.register("sft_warmup")
def after_warmup(learner: Learner, rows: Rows, cliff_examples, usable, key, phases: Phases, valid, counts):
    """SFT then RL: the worked solutions trained the base once, before the first step (``rl.warmup``); each step is
    DAPO's, its cliffs counted and left as they are."""
    counts["scaffold_attempted"] = 0
    return Scaffolded.unchanged(rows, counts)


def _cliff_slots(learner: Learner, cliffs: int) -> int:
    """Cliff prompts per scaffold batch, at least ``scaffold.min_cliff_bucket`` (the passes bucket it further)."""
    return max(cliffs, learner.run.scaffold.min_cliff_bucket)


def fit_adapter(learner: Learner, cliff_examples, key) -> float:
    """A fresh adapter (or a persistent one where ``learner.adapter_due`` says so), then ``scaffold.sft_steps`` SFT
    steps on the cliffs' worked solutions; the last loss."""
    if learner.adapter_due():
        learner.reset_adapter(key)
    batch = sft_batch(learner, cliff_examples)
    for _ in range(learner.run.scaffold.sft_steps):
        metrics = learner.sft_step(batch)
    return float(metrics["sft_loss"])


def sft_batch(learner: Learner, cliff_examples) -> dict[str, np.ndarray]:
    """The cliffs' prompts and worked solutions as SFT rows (``packing.pack_sft``), in a bucket of cliff slots."""
    run = learner.run
    prompts, solutions = [ex.prompt_ids for ex in cliff_examples], [ex.solution_ids for ex in cliff_examples]
    # Rows as long as these cliffs need (a power of two), not the configured maxima: short worked solutions
    # would otherwise pay for max_prompt_tokens + max_solution_tokens of attention and MLP per row.
    lengths = packing.sft_slots(prompts, solutions, run.data.max_prompt_tokens, run.data.max_solution_tokens)
    row_count = packing.pow2_bucket(_cliff_slots(learner, len(prompts)))
    return packing.pad_rows(packing.pack_sft(prompts, solutions, *lengths), row_count)


def _reroll_settings(run: TrainConfig) -> tuple[int, float, float]:
    """Re-rolls per cliff, the adapter's scale and the temperature they are sampled (and scored) at."""
    scaffold_ = run.scaffold
    temperature = scaffold_.reroll_temperature or run.rollout.temperature
    return scaffold_.reroll_n or run.rollout.group_size, scaffold_.reroll_scale, temperature


def reroll(learner: Learner, cliff_examples, key) -> tuple[Rows, int]:
    """``scaffold.reroll_n`` samples per cliff prompt with the adapter on, and the prompt count they were sampled
    in."""
    n, scale, temperature = _reroll_settings(learner.run)
    prompts, slots = [ex.prompt_ids for ex in cliff_examples], _cliff_slots(learner, len(cliff_examples))
    padding = [prompts[0]] * (slots - len(prompts))  # sampled, then dropped: only fixes the shape
    rerolls = learner.sample(prompts + padding, key, lora_scale=scale, n=n, temperature=temperature)
    return rerolls.take(slice(len(prompts) * n)), slots


def engine_adapter_check(
    learner: Learner, rows: Rows, base_logp, behaviour_logp, spliced_rows: np.ndarray, record: dict, phases: Phases
) -> dict[str, Any]:
    """``scaffold.adapter_check`` of the re-rolls an external engine sampled (``scaffold/adapter_check``: 1 the engine
    held the adapter, 0 the adapter too close to the base to tell; a run whose engine held the base stops with
    ``scaffold.AdapterNotOnError``). The engine's noise is its mismatch on the base-sampled rows
    (``vllm_logp_abs_diff``). None on a step without spliced rows, at ``scaffold.reroll_scale`` 0 (no adapter), and
    with the JAX sampler, whose re-rolls are the trainer's own forward with the adapter on: nothing to prove."""
    _, scale, temperature = _reroll_settings(learner.run)
    if learner.vllm is None or not scale or not spliced_rows.any():
        return dict.fromkeys(scaffold.ADAPTER_CHECK)
    if temperature != learner.run.rollout.temperature:  # the base as the engine would have sampled the re-rolls
        with phases("logprob", check_stop=False):
            base_logp = learner.logprobs(rows, lora_scale=0.0, temperature=temperature)
    return scaffold.adapter_check(
        rows["sampler_logp"], behaviour_logp, base_logp, rows["mask"], spliced_rows, record["vllm_logp_abs_diff"],
        step=learner.state.step + 1,
    )  # fmt: skip
