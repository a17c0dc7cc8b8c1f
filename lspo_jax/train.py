"""The LSPO training loop: sample, score, scaffold the cliffs, update the base, discard the adapter.

Per step (the method's steps 1-6):

    sample  B prompts x K rollouts from pi_theta              (sampler, adapter off)
    reward  math-verify accuracy 0/1, plus the overlong penalty for the shaped reward
    cliffs  groups with zero total accuracy
    sft     fresh adapter, ``sft_steps`` AdamW steps on the cliff prompts' worked solutions (adapter only)
    reroll  K samples per cliff prompt from pi_theta+phi; verify; splice passing ones into failed rows
    logprob old_logp = log pi_theta on base rows, log pi_theta+phi (already set) on spliced rows
    update  advantages on the spliced batch, clipped surrogate on the base only (lora_scale = 0)

With ``scaffold.enabled: false`` the same loop is the DAPO baseline. The per-step RNG is
``fold_in(seed, step)``, so a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from lspo_jax import distributed, losses, optim, rewards, rollout, scaffold, sharding
from lspo_jax.config import ModelConfig
from lspo_jax.model import Params
from lspo_jax.optim import RLOptimConfig, SFTOptimConfig
from lspo_jax.sampler import generate_arrays
from lspo_jax.train_config import LossConfig, TrainConfig


@dataclasses.dataclass
class Policy:
    """What the loop needs about the model besides its params.

    ``engine``: the run's rollout engine when ``rollout.engine`` is ``vllm`` (a ``VLLMSampler``, which syncs
    the params it is given before sampling); None samples with our JAX sampler. ``mesh``: the device mesh
    the run's programs are split over (``sharding.make_mesh``); None runs them on one device. ``judge``: the
    ``first_mistake.Judge`` of a run with ``first_mistake.enabled``.
    """

    config: ModelConfig
    tokenizer: Any
    eos_ids: tuple[int, ...]
    engine: Any = None
    mesh: Mesh | None = None
    judge: Any = None


@dataclasses.dataclass
class TrainState:
    """Everything a step reads and writes. ``params["lora"]`` is scratch space for the step's adapter."""

    step: int
    params: Params
    opt_state: Any
    nonfinite_in_row: int = 0
    nonfinite_total: int = 0


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

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.stop is not None and self.stop.agreed():
            raise StepAbandoned(f"stop requested before the step's {name} phase")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time_{name}"] += time.perf_counter() - start


# --------------------------------------------------------------------------------------------- update
def guarded_rl_step(
    config: ModelConfig, params: Params, opt_state: Any, batch: dict, *, rl: RLOptimConfig, loss: LossConfig,
    temperature: float,
):  # fmt: skip
    """``optim.rl_step`` that keeps params and optimizer state when the loss or gradient is non-finite."""
    new_params, new_state, metrics = optim.rl_step(
        config, params, opt_state, batch,
        rl=rl, eps_low=loss.eps_low, eps_high=loss.eps_high, clip_c=loss.clip_c,
        temperature=temperature, num_micro_batches=loss.micro_batches, chunk_size=loss.chunk_size,
    )  # fmt: skip
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    keep = lambda new, old: jnp.where(finite, new, old)
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_state, opt_state)
    return params, opt_state, {**metrics, "finite": finite}


# The single-device programs. The static arguments are only the config sections a step reads, not the whole
# TrainConfig: a run that differs in an unrelated field (steps, data path, checkpointing) reuses them.
rl_update = jax.jit(guarded_rl_step, static_argnames=("config", "rl", "loss", "temperature"), donate_argnums=(1, 2))


@functools.partial(jax.jit, static_argnames=("config", "sft"), donate_argnums=(1, 2))
def sft_update(config: ModelConfig, params: Params, opt_state: Any, batch: dict, *, sft: SFTOptimConfig):
    return optim.sft_step(config, params, opt_state, batch, sft=sft)


# The same steps on a device mesh: params and optimizer state split by ``sharding``'s rules, rows over the
# data-parallel axes. Built once per (model, mesh, config sections) and cached.
@functools.cache
def _mesh_rl_update(config: ModelConfig, mesh: Mesh, rl: RLOptimConfig, sft: SFTOptimConfig, loss, temperature):
    step = functools.partial(guarded_rl_step, config, rl=rl, loss=loss, temperature=temperature)
    return distributed.jit_step(config, mesh, optim.make_optimizer(rl, sft), step)


