"""The LSPO training step: sample, score, scaffold the cliffs, update the base, discard the adapter.

Per step (the method's steps 1-6), each stage a verb of the run's ``learner.Learner`` and a phase of the step's
timer, named as in its record (``time_<stage>``, ``Phases.NAMES``), in the order they first run:

    sample   B prompts x K rollouts from pi_theta                 (adapter off)
    reward   math-verify accuracy 0/1, plus the overlong penalty for the shaped reward (the re-rolls' too)
    sft      on the cliffs (groups of zero total accuracy, found just before): a fresh adapter, ``sft_steps``
             AdamW steps on their worked solutions (adapter only); what else the solutions may train is
             ``scaffold.supervise``'s (``SUPERVISORS``)
    reroll   K samples per cliff prompt from pi_theta+phi; verified (reward), their adapter-on log-probs
             (logprob), passing ones spliced into failed rows
    logprob  old_logp = log pi_theta on base rows, the re-rolls' log pi_theta+phi (carried by the splice) on
             spliced rows; with a KL penalty (``loss.kl_coef``) the frozen reference's log-probs from the same pass,
             into the loss or the rewards (``kl_to_reference``)
             (``scaffold.correction`` and ``loss.tis_cap`` may change these and add weights:
             ``corrections.importance_weights``); with an external engine, proof that it sampled the re-rolls with
             the adapter on (``engine_adapter_check``: a run whose engine held the base stops)
    judge    with a token-advantages strategy only (``Learner.token_advantages``, e.g. a teacher judging the
             failed rows): ``[rows, length]`` advantages from GRPO's advantages of the spliced batch (taken
             untimed just before; without a strategy, those are the update's)
    update   the clipped surrogate on the policy only, the scaffold's adapter off (lora_scale = 0): the base, or
             with ``optim.train: lora`` the policy adapter on a frozen base (``optim.py``);
             ``optim.mini_batches`` x ``optim.epochs`` updates (rl_updates), inside the draw's hook if it has one
             (``prompts.UpdateHook``: what a prompt source learns from the update; its ``before`` runs ahead of the
             step's last stop check)

With ``scaffold.enabled: false`` the same step is the DAPO baseline. The loop (``run``) derives the step's key
as ``fold_in(seed, step)``, so a resumed run draws exactly what an uninterrupted one would. The step returns
counts; the rates built from them are derived where they are reported (``step_rates``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax import options
from lspo_jax.rl import corrections, losses, packing, scaffold
from lspo_jax.rl.learner import Learner, SFTTerm
from lspo_jax.rl.packing import Rows
from lspo_jax.rl.prompts import Draw, UpdateHook
from lspo_jax.train_config import TrainConfig


class StepAbandoned(Exception):
    """A stop was requested before the step's update: nothing of the step reached the base or its optimizer."""


