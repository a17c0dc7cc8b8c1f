"""Loss math of GRPO/DAPO and LSPO as pure functions of arrays.

Conventions shared by every function here:
    * ``mask`` is ``[B, T]`` (bool or 0/1) and marks the tokens that count (response tokens for the policy
      loss, target tokens for SFT). Masked positions never influence a value or a gradient: they are removed
      with ``jnp.where`` *before* any ``exp`` or product, so garbage log-probs at pad positions cannot leak
      NaN or inf into the gradient (``0 * inf`` would).
    * Token-means divide by ``num_tokens``, which defaults to this batch's ``mask.sum()``. Micro-batched
      accumulation passes the *global* count so that summing micro-batch losses gives one token-mean over
      the whole batch (DAPO's token-level loss), see ``accumulate_gradients``.
    * Log-probs are those of the sampling distribution ``softmax(logits / temperature)``, in float32, in
      the sampler and the trainer alike (``logprobs.token_logprobs``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lspo_jax import options
from lspo_jax.rl.logprobs import split_rows

Metrics = dict[str, jax.Array]


# ----------------------------------------------------------------------------------------- advantages
def group_advantages(
    rewards: jax.Array,
    group_size: int,
    eps: float = 1e-6,
    valid: jax.Array | None = None,
    *,
    estimator: str | Callable = "std",
) -> jax.Array:
    """Group-relative advantages; by default group-normalised, ``A_i = (r_i - mean_g) / (std_g + eps)``.

    ``estimator`` (a name of ``ESTIMATORS``), over a group of n rewards with mean m:

        std        (r_i - m) / (std + eps)                    GRPO / DAPO; std with Bessel's correction
        mean_only  r_i - m                                     Dr. GRPO: no division by the std
        loo        r_i - (sum_j r_j - r_i) / (n - 1)           leave-one-out (RLOO): the mean of the others,
                   = n / (n - 1) * (r_i - m)                   an unbiased baseline; n < 2 gives 0

    Rows are grouped consecutively: rows ``0 .. K-1`` are the K rollouts of prompt 0, and so on. ``std_g``
    uses Bessel's correction (``ddof=1``), as DAPO/verl do. A group whose rewards are all equal (every
    cliff) gives exactly 0, not a rounding residue of ``r - mean(r)``; ``group_size == 1`` gives zeros.

    Groups of unequal size sit in the same fixed K slots with ``valid``: a row that is not valid is padding,
    gets advantage 0 and is left out of its group's mean, std and equal-rewards test, so a group of n valid
    rows is normalised exactly as a group of size n would be (``ddof=1`` over n); n < 2 gives zeros.

    Args:
        rewards: ``[N]`` rewards, ``N`` a multiple of ``group_size``.
        group_size: K, rollouts per prompt (slots per prompt when ``valid`` is given).
        eps: added to the standard deviation (``std`` only).
        valid: optional ``[N]`` bool, False on padding rows; None treats every row as valid.
        estimator: ``std``, ``mean_only`` or ``loo``, or the function ``ESTIMATORS`` files under one.

    Returns:
        ``[N]`` float32 advantages.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {rewards.shape}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"len(rewards)={rewards.shape[0]} is not a multiple of group_size={group_size}")
    if valid is not None and jnp.shape(valid) != rewards.shape:
        raise ValueError(f"valid must have the shape of rewards {rewards.shape}, got {jnp.shape(valid)}")
    advantages = ESTIMATORS.resolve(estimator)
    if group_size == 1:
        return jnp.zeros_like(rewards)  # the sample std of one value is undefined; no signal either way
    r_GK = rewards.reshape(-1, group_size)
    valid_GK = None if valid is None else jnp.asarray(valid, bool).reshape(r_GK.shape)
    return advantages(r_GK, valid_GK, eps).reshape(-1)


# Each estimator maps ``[G, K]`` rewards, the valid slots (None: all) and eps to ``[G, K]`` advantages.
ESTIMATORS = options.Registry(options.Estimator, "advantage estimator")


