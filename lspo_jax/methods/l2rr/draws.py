"""Learning-to-reweight rollout (L2RR): a target-guided prompt sampler that also allocates the rollouts.

Instead of drawing source prompts uniformly, L2RR keeps weights ``w_i`` over the N source prompts, learns
them from a small held-out *target* set, and spends fewer rollouts on prompts that keep yielding
zero-variance groups (all K answers fail, or all pass: every advantage is 0, the rollouts are wasted).

Weights (exponentiated gradient). After each step, for every prompt i drawn in it (used in the update or not)::

    s_i      = t_i + waste_weight * v_i
    log w_i += eta_t * s_i,             then renormalise over all N prompts (others keep their w)
    eta_t    = a / sqrt(horizon)        (or a / sqrt(t) for the t-th update when horizon is None)

*Target signal* ``t_i``: the directional derivative ``d_i = <g_tgt, g_i>``, ``g_i = grad L_i`` the gradient of
prompt i's policy loss and ``g_tgt = grad L_tgt`` that of the target loss, both w.r.t. the base params
(adapter off, as in ``optim.rl_step``). Sign convention: these are gradients of *losses*, so a small step on
prompt i, ``theta - lr * g_i``, changes the target loss by ``-lr * d_i`` to first order: a prompt whose
gradient aligns with ``g_tgt`` lowers the target loss, and a larger ``d_i`` earns a larger weight. Relative to
the batch-mean gradient, ``<g_tgt, g_i - g_mean> = d_i - mean_j d_j`` (mean over the scored prompts), so only
the vector of ``d_i`` is needed; a prompt left out of the update is unscored and gets ``t_i = 0``. The scale
of ``d`` follows the gradients' (model size, learning stage), so it is divided by its spread over the batch
(``normalise``): ``std`` (population std, the default: signals of order 1, so ``a`` is a step size in
standard deviations), ``max_abs`` (signals in [-1, 1]) or ``none``. A batch whose scores are all equal
carries no preference and gives ``t_i = 0``.

*Waste penalty* ``v_i = -(1 - p_e ** z_i)``, where ``z_i`` counts the prompt's consecutive zero-variance
groups *including this step's*: the streak is updated first (``z_i + 1`` on a zero-variance group, 0
otherwise), so a prompt that just gave a useful group is not penalised at all.

Rollout allocation per draw round of B prompts (``allocate``)::

    s_bar = mean_i p_e ** z_i                        p_e ** z_i: a chance-like score that prompt i's next
                                                     group is not degenerate, averaged over the round
    RO    = round(B * G * clip(s_bar, rho_min, 1))   the round's budget, half rounds up
    n_i  in [g_min, G], sum n_i = RO, n_i as close as possible to proportional to w_i ** alloc_power

The real-valued split is ``clip(c * w_i ** alloc_power, g_min, G)`` with c found exactly (the sum is
piecewise linear in c), then rounded by largest remainder (ties to the earlier prompt), which keeps the total
and never leaves ``[g_min, G]``. A budget below ``B * g_min`` (``rho_min * G < g_min``) is raised to it, so
every prompt gets ``g_min``; it cannot exceed ``B * G`` (the clip at 1). A group of ``n_i < G`` rollouts fills
``n_i`` of its K = G slots; ``losses.group_advantages(..., valid=...)`` normalises it over those alone.

Drawing: prompts are drawn without replacement within a step, with probability proportional to ``w``
(optionally mixed with the uniform, ``explore``), by the Gumbel-top-k trick, which draws exactly what
sequential sampling without replacement does. ``rl.rounds.collect_batch`` repeats draw rounds until B *usable*
prompts are collected or ``max_draw_rounds`` is reached; every allocated rollout counts as spent.

Per-prompt policy loss (``PolicyLosses``): prompt i's rows of the RL batch under ``losses.policy_loss``,
as a token-mean over its *own* response tokens (``prompt_loss_norm: prompt``, the default: a prompt's score
does not depend on how long the other prompts' answers were) or over the batch's (``batch``: then the
per-prompt losses sum to the batch's policy loss, and ``g_i`` is prompt i's share of the actual update).
The whole vector ``d`` is one forward-mode product (``jax.jvp`` of params -> ``[B]`` along ``g_tgt``), not one
backward pass per prompt. Target loss (``target_loss``): the NLL of the target prompts' worked solutions
(``losses.sft_loss``), as one token-mean over all target tokens (``nll_token_mean``) or as the mean over
examples of each one's token-mean (``nll_example_mean``, so long solutions do not dominate). The target side
(``target.TargetSide``) only ever returns the ``d_i``; its prompts never reach the trainer.

A training step with L2RR (``prompts.L2RRPrompts`` runs it; this module provides the pieces)::

    rng   = np.random.default_rng([seed, step])              # resumable: a function of the step
    drawn = collect_batch(sampler, B, rng, run_round, config.max_draw_rounds)
    # run_round(indices, rollouts) samples rollouts[j] answers of prompt indices[j] into K slots (the rest
    # padding), scores them and returns (zero_variance, usable) per prompt.
    # ... advantages with valid=..., scaffold, then BEFORE the update (the RL step donates the params):
    scores = target.directional_derivatives(params, PolicyLosses(...).bind(batch))
    # after the step:
    sampler.observe(drawn.indices, drawn.zero_variance, drawn.scores_for_observe(scores))

With LSPO: cliffs (all K rollouts fail) are exactly the zero-variance groups this sampler learns to avoid.
Pass the *base* rollouts' zero variance (before any splice), so the streaks measure what the base policy
wastes; mark cliffs the scaffold can rescue as usable, so the scaffold still rescues the cliffs that are
drawn, and their scores (computed on the spliced batch) credit a rescue that helps the target.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from lspo_jax.methods.l2rr.config import L2RRConfig


# -------------------------------------------------------------------------------------- the arithmetic
def waste_penalty(zero_streak: np.ndarray, p_e: float) -> np.ndarray:
    """``v_i = -(1 - p_e ** z_i)``: 0 after a useful group, approaching -1 as the streak grows."""
    return -(1.0 - np.power(float(p_e), np.asarray(zero_streak, np.float64)))


def target_signal(scores: np.ndarray, normalise: str) -> np.ndarray:
    """``t_i = (d_i - mean d) / scale`` over the finite ``d_i``; NaN (unscored) and no-spread batches give 0.

    ``scale`` is the population std of the centred scores (``std``), their largest magnitude
    (``max_abs``) or 1 (``none``).
    """
    scores = np.asarray(scores, np.float64)
    signal = np.zeros_like(scores)
    scored = np.isfinite(scores)
    if not scored.any():
        return signal
    centred = scores[scored] - scores[scored].mean()
    spread = np.abs(centred).max()
    # Scores equal up to float rounding would otherwise be blown up to +-1 by the normalisation.
    if spread <= 1e-9 * np.abs(scores[scored]).max():
        return signal
    signal[scored] = centred / {"std": centred.std(), "max_abs": spread, "none": 1.0}[normalise]
    return signal


def allocation_budget(survival: np.ndarray, group_size: int, rho_min: float, g_min: int) -> int:
    """``RO = round(B * G * clip(mean(survival), rho_min, 1))``, kept within ``[B * g_min, B * G]``."""
    count = len(survival)
    fraction = float(np.clip(np.mean(survival), rho_min, 1.0)) if count else 1.0
    budget = math.floor(count * group_size * fraction + 0.5)
    return int(np.clip(budget, count * g_min, count * group_size))


def split_budget(priority: np.ndarray, total: int, low: int, high: int) -> np.ndarray:
    """Integers ``n_i`` in ``[low, high]`` summing to ``total``, as near to proportional to ``priority``.

    The real split is ``x_i = clip(c * priority_i, low, high)`` with ``sum x = total``; rounding is by largest
    remainder, ties to the earlier entry.
    """
    priority = np.asarray(priority, np.float64)
    if not len(priority) * low <= total <= len(priority) * high:
        raise ValueError(f"a total of {total} does not split into {len(priority)} counts in [{low}, {high}]")
    if not len(priority):
        return np.zeros(0, np.int64)
    return _largest_remainder(_capped_shares(priority, total, low, high), total, low, high)


def _capped_shares(priority: np.ndarray, total: int, low: int, high: int) -> np.ndarray:
    if not np.all(np.isfinite(priority)) or np.any(priority < 0):
        raise ValueError(f"priorities must be finite and >= 0, got {priority}")
    top = priority.max()
    # Scaled to max 1, and kept off zero so that every knot below is finite; a zero priority stays at low.
    p = np.maximum(priority / top, 1e-300) if top > 0 else np.ones_like(priority)
    # sum_i clip(c p_i, low, high) is continuous, non-decreasing and linear between these knots in c.
    knots = np.unique(np.concatenate([low / p, high / p]))
    sums = np.clip(knots[:, None] * p[None, :], low, high).sum(axis=1)
    j = int(np.searchsorted(sums, total))
    if sums[j] == total:
        c = knots[j]
    else:  # sums[j - 1] < total < sums[j]: interpolate on the linear piece
        c = knots[j - 1] + (total - sums[j - 1]) * (knots[j] - knots[j - 1]) / (sums[j] - sums[j - 1])
    return np.clip(c * p, low, high)


def _largest_remainder(share: np.ndarray, total: int, low: int, high: int) -> np.ndarray:
    # The 1e-9 absorbs float error so that a share of 2.9999999999 counts as the 3 it is.
    counts = np.clip(np.floor(share + 1e-9), low, high).astype(np.int64)
    short = total - int(counts.sum())
    remainder = share - counts
    # Enough entries below high (above low) always exist: low * B <= total <= high * B.
    if short > 0:
        order = np.argsort(-remainder, kind="stable")
        counts[order[counts[order] < high][:short]] += 1
    elif short < 0:
        order = np.argsort(remainder, kind="stable")
        counts[order[counts[order] > low][:-short]] -= 1
    return counts


# -------------------------------------------------------------------------------------------- samplers
class PromptSampler(abc.ABC):
    """Which source prompts a step draws, and how many rollouts each gets.

    Per step: ``draw`` and ``allocate`` once per draw round (without replacement within the step; the
    counts ``allocate`` returns are charged as spent), then ``observe`` once, which ends the step.
    ``state_dict`` is JSON-able and restores through ``load_state_dict``; ``metrics`` is for the run's log.
    """

    kind = ""

    def __init__(self, num_prompts: int, group_size: int, *, top_k: int = 0):
        if num_prompts < 1:
            raise ValueError("no source prompts to sample from")
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are normalised per group), got {group_size}")
        self.num_prompts, self.group_size, self.top_k = num_prompts, group_size, top_k
        self._drawn: list[int] = []  # this step's prompts so far
        self._pending = 0  # rollouts allocated this step
        self.rollouts_step = 0
        self.rollouts_total = 0
        self.effective_ratio: float | None = None

    @abc.abstractmethod
    def draw(self, count: int, rng: np.random.Generator | None = None) -> np.ndarray:
        """``count`` prompt indices ``[count]`` int64, none drawn earlier in this step."""

    @abc.abstractmethod
    def allocate(self, indices: np.ndarray) -> np.ndarray:
        """Rollouts per prompt ``[len(indices)]`` int64, each in ``[1, group_size]``; charged as spent."""

    @abc.abstractmethod
    def weights(self) -> np.ndarray:
        """The sampling weights ``w`` ``[N]`` (sum 1)."""

    def observe(self, indices: np.ndarray, zero_variance: np.ndarray, target_scores: np.ndarray | None = None) -> None:
        """End the step: every prompt drawn in it, whether its group had zero variance, and its ``d_i``.

        ``target_scores`` (aligned with ``indices``) holds ``<g_tgt, g_i>`` or NaN for prompts not scored
        (not in the update batch); None when there is no target signal this step.
        """
        indices, zero_variance = _check_observation(self.num_prompts, indices, zero_variance, target_scores)
        self._update(indices, zero_variance, target_scores)
        self.rollouts_step, self._pending = self._pending, 0
        self.rollouts_total += self.rollouts_step
        self.effective_ratio = float(1.0 - zero_variance.mean()) if len(indices) else None
        self._drawn = []

    @abc.abstractmethod
    def _update(self, indices: np.ndarray, zero_variance: np.ndarray, target_scores: np.ndarray | None) -> None:
        """What a step's observation changes besides the bookkeeping."""

    def remaining(self) -> int:
        """Prompts not yet drawn in this step."""
        return self.num_prompts - len(self._drawn)

    def _charge(self, counts: np.ndarray) -> np.ndarray:
        self._pending += int(counts.sum())
        return counts

    def _bookkeeping(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_prompts": self.num_prompts,
            "drawn": list(self._drawn),
            "pending": self._pending,
            "rollouts_step": self.rollouts_step,
            "rollouts_total": self.rollouts_total,
            "effective_ratio": self.effective_ratio,
        }

    def _load_bookkeeping(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind or state.get("num_prompts") != self.num_prompts:
            raise ValueError(
                f"sampler state of kind {state.get('kind')!r} over {state.get('num_prompts')} prompts does not "
                f"fit a {self.kind!r} sampler over {self.num_prompts}"
            )
        self._drawn = [int(i) for i in state["drawn"]]
        self._pending = int(state["pending"])
        self.rollouts_step, self.rollouts_total = int(state["rollouts_step"]), int(state["rollouts_total"])
        ratio = state["effective_ratio"]
        self.effective_ratio = None if ratio is None else float(ratio)

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly, as JSON-able values."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def metrics(self) -> dict[str, Any]:
        """Weight entropy (nats, and over its maximum log N), the weights' effective sample size over N, the
        top-weighted prompts, the share of last step's prompts with non-degenerate groups, rollouts spent."""
        w = self.weights()
        entropy = float(-np.sum(w[w > 0] * np.log(w[w > 0])))
        top = np.argsort(-w, kind="stable")[: self.top_k]
        return {
            "sampler/weight_entropy": entropy,
            "sampler/weight_entropy_ratio": entropy / math.log(self.num_prompts) if self.num_prompts > 1 else 1.0,
            "sampler/weight_ess_ratio": float(1.0 / (self.num_prompts * np.sum(w * w))),
            "sampler/top_prompts": [int(i) for i in top],
            "sampler/top_weights": [float(x) for x in w[top]],
            "sampler/effective_prompt_ratio": self.effective_ratio,
            "sampler/rollouts_step": self.rollouts_step,
            "sampler/rollouts_total": self.rollouts_total,
        }


def _check_observation(num_prompts, indices, zero_variance, target_scores) -> tuple[np.ndarray, np.ndarray]:
    indices = np.asarray(indices, np.int64)
    zero_variance = np.asarray(zero_variance, bool)
    if indices.ndim != 1 or zero_variance.shape != indices.shape:
        raise ValueError(f"indices {indices.shape} and zero_variance {zero_variance.shape} must be equal 1-D")
    if target_scores is not None and np.shape(target_scores) != indices.shape:
        raise ValueError(f"target_scores {np.shape(target_scores)} must align with indices {indices.shape}")
    if len(np.unique(indices)) != len(indices) or np.any((indices < 0) | (indices >= num_prompts)):
        raise ValueError("indices must be distinct prompts in [0, num_prompts)")
    return indices, zero_variance


class L2RRSampler(PromptSampler):
    """Prompts drawn in proportion to learned weights, rollouts allocated by weight and waste (module doc).

    ``draw`` needs a ``numpy.random.Generator``; derive it from the run's seed and the step so that a resumed
    run draws what an uninterrupted one would.
    """

    kind = "l2rr"

    def __init__(self, num_prompts: int, group_size: int, config: L2RRConfig):
        super().__init__(num_prompts, group_size, top_k=config.top_k)
        if config.g_min > group_size:
            raise ValueError(f"L2RRConfig.g_min={config.g_min} exceeds the group size {group_size}")
        self.config = config
        # Log-weights: repeated multiplicative updates would underflow plain weights of unlucky prompts.
        self.log_w = np.full(num_prompts, -math.log(num_prompts))
        self.zero_streak = np.zeros(num_prompts, np.int64)
        self.updates = 0
        self.last_eta: float | None = None
        self.last_budget_fraction: float | None = None

    def weights(self) -> np.ndarray:
        return np.exp(self.log_w)

    def draw(self, count: int, rng: np.random.Generator | None = None) -> np.ndarray:
        if not isinstance(rng, np.random.Generator):
            raise ValueError("L2RRSampler.draw needs a numpy.random.Generator")
        if not 0 <= count <= self.remaining():
            raise ValueError(f"cannot draw {count} prompts: {self.remaining()} are left in this step")
        log_q = self.log_w
        if self.config.explore > 0:
            log_q = np.log((1.0 - self.config.explore) * self.weights() + self.config.explore / self.num_prompts)
        # Gumbel-top-k: the top `count` of log q_i + Gumbel noise are a draw without replacement, in order,
        # exactly as sequential sampling from q renormalised after each pick.
        keys = log_q + rng.gumbel(size=self.num_prompts)
        keys[self._drawn] = -np.inf
        indices = np.argsort(-keys, kind="stable")[:count].astype(np.int64)
        self._drawn.extend(int(i) for i in indices)
        return indices

    def allocate(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, np.int64)
        cfg = self.config
        survival = np.power(cfg.p_e, self.zero_streak[indices].astype(np.float64))
        budget = allocation_budget(survival, self.group_size, cfg.rho_min, cfg.g_min)
        self.last_budget_fraction = budget / max(len(indices) * self.group_size, 1)
        # Relative to the batch's largest weight, so that tiny weights do not underflow when raised.
        log_w = self.log_w[indices]
        priority = np.exp(cfg.alloc_power * (log_w - log_w.max())) if len(indices) else log_w
        return self._charge(split_budget(priority, budget, cfg.g_min, self.group_size))

    def _update(self, indices: np.ndarray, zero_variance: np.ndarray, target_scores: np.ndarray | None) -> None:
        cfg = self.config
        self.zero_streak[indices] = np.where(zero_variance, self.zero_streak[indices] + 1, 0)
        signal = np.zeros(len(indices)) if target_scores is None else target_signal(target_scores, cfg.normalise)
        score = signal + cfg.waste_weight * waste_penalty(self.zero_streak[indices], cfg.p_e)
        self.last_eta = cfg.step_size(self.updates)
        self.log_w[indices] += self.last_eta * score
        self.log_w -= _logsumexp(self.log_w)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._bookkeeping(),
            "log_w": [float(x) for x in self.log_w],  # Python floats round-trip JSON exactly
            "zero_streak": [int(z) for z in self.zero_streak],
            "updates": self.updates,
            "last_eta": self.last_eta,
            "last_budget_fraction": self.last_budget_fraction,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_bookkeeping(state)
        self.log_w = np.asarray(state["log_w"], np.float64).copy()
        self.zero_streak = np.asarray(state["zero_streak"], np.int64).copy()
        if self.log_w.shape != (self.num_prompts,) or self.zero_streak.shape != (self.num_prompts,):
            raise ValueError(f"log_w and zero_streak must hold {self.num_prompts} entries")
        self.updates = int(state["updates"])
        self.last_eta, self.last_budget_fraction = state["last_eta"], state["last_budget_fraction"]

    def metrics(self) -> dict[str, Any]:
        """The common metrics, the last step size and budget fraction, and the prompts on a zero streak."""
        return {
            **super().metrics(),
            "sampler/eta": self.last_eta,
            "sampler/budget_fraction": self.last_budget_fraction,
            "sampler/prompts_on_zero_streak": int(np.count_nonzero(self.zero_streak)),
        }


def _logsumexp(x: np.ndarray) -> float:
    top = x.max()
    return float(top + np.log(np.sum(np.exp(x - top))))