class Phases:
    """Wall-clock seconds per phase of a step (``time_sample``, ``time_reward``, ...).

    With ``stop`` (a ``StopFlag``, or anything with its ``agreed()``), entering a phase after a stop was
    requested raises ``StepAbandoned``: a preempted job checkpoints within one phase, not one whole step.
    """

    NAMES = ("sample", "reward", "sft", "reroll", "logprob", "judge", "update")

    def __init__(self, stop=None):
        # Every phase is reported, 0 when it did not run (a step without cliffs has no sft or reroll).
        self.seconds: dict[str, float] = {f"time_{name}": 0.0 for name in self.NAMES}
        self.stop = stop

    def check(self, name: str, *, during: bool = False) -> None:
        """``StepAbandoned`` if a stop was asked for (agreed by every process) before the ``name`` phase, or with
        ``during`` between two of its pieces."""
        if self.stop is not None and self.stop.agreed():
            raise StepAbandoned(f"stop requested {'during' if during else 'before'} the step's {name} phase")

    def within(self, name: str) -> Callable[[], None]:
        """The check a long piece of work before the update calls between its pieces (``check(name, during=True)``):
        each call is a collective on several processes, so the work must call it the same number of times on all."""
        return lambda: self.check(name, during=True)

    @contextlib.contextmanager
    def __call__(self, name: str, *, check_stop: bool = True):
        """Time the ``name`` phase; ``check_stop=False`` only times it (a phase entered right after a checked one:
        on several processes each check is a collective)."""
        if check_stop:
            self.check(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time_{name}"] += time.perf_counter() - start


@dataclasses.dataclass
class StepResult:
    """A step's record (counts and means; see ``step_rates`` for the rates) and, when the draw put a hook around
    the update, what the hook returned for the prompt source's ``observe``."""

    metrics: dict[str, Any]
    observation: Any = None


class TokenAdvantages(Protocol):
    """A strategy for per-token advantages (``Learner.token_advantages``): from GRPO's per-row advantages of the
    (spliced) batch, ``outcome`` ``[rows]``, the update's ``[rows, length]`` advantages and the strategy's metrics
    for the step's record. It runs in the step's ``phase`` (one of ``Phases.NAMES``).

    A strategy whose work comes in pieces (a teacher's batches) sets ``checks_stop = True`` and is called with
    ``check=``, a function to call between them that raises ``StepAbandoned`` once a stop is asked for: the step is
    abandoned before its update. One without the attribute is called as before and runs whole."""

    phase: str

    def __call__(
        self, learner: Learner, rows: Rows, examples: list[Any], outcome: np.ndarray, valid: np.ndarray | None
    ) -> tuple[np.ndarray, dict[str, Any]]: ...


# ----------------------------------------------------------------------------------------------- step
def step_keys(draw: Draw) -> tuple[jax.Array, jax.Array]:
    """The keys a step samples its rollouts with and scaffolds its cliffs with, from its draw's: one place, so rows
    sampled ahead of the step (``rl.staleness``) take the key the step would have used itself."""
    sample_key, scaffold_key = jax.random.split(draw.key)
    return sample_key, scaffold_key


def train_step(
    learner: Learner, draw: Draw, phases: Phases | None = None, *, sampled: Any = None,
    start_next: Callable[[], None] | None = None,
) -> StepResult:  # fmt: skip
    """One RL step on ``draw`` (B prompts); updates ``learner.state`` and returns the step's record.

    ``phases``: the step's timer and stop (see ``Phases``); a step abandoned by it raises ``StepAbandoned``
    with the base, its optimizer state and the counters as they came in (the adapter, reset every step, may
    have moved). ``sampled``: the draw's rollouts sampled ahead (``staleness.Prefetch``: its ``rows()``, taken in
    the ``sample`` phase); ``start_next``: called once the step's last stop check has passed, before anything
    changes the base (the run starts the next step's sampling there, ``rollout.max_staleness``).
    """
    phases = phases or Phases()
    sync_before = _sync_totals(learner)
    sample_key, scaffold_key = step_keys(draw)
    rows, valid = sample_and_score(learner, draw, sample_key, phases, sampled)  # sample, reward
    record = {**rollout_metrics(learner.run, rows, valid), **reward_record(rows, valid)}
    scaffolded = scaffold_cliffs(learner, rows, draw.examples, scaffold_key, phases, valid)
    rows, spliced_mask, scaffold_record = scaffolded.rows, scaffolded.spliced_rows, scaffolded.counts
    with phases("logprob"):
        base_logp, ref_logp = policy_logprobs(learner, rows)
    # The log-probs of the policy that sampled each row: the adapter-on one's on spliced rows, the base's elsewhere.
    behaviour_logp = np.where(spliced_mask[:, None], rows.get("adapter_logp", base_logp), base_logp)
    record.update(spliced_diagnostics(base_logp, behaviour_logp, rows["mask"], spliced_mask))
    record.update(adapter_reliance(base_logp, behaviour_logp, rows["mask"], spliced_mask))
    on_policy = sampled is None or sampled.sampled_at == learner.state.step  # rows sampled ahead may be stale
    record.update(sampler_gap(rows, base_logp, spliced_mask, on_policy=on_policy))
    if learner.vllm is not None:
        record.update(_engine_metrics(learner, sync_before, base_logp, rows, spliced_mask))
    record.update(engine_adapter_check(learner, rows, base_logp, behaviour_logp, spliced_mask, record, phases))
    old_logp, weights = corrections.importance_weights(
        learner.run, rows, base_logp, behaviour_logp, spliced_mask, correction=learner.correction
    )
    rows = rows.replace(old_logp=old_logp)
    if ref_logp is not None:
        rows, kl_record = kl_to_reference(learner, rows, base_logp, ref_logp)
        record.update(kl_record)
    advantages, advantages_record = step_advantages(learner, rows, draw.examples, valid, phases)
    record.update(advantages_record)
    batch = update_batch(rows, advantages, weights, record)
    if draw.update_hook is not None:  # its ``before`` reads the base that sampled: it can still be abandoned
        with phases("update"):
            hook_before(draw.update_hook, learner, batch, phases)
    phases.check("update")  # the step's last stop check: the base changes only after it
    if start_next is not None:
        start_next()
    if scaffolded.before_update is not None:
        with phases("sft", check_stop=False):
            scaffold_record.update(scaffolded.before_update())
    with phases("update", check_stop=False):
        update, observation = update_base(learner, batch, spliced_mask, draw.update_hook, record, scaffolded.sft_term)
    record["spliced_accuracy_mean"] = float(rows["accuracy"].mean())
    record.update(scaffold_record)
    record.update(update_metrics(learner, update))
    record.update(learner.take_reward_failures())  # the step's draw rounds, rollouts and re-rolls
    return StepResult({"step": learner.state.step, **record, **phases.seconds}, observation)


def update_batch(rows: Rows, advantages, weights, record: dict) -> dict:
    """The update's batch: the step's rows with the advantages times the detached loss weights."""
    if weights is not None:
        advantages = np.asarray(losses.weighted_advantages(advantages, weights, rows["mask"].shape))
        record["is_weight_mean"] = float(np.mean(weights[rows["mask"] > 0] if weights.ndim == 2 else weights))
    batch = {**{k: rows[k] for k in ("tokens", "attention_mask", "mask", "old_logp")}, "advantages": advantages}
    if "ref_logp" in rows:  # a KL term in the loss (``kl_to_reference``)
        batch["ref_logp"] = rows["ref_logp"]
    return batch


def hook_before(hook: UpdateHook, learner: Learner, batch: dict, phases: Phases) -> None:
    """The draw's hook's ``before``, before the step's last stop check (and before ``scaffold.supervise: base``
    moves the base): at the base that sampled the rows. A hook with ``checks_stop`` (``prompts.UpdateHook``) checks
    the stop between its pieces, abandoning the step (``StepAbandoned``)."""
    if getattr(hook, "checks_stop", False):
        hook.before(learner, batch, check=phases.within("update"))
    else:
        hook.before(learner, batch)


def update_base(
    learner: Learner, batch: dict, spliced_rows, hook: UpdateHook | None, record: dict, sft_term: SFTTerm | None = None
):  # fmt: skip
    """The update of the base on the step's ``batch`` (``update_batch``; ``rl_updates``, with the mixed objective's
    ``sft_term`` if any); with ``scaffold.grad_share`` the share of its gradient's norm the spliced rows carry
    (``spliced_grad_share``); and with the draw's ``hook`` its ``after`` (whose record joins the step's; its
    ``before`` ran already, ``hook_before``). Returns ``(update metrics, the hook's observation or None)``."""
    if learner.run.scaffold.grad_share and spliced_rows.any():  # one more gradient pass
        record["spliced_grad_norm"] = spliced_grad_norm(learner, batch, spliced_rows)
        if learner.run.optim.mini_batches * learner.run.optim.epochs > 1:  # the update reports mini-batch norms
            record["batch_grad_norm"] = learner.rl_grad_norm(batch)
    observation = None
    update = rl_updates(learner, batch, sft_term)
    if hook is not None:
        # Past the update, the base has changed: a stop asked for now is taken once the step is recorded (the loop
        # checkpoints after it), never by abandoning, which would drop an update the base has taken.
        observation, hook_record = hook.after(learner, batch)
        record.update(hook_record)
    total = record.get("batch_grad_norm", update.get("grad_norm"))
    if "spliced_grad_norm" in record and total:
        record["spliced_grad_share"] = record["spliced_grad_norm"] / float(total)
    return update, observation


def policy_logprobs(learner: Learner, rows: Rows) -> tuple[np.ndarray, np.ndarray | None]:
    """The base's log-probs of the step's rows (the old log-probs of those it sampled) and, with a KL penalty
    (``loss.kl_coef``), the frozen reference's from the same pass (``Learner.logprobs_with_reference``); else None."""
    if not learner.run.loss.kl_coef:
        return learner.logprobs(rows, lora_scale=0.0), None
    return learner.logprobs_with_reference(rows)


def kl_to_reference(learner: Learner, rows: Rows, base_logp, ref_logp) -> tuple[Rows, dict[str, float]]:
    """The KL penalty's part of the step before the advantages. ``loss.kl_in: loss``: the rows carry ``ref_logp`` into
    the update, whose loss adds the term and whose metrics give ``kl_ref``. ``reward``: each row's shaped reward loses
    ``kl_coef`` times its summed k1, ``log pi_theta(y) - log pi_ref(y)`` of the base that is updated (on spliced rows
    too, whose sampler was the adapter), detached (``losses.sequence_kl``); ``kl_ref`` is k1's token-mean."""
    loss, mask = learner.run.loss, rows["mask"]
    if loss.kl_loss_coef:
        return rows.replace(ref_logp=ref_logp), {}
    row_kl = np.asarray(losses.sequence_kl(base_logp, ref_logp, mask))
    reward = np.asarray(rows["reward"] - loss.kl_reward_coef * row_kl, np.float32)
    return rows.replace(reward=reward), {"kl_ref": float(row_kl.sum() / max(1.0, float(np.sum(mask > 0))))}


def spliced_grad_norm(learner: Learner, batch: dict, spliced_rows: np.ndarray) -> float:
    """The norm of the update's gradient from the spliced rows alone: their advantages, every other row's set to 0
    (the token-mean still over the whole batch's tokens, as in the update). Its ratio to the update's ``grad_norm``
    is ``spliced_grad_share``: the share of the gradient they carry, above 1 where the other rows' gradients cancel
    theirs. It costs a gradient pass (``scaffold.grad_share``), counted in ``time_update``."""
    advantages = np.asarray(batch["advantages"])
    keep = spliced_rows.reshape((-1,) + (1,) * (advantages.ndim - 1))
    return learner.rl_grad_norm({**batch, "advantages": np.where(keep, advantages, 0.0).astype(np.float32)})


def sample_and_score(
    learner: Learner, draw: Draw, key, phases: Phases, sampled: Any = None
) -> tuple[Rows, np.ndarray | None]:
    """The step's rollouts and their rewards: sampled here (K per prompt) unless the draw holds them or they were
    sampled ahead (``sampled``, a ``staleness.Prefetch``: the phase is the wait for it)."""
    if draw.rows is not None:
        return Rows(draw.rows), draw.valid
    with phases("sample"):
        if sampled is not None:
            rows = sampled.rows()
        else:
            rows = learner.sample([ex.prompt_ids for ex in draw.examples], key, lora_scale=0.0)
    with phases("reward"):
        return learner.score(rows, draw.examples), None


def step_advantages(learner: Learner, rows: Rows, examples, valid, phases: Phases) -> tuple[np.ndarray, dict]:
    """GRPO's advantages of the (spliced) batch, ``[rows]``, or with the learner's token-advantages strategy the
    ``[rows, length]`` advantages it makes of them and its metrics."""
    k, estimator = learner.run.rollout.group_size, learner.estimator
    advantages = np.asarray(losses.group_advantages(jnp.asarray(rows["reward"]), k, valid=valid, estimator=estimator))
    strategy = learner.token_advantages
    if strategy is None:
        return advantages, {}
    # Opted into by the strategy, so a strategy written before ``check`` existed is called as it expects.
    check = {"check": phases.within(strategy.phase)} if getattr(strategy, "checks_stop", False) else {}
    with phases(strategy.phase):
        return strategy(learner, rows, examples, advantages, valid, **check)


def rl_updates(learner: Learner, batch: dict, sft_term: SFTTerm | None = None) -> dict[str, Any]:
    """The step's update of the base: one on the whole batch (with ``sft_term``, on the mixed objective: the config
    allows it only there), or ``optim.epochs`` passes over it in ``optim.mini_batches`` mini-batches of rows,
    shuffled each epoch by a function of the seed and the step (a resumed run shuffles alike). Several updates
    report their metrics' mean, the last ``lr``, ``finite`` only if every update was, and ``updates_skipped``."""
    run = learner.run
    if sft_term is not None:
        return learner.mixed_rl_step(batch, sft_term)
    if run.optim.mini_batches == 1 and run.optim.epochs == 1:
        return learner.rl_step(batch)
    rng = np.random.default_rng([run.seed, learner.state.step])
    rows, results = len(batch["tokens"]), []
    for epoch in range(run.optim.epochs):
        parts = np.array_split(rng.permutation(rows), run.optim.mini_batches)
        for i, part in enumerate(parts):
            last = epoch == run.optim.epochs - 1 and i == len(parts) - 1
            results.append(learner.rl_step({k: v[part] for k, v in batch.items()}, ends_step=last))
    merged = {k: float(np.mean([r[k] for r in results])) for k in results[0] if k not in ("lr", "finite")}
    finite = [r["finite"] for r in results]
    return {**merged, "lr": results[-1]["lr"], "finite": all(finite), "updates_skipped": finite.count(False)}


def update_metrics(learner: Learner, update: dict[str, Any]) -> dict[str, Any]:
    """The update's part of the step's record."""
    names = ("clip_frac_low", "clip_frac_high", "entropy", "loss", "grad_norm", "pad_fraction")
    return {
        "lr": update["lr"],
        **{name: update.get(name) for name in names},
        "update_skipped": not update["finite"],
        "nonfinite_total": learner.state.nonfinite_total,
        **{k: v for k, v in update.items() if k.startswith(("ratio", "approx_kl", "kl_ref"))},
        **{f"scaffold/{k}": v for k, v in update.items() if k.startswith("mix_")},  # the mixed objective's
    }


def step_rates(record: dict[str, Any]) -> dict[str, float | None]:
    """The step's rates from its counts: ``surpass_rate`` (surpassed over attempted cliff groups, the paper's
    definition; only for a step whose scaffold ran) and ``rescue_pass_rate`` (verified re-rollouts over all)."""
    rerolls = record["rerolls"]
    rates = {"rescue_pass_rate": record["rerolls_passed"] / rerolls if rerolls else None}
    if "sft_loss" in record:  # the scaffold ran
        attempted = record["scaffold_attempted"]
        rates["surpass_rate"] = record["surpassed_groups"] / attempted if attempted else None
    return rates


# ------------------------------------------------------------------------------------------- scaffold
@dataclasses.dataclass
class Scaffolded:
    """What the scaffold made of a step's rows (``scaffold_cliffs``): the rows the update takes (with
    ``adapter_logp``, the re-rollouts' adapter-on log-probs on spliced rows and 0 elsewhere, when the adapter rescued
    any), which of them are spliced, the step's counts, and what a supervision of the base adds to the update:
    ``before_update``, run just before it and returning its metrics (the direct control's base SFT), or ``sft_term``,
    an SFT term in its loss (the mixed objective)."""

    rows: Rows
    spliced_rows: np.ndarray
    counts: dict[str, Any]
    before_update: Callable[[], dict[str, Any]] | None = None
    sft_term: SFTTerm | None = None


def scaffold_cliffs(learner: Learner, rows: Rows, examples, key, phases: Phases, valid=None) -> Scaffolded:
    """Find the step's cliffs and let ``scaffold.supervise``'s supervisor (``SUPERVISORS``) act on those with a
    worked solution: LSPO's fits a fresh adapter on their solutions, re-rolls them and splices verified successes
    into ``rows``. Cliff groups whose prompt has no worked solution are skipped and counted in
    ``scaffold_no_solution``. ``valid`` marks the rows of groups smaller than ``group_size`` (the rest is padding,
    never a cliff's failed row nor spliced into).
    """
    run, k = learner.run, learner.run.rollout.group_size
    cliffs = scaffold.find_cliffs(rows["accuracy"], k, valid, max_successes=run.scaffold.cliff_max_successes)
    usable = np.array([cliff and ex.solution_ids is not None for cliff, ex in zip(cliffs, examples, strict=True)])
    counts = {"cliff_groups": int(cliffs.sum()), "scaffold_no_solution": int((cliffs & ~usable).sum()),
              "scaffold_attempted": int(usable.sum()) if run.scaffold.enabled else 0, "surpassed_groups": 0,
              "spliced_rows": 0, "rerolls": 0, "rerolls_passed": 0}  # fmt: skip
    if not run.scaffold.enabled:
        return Scaffolded(rows, _no_rows(rows), counts)
    cliff_examples = [examples[g] for g in np.flatnonzero(usable)]
    supervise = SUPERVISORS.resolve(run.scaffold.supervise)
    return supervise(learner, rows, cliff_examples, usable, key, phases, valid, counts)


def _no_rows(rows: Rows) -> np.ndarray:
    return np.zeros(len(rows["accuracy"]), bool)


# What the worked solutions train (``scaffold.supervise``): ``(learner, rows, cliff_examples, usable, key, phases,
# valid, counts) -> Scaffolded``, called on every step of a run with the scaffold on, with or without cliffs.
SUPERVISORS = options.Registry(options.Supervise, "scaffold supervision")


@SUPERVISORS.register("adapter")
def rescue_with_adapter(learner: Learner, rows: Rows, cliff_examples, usable, key, phases: Phases, valid, counts):
    """LSPO: fit the adapter on the solutions, re-roll the cliffs with it on, splice the verified re-rolls."""
    if not cliff_examples:
        return Scaffolded(rows, _no_rows(rows), counts)
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
        return Scaffolded(rows, _no_rows(rows), counts)
    batch = sft_batch(learner, cliff_examples)
    steps = learner.run.scaffold.sft_steps
    counts.update({"scaffold_attempted": 0, "supervised_groups": len(cliff_examples),
                   "scaffold/sft_tokens": steps * int(np.sum(batch["mask"]))})  # fmt: skip

    def before_update() -> dict:
        return {"sft_loss": float(learner.base_sft_steps(batch, steps)["sft_loss"])}

    return Scaffolded(rows, _no_rows(rows), counts, before_update=before_update)


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
    return Scaffolded(rows, _no_rows(rows), counts, sft_term=term)


@SUPERVISORS.register("sft_warmup")
def after_warmup(learner: Learner, rows: Rows, cliff_examples, usable, key, phases: Phases, valid, counts):
    """SFT then RL: the worked solutions trained the base once, before the first step (``rl.warmup``); each step is
    DAPO's, its cliffs counted and left as they are."""
    counts["scaffold_attempted"] = 0
    return Scaffolded(rows, _no_rows(rows), counts)


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


# ----------------------------------------------------------------------------------------- metrics
def rollout_metrics(run: TrainConfig, rows: Rows, valid: np.ndarray | None = None) -> dict[str, Any]:
    """Means over the sampled rollouts (the valid rows) before the scaffold, and the share of the groups with
    a learning signal (rewards not all equal), which a prompt sampler tries to raise."""
    valid = np.ones(len(rows["accuracy"]), bool) if valid is None else valid
    overlong = (~rows["eos"]) & (rows["lengths"] >= run.rollout.max_new_tokens)
    reward_GK = np.where(valid, rows["reward"], np.nan).reshape(-1, run.rollout.group_size)
    informative = np.nanmax(reward_GK, axis=1) > np.nanmin(reward_GK, axis=1)
    return {
        "accuracy_mean": float(rows["accuracy"][valid].mean()),
        "reward_mean": float(rows["reward"][valid].mean()),
        "response_len_mean": float(rows["lengths"][valid].mean()),
        "overlong_frac": float(overlong[valid].mean()),
        "rollouts": int(valid.sum()),
        "effective_prompt_ratio": float(informative.mean()),
    }


def reward_record(rows: Rows, valid: np.ndarray | None = None) -> dict[str, float]:
    """``reward/<name>``: each reward function's mean score over the sampled rollouts (the valid rows, the rows'
    ``reward/<name>`` fields, ``Learner.score``'s), before the scaffold, as ``accuracy_mean`` and ``reward_mean``."""
    valid = np.ones(len(rows["accuracy"]), bool) if valid is None else valid
    return {name: float(np.asarray(rows[name])[valid].mean()) for name in rows if name.startswith("reward/")}


def _sync_totals(learner: Learner) -> tuple[float, int]:
    """The vLLM engine's weight pushes so far: seconds, and bytes that went through the host (0, 0 without one)."""
    if learner.vllm is None:
        return 0.0, 0
    return learner.vllm.stats["sync_s_total"], int(learner.vllm.stats.get("sync_host_bytes_total", 0))


GAP_KEY = "rollout/logprob_gap"  # the record's mean |sampler - trainer| log-prob of the base's sampled tokens


def sampler_gap(rows: Rows, base_logp: np.ndarray, spliced_rows: np.ndarray, *, on_policy: bool) -> dict[str, Any]:
    """``rollout/logprob_gap``: the mean over the tokens the base sampled this step (spliced rows left out: the
    adapter sampled those) of ``|sampler log-prob - trainer log-prob|``, the engine's own log-prob of each token
    against the trainer's teacher-forced forward of the same weights, both at the rollout's temperature. It is the
    evidence that the engine samples the policy being trained: rounding alone keeps it near 0 (the bound a run holds
    it to: ``rollout.max_logprob_gap``), and an engine left with other weights moves it as far as those weights
    differ. None for rows an earlier base sampled (``rollout.max_staleness``), which differ by design."""
    if not on_policy or "sampler_logp" not in rows:
        return {GAP_KEY: None}
    mask = (rows["mask"] > 0) & ~spliced_rows[:, None]
    if not mask.any():
        return {GAP_KEY: 0.0}
    gap = np.abs(np.asarray(rows["sampler_logp"], np.float64) - np.asarray(base_logp, np.float64))
    return {GAP_KEY: float(gap[mask].mean())}


def _engine_metrics(
    learner: Learner, sync_before: tuple[float, int], base_logp: np.ndarray, rows: Rows, spliced_rows: np.ndarray
):  # fmt: skip
    """``rollout/sync_s`` and ``rollout/sync_host_bytes`` (the weight pushes of this step: seconds, and bytes copied
    through the host rather than handed over on the device), how far the engine's log-probs of its sampled tokens are
    from the trainer's teacher-forced base log-probs on the rows the base policy sampled, and the engines that
    sampled (``rollout/engines``, ``rollout/engine_prompts``: the busiest engine's prompts this step)."""
    from lspo_jax.rollout.vllm_sampler import logprob_mismatch

    mask = (rows["mask"] > 0) & ~spliced_rows[:, None]
    seconds, host_bytes = _sync_totals(learner)
    return {
        "rollout/sync_s": seconds - sync_before[0],
        "rollout/sync_host_bytes": host_bytes - sync_before[1],
        **logprob_mismatch(base_logp, rows["sampler_logp"], mask),
        **learner.engine_record(),
    }


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


SPLICED_DIAGNOSTICS = ("spliced_ratio_mean", "spliced_log_ratio_q10", "spliced_log_ratio_q50",
                       "spliced_log_ratio_q90", "spliced_token_share")  # fmt: skip


def spliced_diagnostics(base_logp, behaviour_logp, token_mask, spliced_rows: np.ndarray) -> dict[str, float]:
    """What the rescued rows carry into the update, before any correction: the token-mean of ``pi_theta /
    pi_theta+phi`` over spliced tokens (``spliced_ratio_mean``), the 10/50/90% quantiles of its log
    (``spliced_log_ratio_q10`` ...; a token with log ratio far below 0 gets almost no gradient under ``token``),
    and the spliced rows' share of the update's tokens (``spliced_token_share``). None on a step without them."""
    log_ratio = scaffold.spliced_tokens(base_logp - behaviour_logp, token_mask, spliced_rows)
    if not log_ratio.size:
        return dict.fromkeys(SPLICED_DIAGNOSTICS)
    quantiles = np.quantile(log_ratio, [0.1, 0.5, 0.9])
    return {
        "spliced_ratio_mean": float(np.exp(log_ratio).mean()),
        **{f"spliced_log_ratio_q{q}": float(v) for q, v in zip((10, 50, 90), quantiles, strict=True)},
        "spliced_token_share": float(log_ratio.size / max(1, np.sum(token_mask > 0))),
    }


def adapter_reliance(base_logp, behaviour_logp, token_mask, spliced_rows: np.ndarray) -> dict[str, float | None]:
    """``scaffold/adapter_reliance``: the mean over the spliced tokens of ``log pi_theta+phi(y_t) - log
    pi_theta(y_t)``, minus the mean of the log ratio whose quantiles ``spliced_diagnostics`` records (the same
    tokens, through ``scaffold.spliced_tokens``). None on a step without spliced rows.

    It is HiLL's reliance (the token mean over the correct guided rows of the log-likelihood gain the hint gives),
    with the adapter as the hint. Its sign is chosen so that lower means less reliance: near 0 the base already
    finds the spliced text likely (what transfers to it), large the text is the adapter's. Both log-probs as the
    update sees them: the base's at the rollout temperature, the adapter's at the re-rolls' (the same unless
    ``scaffold.reroll_temperature`` is set).
    """
    gain = scaffold.spliced_tokens(behaviour_logp - base_logp, token_mask, spliced_rows)
    return {"scaffold/adapter_reliance": float(gain.mean()) if gain.size else None}