@functools.cache
def _mesh_sft_update(config: ModelConfig, mesh: Mesh, rl: RLOptimConfig, sft: SFTOptimConfig):
    return distributed.sharded_sft_step(config, mesh, rl=rl, sft=sft)


@functools.cache
def state_layouts(config: ModelConfig, mesh: Mesh, rl: RLOptimConfig, sft: SFTOptimConfig) -> tuple[Any, Any]:
    """``(params, optimizer state)`` shardings of a run on ``mesh``."""
    tx = optim.make_optimizer(rl, sft)
    return sharding.param_shardings(config, mesh), sharding.opt_state_shardings(config, mesh, tx)


def place_state(run: TrainConfig, policy: Policy, params: Params, opt_state: Any) -> tuple[Params, Any]:
    """Params and optimizer state in the run's layout: split over ``policy.mesh``, or on the first device."""
    if policy.mesh is None:
        device = jax.devices()[0]
        return jax.device_put(params, device), jax.device_put(opt_state, device)
    params_sh, state_sh = state_layouts(policy.config, policy.mesh, run.optim, run.scaffold.sft)
    return sharding.shard_params(params, params_sh), jax.device_put(opt_state, state_sh)


def apply_rl_update(run: TrainConfig, policy: Policy, state: TrainState, batch: dict) -> dict:
    """The RL update of ``state`` on ``batch``, on one device or on the mesh; returns the step's metrics."""
    if policy.mesh is None:
        # Masked rows (no gradient, no token in the mean) up to a multiple of the micro-batch count, as on a mesh.
        m = run.loss.micro_batches
        batch = rollout.pad_rows(batch, -(-len(batch["tokens"]) // m) * m)
        state.params, state.opt_state, metrics = rl_update(
            policy.config, state.params, state.opt_state, batch,
            rl=run.optim, loss=run.loss, temperature=run.rollout.temperature,
        )  # fmt: skip
    else:
        step = _mesh_rl_update(
            policy.config, policy.mesh, run.optim, run.scaffold.sft, run.loss, run.rollout.temperature
        )
        batch = rollout.mesh_rows(policy.mesh, batch, multiple=run.loss.micro_batches)
        state.params, state.opt_state, metrics = step(state.params, state.opt_state, batch)
    return jax.device_get(metrics)


def apply_sft_update(run: TrainConfig, policy: Policy, state: TrainState, batch: dict) -> dict:
    """One adapter SFT step of ``state`` on ``batch``, on one device or on the mesh."""
    if policy.mesh is None:
        state.params, state.opt_state, metrics = sft_update(
            policy.config, state.params, state.opt_state, batch, sft=run.scaffold.sft
        )
    else:
        step = _mesh_sft_update(policy.config, policy.mesh, run.optim, run.scaffold.sft)
        batch = rollout.mesh_rows(policy.mesh, batch)
        state.params, state.opt_state, metrics = step(state.params, state.opt_state, batch)
    return metrics


def logprobs(run: TrainConfig, policy: Policy, params: Params, rows: dict, *, lora_scale: float, min_rows: int = 1):
    """Teacher-forced log-probs of ``rows`` at the sampling temperature (see ``rollout.teacher_forced_logprobs``)."""
    return rollout.teacher_forced_logprobs(
        policy.config, params, rows, lora_scale=lora_scale, temperature=run.rollout.temperature,
        min_rows=min_rows, mesh=policy.mesh, micro_batches=run.loss.micro_batches, chunk_size=run.loss.chunk_size,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------- sampling
def sample_rows(
    run: TrainConfig, policy: Policy, params: Params, prompts, key, *, lora_scale: float, n: int | None = None
):  # fmt: skip
    """``n`` (default ``group_size``) rollouts per prompt, packed into fixed-shape rows (from ``policy.engine``
    when set)."""
    options = dict(
        key=key, n=n or run.rollout.group_size, max_new_tokens=run.rollout.max_new_tokens,
        temperature=run.rollout.temperature, top_p=run.rollout.top_p, top_k=run.rollout.top_k,
        eos_token_ids=policy.eos_ids, lora_scale=lora_scale,
    )  # fmt: skip
    if policy.engine is not None:  # syncs params (merged with the adapter when lora_scale != 0) first
        sample = policy.engine.generate_arrays(params, prompts, **options)
    else:
        sample = generate_arrays(policy.config, params, prompts, mesh=policy.mesh, **options)
    rows = rollout.pack_samples(prompts, sample, run.data.max_prompt_tokens)
    rows["sampler_logp"] = np.concatenate(
        [np.zeros((len(prompts) * sample.n, run.data.max_prompt_tokens), np.float32), sample.logprobs], axis=1
    )
    return rows


def score_rows(run: TrainConfig, policy: Policy, pool, rows: dict, golds: list[str], *, per_row: bool = False) -> None:
    """Add ``accuracy`` (0/1, the verifier) and ``reward`` (accuracy + overlong penalty) to ``rows``.

    ``golds`` holds one answer per group of ``group_size`` rows, or one per row with ``per_row``.
    """
    texts = rollout.decode_responses(policy.tokenizer, rows, run.data.max_prompt_tokens)
    group_golds = list(golds) if per_row else [golds[i // run.rollout.group_size] for i in range(len(texts))]
    rows["accuracy"] = np.asarray(pool.score(texts, group_golds), np.float32)
    shaped = rewards.shaped_rewards(
        rows["accuracy"], rows["lengths"], max_len=run.rollout.max_new_tokens,
        buffer=min(run.reward.overlong_buffer, run.rollout.max_new_tokens), factor=run.reward.overlong_factor,
    )  # fmt: skip
    rows["reward"] = np.asarray(shaped.reward, np.float32)


# ------------------------------------------------------------------------------------------- scaffold
def run_scaffold(
    run: TrainConfig, policy: Policy, state: TrainState, pool, rows: dict, batch_examples, key, phases, valid=None
):  # fmt: skip
    """Fit a fresh adapter on the cliffs' solutions, re-roll them, splice verified successes into ``rows``.

    Returns ``(rows, spliced_rows, metrics)``; cliff groups whose prompt has no worked solution are
    skipped by the scaffold and counted in ``scaffold_no_solution``. ``valid`` marks the rows of groups
    smaller than ``group_size`` (the rest is padding, never a cliff's failed row nor spliced into).
    """
    k = run.rollout.group_size
    cliffs = scaffold.find_cliffs(rows["accuracy"], k, valid)
    has_solution = np.array([ex.solution_ids is not None for ex in batch_examples])
    usable = cliffs & has_solution
    metrics = {"cliff_groups": int(cliffs.sum()), "scaffold_no_solution": int((cliffs & ~has_solution).sum()),
               "scaffold_attempted": int(usable.sum()) if run.scaffold.enabled else 0}  # fmt: skip
    if not run.scaffold.enabled or not usable.any():
        return rows, np.zeros(len(rows["accuracy"]), bool), metrics
    cliff_examples = [batch_examples[g] for g in np.flatnonzero(usable)]
    adapter_key, reroll_key = jax.random.split(key)
    with phases("sft"):
        params, opt_state = optim.reset_adapter(
            policy.config, state.params, state.opt_state, adapter_key, sft=run.scaffold.sft
        )
        state.params, state.opt_state = place_state(run, policy, params, opt_state)
        prompts, solutions = [ex.prompt_ids for ex in cliff_examples], [ex.solution_ids for ex in cliff_examples]
        # Rows as long as these cliffs need (a power of two), not the configured maxima: short worked solutions
        # would otherwise pay for max_prompt_tokens + max_solution_tokens of attention and MLP per row.
        lengths = rollout.sft_slots(prompts, solutions, run.data.max_prompt_tokens, run.data.max_solution_tokens)
        sft_batch = rollout.pack_sft(prompts, solutions, *lengths)
        slots = max(len(cliff_examples), run.scaffold.min_cliff_bucket)
        sft_batch = rollout.pad_rows(sft_batch, rollout.pow2_rows(slots))
        for _ in range(run.scaffold.sft_steps):
            sft_metrics = apply_sft_update(run, policy, state, sft_batch)
        metrics["sft_loss"] = float(sft_metrics["sft_loss"])
    with phases("reroll"):
        padding = [prompts[0]] * (slots - len(prompts))  # sampled, then dropped: only fixes the shape
        rerolls = sample_rows(run, policy, state.params, prompts + padding, reroll_key, lora_scale=1.0)
        rerolls = {name: value[: len(prompts) * k] for name, value in rerolls.items()}
    with phases("reward"):
        score_rows(run, policy, pool, rerolls, [ex.answer for ex in cliff_examples])
    with phases("logprob"):
        # The spliced rows' importance-ratio denominator: the adapter-on policy that sampled them.
        rerolls["old_logp"] = logprobs(run, policy, state.params, rerolls, lora_scale=1.0, min_rows=slots * k)
    spliced, spliced_rows, stats = scaffold.splice(rows, rerolls, usable, k, valid)
    metrics.update(
        surpassed_groups=stats.num_surpassed,
        spliced_rows=stats.num_spliced,
        rescue_pass_rate=stats.reroll_pass_rate,
        surpass_rate=stats.surpass_rate,  # over the cliff groups the scaffold attempted, as in the summary
        rerolls=stats.num_rerolls,
        rerolls_passed=stats.num_passing_rerolls,
    )
    return spliced, spliced_rows, metrics


# ----------------------------------------------------------------------------------------------- step
@dataclasses.dataclass
class Sampled:
    """A step's rollouts sampled and scored beforehand (a prompt sampler's draw rounds): packed ``rows`` in
    ``group_size`` slots per prompt, ``valid`` marking the slots that hold a rollout, the phases' seconds."""

    rows: dict
    valid: np.ndarray
    seconds: dict[str, float]


def train_step(
    run: TrainConfig, policy: Policy, state: TrainState, pool, batch_examples, key, *,
    sampled: Sampled | None = None, before_update=None, stop=None,
) -> dict[str, Any]:  # fmt: skip
    """One RL step on ``batch_examples`` (B prompts); updates ``state`` in place and returns its metrics.

    ``sampled``: the step's rollouts, already sampled and scored (else ``group_size`` per prompt are sampled
    here). ``before_update(batch) -> metrics`` sees the RL batch just before the update (which donates the
    params), e.g. to score its prompts against a target set. ``stop``: see ``Phases``; a step abandoned by it
    raises ``StepAbandoned`` with ``state``'s base, RL optimizer state and counters as they came in (the
    scaffold's adapter, reset every step, may have moved).
    """
    phases = Phases(stop)
    engine_sync_before = policy.engine.stats["sync_s_total"] if policy.engine is not None else 0.0
    sample_key, scaffold_key = jax.random.split(key)
    prompts = [ex.prompt_ids for ex in batch_examples]
    valid = None
    if sampled is None:
        with phases("sample"):
            rows = sample_rows(run, policy, state.params, prompts, sample_key, lora_scale=0.0)
        with phases("reward"):
            score_rows(run, policy, pool, rows, [ex.answer for ex in batch_examples])
    else:
        rows, valid = sampled.rows, sampled.valid
        for name, seconds in sampled.seconds.items():
            phases.seconds[name] += seconds
    base_metrics = _rollout_metrics(run, rows, valid)
    # Placeholder so splice carries a spliced row's adapter-on log-probs; base rows are filled below.
    rows["old_logp"] = np.zeros(rows["tokens"].shape, np.float32)
    rows, spliced_rows, scaffold_metrics = run_scaffold(
        run, policy, state, pool, rows, batch_examples, scaffold_key, phases, valid
    )
    with phases("logprob"):
        base_logp = logprobs(run, policy, state.params, rows, lora_scale=0.0)
    spliced_ratio = _spliced_ratio_mean(base_logp, rows, spliced_rows)
    engine_metrics = {}
    if policy.engine is not None:
        engine_metrics = _engine_metrics(policy.engine, engine_sync_before, base_logp, rows, spliced_rows)
    rows["old_logp"] = np.where(spliced_rows[:, None], rows["old_logp"], base_logp)
    advantages = np.asarray(losses.group_advantages(jnp.asarray(rows["reward"]), run.rollout.group_size, valid=valid))
    judge_metrics = {}
    if run.first_mistake.enabled:
        with phases("judge"):
            advantages, judge_metrics = judge_advantages(
                run, policy, state, pool, rows, batch_examples, advantages, valid
            )
    with phases("update"):
        batch = {k: rows[k] for k in ("tokens", "attention_mask", "mask", "old_logp")}
        batch["advantages"] = advantages
        extra_metrics = before_update(batch) if before_update is not None else {}
        # The rate this update is taken at: the schedule's count is the updates applied so far (a non-finite
        # update is skipped whole, its optimizer state included).
        lr = optim.learning_rate(run.optim, state.step - state.nonfinite_total)
        update_metrics = apply_rl_update(run, policy, state, batch)
    finite = bool(update_metrics.pop("finite"))
    state.nonfinite_in_row = 0 if finite else state.nonfinite_in_row + 1
    state.nonfinite_total += int(not finite)
    state.step += 1
    return {
        "step": state.step,
        **base_metrics,
        "surpassed_groups": 0,
        "spliced_rows": 0,
        "rescue_pass_rate": None,
        "rerolls": 0,
        "rerolls_passed": 0,
        **scaffold_metrics,
        "lr": lr,
        "spliced_ratio_mean": spliced_ratio,
        "spliced_accuracy_mean": float(rows["accuracy"].mean()),
        "clip_frac_low": update_metrics.get("clip_frac_low"),
        "clip_frac_high": update_metrics.get("clip_frac_high"),
        "entropy": update_metrics.get("entropy"),
        "loss": update_metrics.get("loss"),
        "grad_norm": update_metrics.get("grad_norm"),
        "update_skipped": not finite,
        "nonfinite_total": state.nonfinite_total,
        **{k: v for k, v in update_metrics.items() if k.startswith(("ratio", "approx_kl"))},
        **engine_metrics,
        **judge_metrics,
        **extra_metrics,
        **phases.seconds,
    }


def judge_advantages(
    run: TrainConfig, policy: Policy, state: TrainState, pool, rows: dict, batch_examples, outcome, valid=None
):  # fmt: skip
    """``[rows, length]`` first-mistake token advantages of the (spliced) batch and the judge's metrics.

    A teacher names the first wrong sentence of each failed rollout in a mixed group; see ``first_mistake``.
    When the policy judges itself (``judge_path: null``) it judges with this step's weights.
    """
    from lspo_jax.first_mistake import SamplerGenerate, first_mistake_advantages

    if run.first_mistake.judge_path is None and isinstance(policy.judge.generate, SamplerGenerate):
        policy.judge.generate.params = {"base": state.params["base"]}
    slots = run.data.max_prompt_tokens
    return first_mistake_advantages(
        problems=[ex.problem for ex in batch_examples], golds=[ex.answer for ex in batch_examples],
        references=[ex.solution for ex in batch_examples],
        response_texts=rollout.decode_responses(policy.tokenizer, rows, slots),
        response_ids=[t[slots : slots + int(n)].tolist() for t, n in zip(rows["tokens"], rows["lengths"], strict=True)],
        response_mask=rows["mask"], truncated=(~rows["eos"]) & (rows["lengths"] >= run.rollout.max_new_tokens),
        accuracy=rows["accuracy"], outcome_adv=outcome, group_size=run.rollout.group_size, score=pool.score,
        judge=policy.judge, tokenizer=policy.tokenizer, config=run.first_mistake, valid=valid,
    )  # fmt: skip


def _rollout_metrics(run: TrainConfig, rows: dict, valid: np.ndarray | None = None) -> dict[str, float]:
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


def _engine_metrics(engine, sync_before: float, base_logp: np.ndarray, rows: dict, spliced_rows: np.ndarray):
    """``vllm_sync_seconds`` (weight pushes in this step) and how far the engine's log-probs of its sampled
    tokens are from the trainer's teacher-forced base log-probs, on the rows the base policy sampled."""
    from lspo_jax.vllm_sampler import logprob_mismatch

    mask = (rows["mask"] > 0) & ~spliced_rows[:, None]
    return {
        "vllm_sync_seconds": engine.stats["sync_s_total"] - sync_before,
        **logprob_mismatch(base_logp, rows["sampler_logp"], mask),
    }


def _spliced_ratio_mean(base_logp: np.ndarray, rows: dict, spliced_rows: np.ndarray) -> float | None:
    """Token-mean of ``pi_theta / pi_theta+phi`` over spliced rows: how off-policy the rescued rows are."""
    if not spliced_rows.any():
        return None
    mask = rows["mask"][spliced_rows] > 0
    log_ratio = base_logp[spliced_rows] - rows["old_logp"][spliced_rows]
    return float(np.exp(log_ratio[mask]).mean())


class StopFlag:
    """Set by SIGTERM/SIGINT: the loop abandons its step at the next phase (or finishes it once its update has
    begun), writes a checkpoint and exits cleanly."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        """Whether any process of the job was asked to stop. Every process gets the same answer, so they all
        leave the loop at the same point: a scheduler's signals reach the hosts at slightly different times,
        and one host leaving a collective the others entered would hang them. Each call is a collective when
        there are several processes: call it at the same points on all of them."""
        if jax.process_count() == 1:
            return self.requested
        flags = multihost_utils.process_allgather(np.asarray(self.requested, np.int32))
        return bool(np.any(flags))

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
