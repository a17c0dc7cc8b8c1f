"""The LSPO training step: sample, score, scaffold the cliffs, update the base, discard the adapter.

Per step (the method's steps 1-6), each stage a verb of the run's ``learner.Learner`` and a phase of the step's
timer, named as in its record (``time_<stage>``, ``Phases.NAMES``), in the order they first run:

    sample   B prompts x K rollouts from pi_theta                 (adapter off)
    reward   math-verify accuracy 0/1, plus the overlong penalty for the shaped reward (the re-rolls' too)
    sft      on the cliffs (groups of zero total accuracy, found just before): a fresh adapter, ``sft_steps``
             AdamW steps on their worked solutions (adapter only); what else the solutions may train is
             ``scaffold.supervise``'s (``supervise.SUPERVISORS``)
    reroll   K samples per cliff prompt from pi_theta+phi; verified (reward), their adapter-on log-probs
             (logprob), passing ones spliced into failed rows
    logprob  old_logp = log pi_theta on base rows, the re-rolls' log pi_theta+phi (carried by the splice) on
             spliced rows; with a KL penalty (``loss.kl_coef``) the frozen reference's log-probs from the same pass,
             into the loss or the rewards (``kl_to_reference``)
             (``scaffold.correction`` and ``loss.tis_cap`` may change these and add weights:
             ``corrections.importance_weights``); with an external engine, proof that it sampled the re-rolls with
             the adapter on (``supervise.engine_adapter_check``: a run whose engine held the base stops)
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
counts; the rates built from them are derived where they are reported (``step_record.step_rates``).

The step's timer and stop points are ``phases``'s, what the cliffs' solutions train ``supervise``'s (one function per
arm), and the record's means and diagnostics ``step_record``'s: this module is the step itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax.rl import corrections, losses, scaffold, step_record, supervise
from lspo_jax.rl.learner import Learner, SFTTerm
from lspo_jax.rl.packing import Rows
from lspo_jax.rl.phases import Phases
from lspo_jax.rl.prompts import Draw, UpdateHook


@dataclasses.dataclass
class StepResult:
    """A step's record (counts and means; see ``step_record.step_rates`` for the rates) and, when the draw put a hook
    around the update, what the hook returned for the prompt source's ``observe``."""

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
    sync_before = step_record.sync_totals(learner)
    sample_key, scaffold_key = step_keys(draw)
    rows, valid = sample_and_score(learner, draw, sample_key, phases, sampled)  # sample, reward
    record = {**step_record.rollout_metrics(learner.run, rows, valid), **step_record.reward_record(rows, valid)}
    scaffolded = scaffold_cliffs(learner, rows, draw.examples, scaffold_key, phases, valid)
    rows, spliced_mask, scaffold_record = scaffolded.rows, scaffolded.spliced_rows, scaffolded.counts
    with phases("logprob"):
        base_logp, ref_logp = policy_logprobs(learner, rows)
    # The log-probs of the policy that sampled each row: the adapter-on one's on spliced rows, the base's elsewhere.
    behaviour_logp = np.where(spliced_mask[:, None], rows.get("adapter_logp", base_logp), base_logp)
    record.update(step_record.spliced_diagnostics(base_logp, behaviour_logp, rows["mask"], spliced_mask))
    record.update(step_record.adapter_reliance(base_logp, behaviour_logp, rows["mask"], spliced_mask))
    on_policy = sampled is None or sampled.sampled_at == learner.state.step  # rows sampled ahead may be stale
    record.update(step_record.sampler_gap(rows, base_logp, spliced_mask, on_policy=on_policy))
    if learner.vllm is not None:
        record.update(step_record.engine_metrics(learner, sync_before, base_logp, rows, spliced_mask))
    record.update(
        supervise.engine_adapter_check(learner, rows, base_logp, behaviour_logp, spliced_mask, record, phases)
    )
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
    record.update(step_record.update_metrics(learner, update))
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


def scaffold_cliffs(learner: Learner, rows: Rows, examples, key, phases: Phases, valid=None) -> supervise.Scaffolded:
    """Find the step's cliffs and let ``scaffold.supervise``'s supervisor (``supervise.SUPERVISORS``) act on those
    with a worked solution: LSPO's fits a fresh adapter on their solutions, re-rolls them and splices verified
    successes into ``rows``. Cliff groups whose prompt has no worked solution are skipped and counted in
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
        return supervise.Scaffolded.unchanged(rows, counts)
    cliff_examples = [examples[g] for g in np.flatnonzero(usable)]
    arm = supervise.SUPERVISORS.resolve(run.scaffold.supervise)
    return arm(learner, rows, cliff_examples, usable, key, phases, valid, counts)


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