@ESTIMATORS.register("std")
def std_advantages(r_GK: jax.Array, valid_GK: jax.Array | None, eps: float) -> jax.Array:
    """GRPO's ``(r - mean) / (std + eps)``."""
    adv_GK = _full_group_advantages(r_GK, eps)
    if valid_GK is None:
        return adv_GK
    # Full groups keep the unmasked arithmetic: XLA may round the masked reductions differently.
    full_G1 = jnp.all(valid_GK, axis=1, keepdims=True)
    return jnp.where(full_G1, adv_GK, _masked_group_advantages(r_GK, valid_GK, eps))


@ESTIMATORS.register("mean_only")
def mean_only_advantages(r_GK: jax.Array, valid_GK: jax.Array | None, eps: float) -> jax.Array:
    """Dr. GRPO's ``r - mean``."""
    return _centred_advantages(r_GK, valid_GK, leave_one_out=False)


@ESTIMATORS.register("loo")
def loo_advantages(r_GK: jax.Array, valid_GK: jax.Array | None, eps: float) -> jax.Array:
    """RLOO's ``r - mean of the others`` = ``n / (n - 1) * (r - mean)``."""
    return _centred_advantages(r_GK, valid_GK, leave_one_out=True)


def _centred_advantages(r_GK: jax.Array, valid_GK: jax.Array | None, *, leave_one_out: bool) -> jax.Array:
    """``r - mean`` (or RLOO's scaled form) over the valid rows of each group; padding rows and constant groups
    give 0."""
    valid_GK = jnp.ones(r_GK.shape, bool) if valid_GK is None else valid_GK
    count_G1 = jnp.sum(valid_GK, axis=1, keepdims=True).astype(jnp.float32)
    mean_G1 = jnp.sum(jnp.where(valid_GK, r_GK, 0.0), axis=1, keepdims=True) / jnp.maximum(count_G1, 1.0)
    centred_GK = r_GK - mean_G1
    if leave_one_out:  # a group of one valid row has no other rows to average: the where below gives 0
        centred_GK = centred_GK * (count_G1 / jnp.maximum(count_G1 - 1.0, 1.0))
    first_G1 = jnp.take_along_axis(r_GK, jnp.argmax(valid_GK, axis=1)[:, None], axis=1)
    constant_G1 = jnp.all((r_GK == first_G1) | ~valid_GK, axis=1, keepdims=True)
    return jnp.where(valid_GK & ~constant_G1 & (count_G1 >= 2), centred_GK, 0.0)


def _full_group_advantages(r_GK: jax.Array, eps: float) -> jax.Array:
    """``group_advantages`` of ``[G, K]`` rewards with every row valid."""
    centred_GK = r_GK - r_GK.mean(axis=1, keepdims=True)
    std_G1 = r_GK.std(axis=1, ddof=1, keepdims=True)
    # mean(r) of equal values can round away from r (e.g. three 0.1s); test equality instead of std == 0.
    constant_G1 = jnp.all(r_GK == r_GK[:, :1], axis=1, keepdims=True)
    return jnp.where(constant_G1, 0.0, centred_GK / (std_G1 + eps))


