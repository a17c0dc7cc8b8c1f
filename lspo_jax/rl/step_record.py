"""A training step's record beyond its counts: the sampled rollouts' means (``rollout_metrics``, ``reward_record``),
how the log-probs the update reads compare (the sampler's with the trainer's: ``sampler_gap``, ``engine_metrics``;
the spliced rows' adapter-on with the base's: ``spliced_diagnostics``, ``adapter_reliance``), the update's metrics
(``update_metrics``) and the rates derived from the counts where they are reported (``step_rates``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from lspo_jax.rl import scaffold
from lspo_jax.rl.learner import Learner
from lspo_jax.rl.packing import Rows
from lspo_jax.train_config import TrainConfig


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


def sync_totals(learner: Learner) -> tuple[float, int]:
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


def engine_metrics(
    learner: Learner, sync_before: tuple[float, int], base_logp: np.ndarray, rows: Rows, spliced_rows: np.ndarray
):  # fmt: skip
    """``rollout/sync_s`` and ``rollout/sync_host_bytes`` (the weight pushes of this step: seconds, and bytes copied
    through the host rather than handed over on the device), how far the engine's log-probs of its sampled tokens are
    from the trainer's teacher-forced base log-probs on the rows the base policy sampled, and the engines that
    sampled (``rollout/engines``, ``rollout/engine_prompts``: the busiest engine's prompts this step)."""
    from lspo_jax.rollout.vllm_sampler import logprob_mismatch

    mask = (rows["mask"] > 0) & ~spliced_rows[:, None]
    seconds, host_bytes = sync_totals(learner)
    return {
        "rollout/sync_s": seconds - sync_before[0],
        "rollout/sync_host_bytes": host_bytes - sync_before[1],
        **logprob_mismatch(base_logp, rows["sampler_logp"], mask),
        **learner.engine_record(),
    }


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