def _masked_group_advantages(r_GK: jax.Array, valid_GK: jax.Array, eps: float) -> jax.Array:
    """``group_advantages`` over the valid rows of each group only; padding rows give 0."""
    # A group with fewer than two valid rows has no sample std (0 / 0): its NaN is discarded by the where.
    count_G1 = jnp.sum(valid_GK, axis=1, keepdims=True).astype(jnp.float32)
    mean_G1 = jnp.sum(jnp.where(valid_GK, r_GK, 0.0), axis=1, keepdims=True) / count_G1
    centred_GK = jnp.where(valid_GK, r_GK - mean_G1, 0.0)
    std_G1 = jnp.sqrt(jnp.sum(centred_GK * centred_GK, axis=1, keepdims=True) / (count_G1 - 1.0))
    first_G1 = jnp.take_along_axis(r_GK, jnp.argmax(valid_GK, axis=1)[:, None], axis=1)
    constant_G1 = jnp.all((r_GK == first_G1) | ~valid_GK, axis=1, keepdims=True)
    adv_GK = jnp.where(constant_G1 | (count_G1 < 2), 0.0, centred_GK / (std_G1 + eps))
    return jnp.where(valid_GK, adv_GK, 0.0)


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum(x * mask)`` computed with ``where`` so that masked garbage (inf, NaN) cannot leak in."""
    return jnp.sum(jnp.where(mask.astype(bool), x, 0.0))


def masked_mean(x: jax.Array, mask: jax.Array, num_tokens: jax.Array | float | None = None) -> jax.Array:
    """``sum_{mask} x / num_tokens``, with ``num_tokens = mask.sum()`` by default; 0 when there are no tokens."""
    if num_tokens is None:
        num_tokens = jnp.sum(mask.astype(jnp.float32))
    return masked_sum(x, mask) / jnp.maximum(jnp.asarray(num_tokens, jnp.float32), 1.0)


# --------------------------------------------------------------------------------- KL to a reference policy
# Schulman's estimators of KL(pi_theta || pi_ref) from a token y ~ pi_theta, each a function of
# log r = log pi_ref(y) - log pi_theta(y) (``options.KLEstimator``).
KL_ESTIMATORS = options.Registry(options.KLEstimator, "KL estimator")


@KL_ESTIMATORS.register("k3")
def kl_k3(log_r: jax.Array) -> jax.Array:
    """``r - 1 - log r``: unbiased, never negative, low variance; its gradient w.r.t. logp_theta is ``1 - r``.
    log r is clamped to [-20, 20] first (verl's low_var_kl): a token the reference finds e^88 times likelier than
    the policy would overflow exp in float32, and beyond the clamp the token gets no gradient rather than inf."""
    log_r = jnp.clip(log_r, -20.0, 20.0)
    return jnp.exp(log_r) - 1.0 - log_r


@KL_ESTIMATORS.register("k1")
def kl_k1(log_r: jax.Array) -> jax.Array:
    """``-log r = log pi_theta - log pi_ref``: unbiased, high variance, negative on some tokens."""
    return -log_r


@KL_ESTIMATORS.register("k2")
def kl_k2(log_r: jax.Array) -> jax.Array:
    """``(log r)^2 / 2``: biased (its mean is E[(log r)^2] / 2), never negative, low variance when pi_ref ~ pi_theta."""
    return 0.5 * log_r * log_r


def _kl_tokens(logp: jax.Array, ref_logp: jax.Array, mask: jax.Array, estimator: str | Callable) -> jax.Array:
    """The estimator per token, 0 off the mask (``where`` before it: a pad's garbage never reaches exp)."""
    if ref_logp is None:
        raise ValueError("a KL term needs the reference's log-probs (ref_logp) of the same tokens")
    if logp.shape != ref_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp {logp.shape}, ref_logp {ref_logp.shape} and mask {mask.shape} must match")
    mask = mask.astype(bool)
    log_r = jnp.where(mask, ref_logp.astype(jnp.float32) - logp.astype(jnp.float32), 0.0)
    return jnp.where(mask, KL_ESTIMATORS.resolve(estimator)(log_r), 0.0)


def kl_penalty(
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    estimator: str | Callable = "k3",
    num_tokens: jax.Array | float | None = None,
) -> jax.Array:
    """Token-mean of a KL estimator, ``sum_{mask} k(log r_t) / num_tokens`` with ``log r_t = ref_logp - logp``
    (``KL_ESTIMATORS``: k1, k2, k3), the reference a constant: differentiated, it pulls pi_theta towards pi_ref.

    ``logp``, ``ref_logp``, ``mask`` are ``[B, T]``; ``num_tokens`` as in ``policy_loss``.
    """
    return masked_mean(_kl_tokens(logp, ref_logp, mask, estimator), mask, num_tokens)


def sequence_kl(logp: jax.Array, ref_logp: jax.Array, mask: jax.Array, estimator: str | Callable = "k1") -> jax.Array:
    """``[B]``: each row's sum of the estimator over its tokens, detached (k1: ``log pi_theta(y) - log pi_ref(y)``
    of the whole response), the penalty ``loss.kl_in: reward`` takes from each row's reward."""
    return jax.lax.stop_gradient(jnp.sum(_kl_tokens(logp, ref_logp, mask, estimator), axis=-1))


def policy_regularizers(
    logp: jax.Array,
    mask: jax.Array,
    *,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str | Callable = "k3",
    entropy_coef: float = 0.0,
    num_tokens: jax.Array | float | None = None,
) -> tuple[jax.Array, Metrics]:
    """The terms GRPO's recipes may add to ``policy_loss``, as token-means over ``num_tokens``::

        kl_coef * kl_penalty(logp, ref_logp, mask, kl_estimator) - entropy_coef * sum_{mask} H_t / num_tokens

    ``entropy`` ``[B, T]`` is that of the sampling distribution (``logprobs.token_entropy``), differentiable for the
    bonus to act (``logprobs.sequence_logprobs(..., entropy_grad=True)``). A coefficient of 0 adds nothing and needs
    no array. Returns ``(term, metrics)``, metrics ``kl_ref``: the estimator's token-mean over this call's mask.
    """
    term, metrics = jnp.zeros((), jnp.float32), {}
    if kl_coef:
        term = term + kl_coef * kl_penalty(logp, ref_logp, mask, kl_estimator, num_tokens)
        metrics["kl_ref"] = jax.lax.stop_gradient(kl_penalty(logp, ref_logp, mask, kl_estimator))
    if entropy_coef:
        term = term - entropy_coef * masked_mean(entropy, mask, num_tokens)
    return term, metrics


# ------------------------------------------------------------------------------------------- losses
@dataclasses.dataclass(frozen=True)
class LossSpec:
    """How a run reads its policy's tokens, the same in the update, the log-prob passes and any method's
    per-prompt losses: the clip range (``eps_low``, ``eps_high``) and dual clip (``clip_c``) of ``policy_loss``, the
    ``temperature`` of the log-probs (the sampling one: ``softmax(logits / temperature)``) and the LM head's
    ``chunk_size`` (``logprobs.chunked_token_logprobs``); and the update's ``policy_regularizers``: ``kl_coef`` of the
    KL term in the loss (0 also where the run puts the KL in the reward) with its ``kl_estimator``, and
    ``entropy_coef``. Frozen and hashable: a static argument of the jitted programs."""

    eps_low: float = 0.2
    eps_high: float = 0.28
    clip_c: float | None = None
    temperature: float = 1.0
    chunk_size: int | None = None
    kl_coef: float = 0.0
    kl_estimator: Callable = kl_k3
    entropy_coef: float = 0.0

    @classmethod
    def of(cls, run: Any) -> LossSpec:
        """A run's (``train_config.TrainConfig``): ``loss``'s clip, chunk and regularizers, ``rollout.temperature``."""
        loss = run.loss
        return cls(
            loss.eps_low, loss.eps_high, loss.clip_c, run.rollout.temperature, loss.chunk_size,
            kl_coef=loss.kl_loss_coef, kl_estimator=KL_ESTIMATORS.resolve(loss.kl_estimator),
            entropy_coef=loss.entropy_coef,
        )  # fmt: skip

    @property
    def regularized(self) -> bool:
        """Whether the update adds ``policy_regularizers`` to the policy loss (the default adds nothing)."""
        return bool(self.kl_coef or self.entropy_coef)

    @property
    def regularizers(self) -> dict[str, Any]:
        """``policy_regularizers``' coefficient keywords."""
        return {"kl_coef": self.kl_coef, "kl_estimator": self.kl_estimator, "entropy_coef": self.entropy_coef}

    @property
    def clip(self) -> dict[str, Any]:
        """``policy_loss``'s clip keywords."""
        return {"eps_low": self.eps_low, "eps_high": self.eps_high, "clip_c": self.clip_c}

    @property
    def reading(self) -> dict[str, Any]:
        """The log-prob functions' keywords (``temperature``, ``chunk_size``)."""
        return {"temperature": self.temperature, "chunk_size": self.chunk_size}


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_c: float | None = None,
    num_tokens: jax.Array | float | None = None,
) -> tuple[jax.Array, Metrics]:
    """Clipped surrogate with clip-higher (DAPO) and optional dual clip, as a token-mean.

    Per token, with ``rho = exp(logp - old_logp)``::

        l_t = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
        l_t = min(l_t, clip_c * |A|)            if clip_c is set and A < 0   (dual clip)
        loss = sum_{mask} l_t / num_tokens       num_tokens = mask.sum() unless given

    Args:
        logp, old_logp: ``[B, T]`` log-probs of the taken tokens under the current and the sampling policy.
        advantages: ``[B]`` (one per row, broadcast over tokens) or ``[B, T]`` (per token).
        mask: ``[B, T]`` response-token mask.
        eps_low, eps_high: the asymmetric clip range of the ratio.
        clip_c: dual-clip bound (> 1) on the loss of negative-advantage tokens; None disables it.
        num_tokens: the denominator; pass the global token count when accumulating micro-batches.

    Returns:
        ``(loss, metrics)``. Metrics are token-means over this call's mask unless named otherwise:
        ``clip_frac_low`` (A < 0 and rho < 1 - eps_low: the clipped branch is active, zero gradient),
        ``clip_frac_high`` (A > 0 and rho > 1 + eps_high), ``dual_clip_frac``, ``ratio_mean``,
        ``ratio_max`` (max over tokens), ``approx_kl`` and ``num_tokens`` (this call's mask count).
        ``approx_kl`` is Schulman's k3 estimator of KL(old || new) for tokens sampled from the old policy,
        ``rho - 1 - log rho``: unbiased, never negative, lower variance than k1 ``-log rho``.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp {logp.shape}, old_logp {old_logp.shape} and mask {mask.shape} must match")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 (it bounds the loss of A < 0 tokens), got {clip_c}")
    mask = mask.astype(bool)
    adv = _broadcast_advantages(advantages, mask.shape)
    adv = jnp.where(mask, adv, 0.0)
    # where before exp: a pad position's difference could be huge and overflow exp.
    log_ratio = jnp.where(mask, logp.astype(jnp.float32) - old_logp.astype(jnp.float32), 0.0)
    ratio = jnp.exp(log_ratio)
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
    per_token = -surrogate
    dual_clipped = jnp.zeros_like(mask)
    if clip_c is not None:
        cap = -clip_c * adv  # = clip_c * |A| where A < 0
        dual_clipped = (adv < 0) & (per_token > cap) & mask
        per_token = jnp.where(dual_clipped, cap, per_token)
    loss = masked_mean(per_token, mask, num_tokens)
    return loss, _surrogate_metrics(ratio, log_ratio, adv, mask, dual_clipped, eps_low=eps_low, eps_high=eps_high)


def _surrogate_metrics(
    ratio: jax.Array, log_ratio: jax.Array, adv: jax.Array, mask: jax.Array, dual_clipped: jax.Array, *,
    eps_low: float, eps_high: float,
) -> Metrics:  # fmt: skip
    """``policy_loss``'s metrics (named in its docstring), detached: they report the update, never steer it."""
    metrics = {
        "clip_frac_low": masked_mean((adv < 0) & (ratio < 1.0 - eps_low), mask),
        "clip_frac_high": masked_mean((adv > 0) & (ratio > 1.0 + eps_high), mask),
        "dual_clip_frac": masked_mean(dual_clipped, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": jnp.max(jnp.where(mask, ratio, 0.0)),
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
        "num_tokens": jnp.sum(mask.astype(jnp.float32)),
    }
    return jax.tree.map(jax.lax.stop_gradient, metrics)


def weighted_advantages(advantages: jax.Array, weights: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``[B, T]`` advantages times detached importance weights (``[B]`` per row or ``[B, T]`` per token, >= 0).

    The clipped surrogate is positively homogeneous in A: for w >= 0, ``w * l_t(rho, A) = l_t(rho, w * A)``,
    dual clip included (its cap ``clip_c * |A|`` scales with A too) and with the same clip decisions. So a
    weight on a token's loss is a weight on its advantage, and ``policy_loss`` needs no weight argument.
    """
    weights = jnp.asarray(weights, jnp.float32)
    return _broadcast_advantages(advantages, shape) * _broadcast_advantages(weights, shape)


def _broadcast_advantages(advantages: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    advantages = jnp.asarray(advantages, jnp.float32)
    if advantages.shape == shape[:1]:
        return jnp.broadcast_to(advantages[:, None], shape)
    if advantages.shape == shape:
        return advantages
    raise ValueError(f"advantages must be [B]={shape[:1]} or [B, T]={shape}, got {advantages.shape}")


def sft_loss(logp_targets: jax.Array, mask: jax.Array, *, num_tokens: jax.Array | float | None = None) -> jax.Array:
    """Token-mean negative log-likelihood ``-sum_{mask} log p(y_t) / num_tokens`` (``mask.sum()`` by default)."""
    return -masked_mean(logp_targets.astype(jnp.float32), mask, num_tokens)


# ------------------------------------------------------------------------------------- the mixed objective
# ``scaffold.supervise: mixed`` (CHORD, Zhang et al. 2025): the base's RL update minimises L_RL + mu_t * L_SFT.
SFT_TOKEN_WEIGHTS = options.Registry(options.SFTTokenWeight, "SFT token weight")


@SFT_TOKEN_WEIGHTS.register("none")
def unit_token_weights(logp: jax.Array) -> jax.Array:
    """Every target token weighs 1: the plain token-mean NLL."""
    return jnp.ones_like(logp)


@SFT_TOKEN_WEIGHTS.register("p1mp")
def chord_phi_weights(logp: jax.Array) -> jax.Array:
    """CHORD-phi's ``p (1 - p)``, ``p = exp(logp)`` the model's probability of the target token, detached: at most
    1/4 (p = 1/2), near 0 on a token the model already predicts (p -> 1) and on one far from it (p -> 0), so the
    expert's text moves the policy where it is uncertain and leaves its confident, possibly different, choices."""
    p = jnp.exp(logp)
    return jax.lax.stop_gradient(p * (1.0 - p))


def weighted_sft_loss(
    logp_targets: jax.Array,
    mask: jax.Array,
    *,
    token_weight: str | Callable = "none",
    num_tokens: jax.Array | float | None = None,
) -> jax.Array:
    """``-sum_{mask} w_t log p(y_t) / num_tokens``, ``w_t`` the detached weight ``token_weight`` (a name of
    ``SFT_TOKEN_WEIGHTS`` or its function) gives the token's log-prob; ``none`` is ``sft_loss``. The mean is over the
    tokens, not the weights: ``p1mp`` shrinks the term, as CHORD-phi's does."""
    weigh, mask = SFT_TOKEN_WEIGHTS.resolve(token_weight), mask.astype(bool)
    logp = jnp.where(mask, logp_targets.astype(jnp.float32), 0.0)  # before exp: a pad's garbage never reaches w_t
    return -masked_mean(weigh(logp) * logp, mask, num_tokens)


def mixed_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    sft_logp: jax.Array,
    sft_mask: jax.Array,
    *,
    mu: float | jax.Array,
    token_weight: str | Callable = "none",
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_c: float | None = None,
) -> tuple[jax.Array, Metrics]:
    """CHORD's mixed objective of one update, ``L = L_RL + mu * L_SFT``:

        L_RL  = policy_loss(logp, old_logp, advantages, mask)            token-mean over the rollouts' tokens
        L_SFT = -(1/N_sft) sum_{sft_mask} w_t log p(y_t)                  token-mean over the solutions' tokens
        w_t   = 1 (``none``) or sg(p_t (1 - p_t)) (``p1mp``, CHORD-phi)

    CHORD writes ``(1 - mu) L_RL + mu L_SFT``; the sum keeps the RL term, hence the update's scale at a given
    learning rate, as in every other arm (at mu = 0.1 the two differ by a factor 0.9 on L_RL). A batch without
    SFT tokens gives ``L_SFT = 0``: the update is the RL one. ``optim.mixed_rl_step`` takes this gradient as
    ``grad L_RL + mu * grad L_SFT``, each term accumulated over its own micro-batches.

    Returns ``(loss, metrics)``: ``policy_loss``'s metrics and ``mix_sft_loss`` (L_SFT).
    """
    rl, metrics = policy_loss(logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high, clip_c=clip_c)
    sft = weighted_sft_loss(sft_logp, sft_mask, token_weight=token_weight)
    return rl + mu * sft, {**metrics, "mix_sft_loss": jax.lax.stop_gradient(sft)}


# mu_t of the mixed objective at step t (0, 1, ...; the steps done before it) of a run of T steps, from mu_0.
MIX_SCHEDULES = options.Registry(options.MixSchedule, "mix schedule")


@MIX_SCHEDULES.register("cosine")
def cosine_mix(mu: float, step: int, steps: int) -> float:
    """``mu_t = mu * (1 + cos(pi * t / T)) / 2``: mu at the first step, half of it midway, 0 at t = T (after the
    last), so the expert's text leads early and the policy's own rollouts late."""
    return mu * 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / steps))


@MIX_SCHEDULES.register("constant")
def constant_mix(mu: float, step: int, steps: int) -> float:
    """``mu_t = mu`` at every step."""
    return mu


# ------------------------------------------------------------------------------------- micro-batching
LossFn = Callable[[Any, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, Metrics]]


def accumulate_gradients(
    loss_fn: LossFn,
    params: Any,
    batch: Mapping[str, jax.Array],
    num_micro_batches: int,
    *,
    mask_key: str = "mask",
) -> tuple[jax.Array, Any, Metrics]:
    """Gradient of one token-mean loss over the whole batch, computed ``num_micro_batches`` rows at a time.

    ``loss_fn(params, micro_batch, num_tokens) -> (loss, metrics)`` must return the *sum* of its per-token
    losses divided by ``num_tokens`` (e.g. ``policy_loss(..., num_tokens=num_tokens)``). Here
    ``num_tokens = batch[mask_key].sum()`` is the count over the global batch, so

        sum_m loss_m = sum_tokens l_t / N_global,    grad = sum_m grad loss_m,

    which is the full-batch token-mean and its gradient exactly; averaging per-micro-batch means instead
    would weight the tokens of short micro-batches more.

    Every leaf of ``batch`` has the rows on axis 0, and the row count must divide by ``num_micro_batches``.
    Micro-batch m holds rows ``m, m + M, m + 2M, ...`` (M = ``num_micro_batches``), run by ``lax.scan``, so only
    one micro-batch's activations are live.
    Gradients are accumulated in float32 and returned in the dtype of each parameter. Jittable (with
    ``loss_fn`` and ``num_micro_batches`` static).

    Returns:
        ``(loss, grads, metrics)``; metrics are merged over micro-batches by ``merge_micro_batch_metrics``.
    """
    num_tokens = jnp.sum(batch[mask_key].astype(jnp.float32))
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_micro_batches == 1:
        (loss, metrics), grads = grad_fn(params, batch, num_tokens)
        return loss, grads, metrics
    micro_batches = jax.tree.map(lambda x: split_rows(x, num_micro_batches), batch)

    def step(carry, micro_batch):
        loss_sum, grad_sum = carry
        (loss, metrics), grads = grad_fn(params, micro_batch, num_tokens)
        grad_sum = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), grad_sum, grads)
        return (loss_sum + loss, grad_sum), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    (loss, grads), stacked = jax.lax.scan(step, (jnp.zeros((), jnp.float32), zeros), micro_batches)
    grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
    return loss, grads, merge_micro_batch_metrics(stacked)


def merge_micro_batch_metrics(stacked: Metrics) -> Metrics:
    """Merge metrics stacked over micro-batches (leading axis) into whole-batch values.

    ``num_tokens`` is summed, names ending in ``_max`` take the max, and every other metric (a token-mean of
    its micro-batch) is averaged with weights ``num_tokens``, giving the token-mean over the whole batch.
    Without a ``num_tokens`` entry the plain mean is used.
    """
    counts = stacked.get("num_tokens")
    merged = {}
    for name, values in stacked.items():
        if name == "num_tokens":
            merged[name] = jnp.sum(values)
        elif name.endswith("_max"):
            merged[name] = jnp.max(values, axis=0)
        elif counts is None:
            merged[name] = jnp.mean(values, axis=0)
        else:
            merged[name] = jnp.sum(values * counts) / jnp.maximum(jnp.sum(counts), 1.0)
    return merged
