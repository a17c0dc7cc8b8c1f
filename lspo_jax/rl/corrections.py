"""The corrections of a spliced row for being sampled with the adapter on (``scaffold.correction``), by name, and
truncated importance sampling against the engine's log-probs (``loss.tis_cap``): the table, the arithmetic and
the one function the step calls (``importance_weights``).

Each correction is one function of the scaffold's config, the rows' base log-probs ``log pi_theta_old`` and
behaviour log-probs (``log pi_mu`` on spliced rows, the base's elsewhere), the response mask and the spliced rows;
it returns the update's ``old_logp`` ``[rows, T]`` and the detached loss weights (None, ``[rows]`` or ``[rows, T]``).
The table of what each does is ``importance_weights``'; a new correction is one function registered here. The
weights reach the loss as weights on the advantages (``losses.weighted_advantages``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax import options
from lspo_jax.step_config import ScaffoldConfig
from lspo_jax.train_config import TrainConfig

CORRECTIONS = options.Registry(options.Correction, "spliced-row correction")


def importance_weights(
    run: TrainConfig, rows: Mapping[str, np.ndarray], base_logp, behaviour_logp, spliced_rows, *, correction=None
):
    """The update's ``old_logp`` ``[rows, T]`` and detached loss weights (None, ``[rows]`` or ``[rows, T]``).

    ``behaviour_logp`` is the trainer's log-prob of the policy that sampled each row: ``pi_theta_old`` (the
    base, ``base_logp``) on base rows, ``pi_mu = pi_theta+phi`` (adapter on) on spliced rows. Per
    ``scaffold.correction``, with rho_t = pi_theta(y_t) / old(y_t):

        token     old = behaviour_logp: the spliced rows' ratio is over pi_mu, token by token (the paper)
        sequence  old = base_logp, and spliced row i's loss is times
                  w_i = min(prod_t pi_theta_old(y_t) / pi_mu(y_t), scaffold.is_cap)   (Eq. 2, truncated)
        floor     old = min(log pi_mu, log pi_theta_old - log f): the ratio at the sampling base is
                  max(pi_theta_old / pi_mu, f), f = scaffold.ratio_floor (``floored_old_logp``)
        shaped    old = base_logp, and a spliced token's loss is times gamma p / (p + gamma)^2, p = pi_theta_old:
                  the gradient of LUFFY's pi / (pi + gamma), gamma = scaffold.shaping_gamma
                  (``shaping_weights``)
        guide     old = base_logp, and a spliced token's loss is times gamma rho / (rho + gamma)^2 at
                  rho = pi_theta_old / pi_mu: the gradient of Guide-GRPO's reshaped ratio rho / (rho + gamma),
                  unclipped, gamma the scaffold.guide_percentile quantile of the spliced tokens' rho (``guide_weights``)
        none      old = base_logp, no weight: spliced rows count as on-policy

    ``loss.tis_cap`` C then multiplies each token's loss by min(exp(behaviour_logp - sampler_logp), C): the
    trainer's log-prob of the sampling policy against the one the engine reported while sampling. ``correction``: the
    resolved strategy (``Learner.correction``; default: the run's, resolved here).
    """
    mask, correction = rows["mask"], CORRECTIONS.resolve(correction or run.scaffold.correction)
    old_logp, weights = correction(run.scaffold, base_logp, behaviour_logp, mask, spliced_rows)
    if run.loss.tis_cap is not None:
        tis = np.asarray(token_weights(behaviour_logp, rows["sampler_logp"], mask, run.loss.tis_cap))
        weights = tis if weights is None else (weights if weights.ndim == 2 else weights[:, None]) * tis
    return old_logp.astype(np.float32), weights


@CORRECTIONS.register("token")
def token(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """The paper's: a spliced row's ratio is over pi_mu, token by token."""
    return behaviour_logp, None


@CORRECTIONS.register("sequence")
def sequence(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """The ratio over the base; a spliced row's loss times its truncated sequence weight (Eq. 2)."""
    if not spliced_rows.any():
        return base_logp, None
    row_weights = np.asarray(sequence_weights(base_logp, behaviour_logp, mask, cfg.is_cap))
    return base_logp, np.where(spliced_rows, row_weights, 1.0).astype(np.float32)


@CORRECTIONS.register("floor")
def floor(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """The ratio at the sampling base floored at ``ratio_floor``."""
    return np.asarray(floored_old_logp(base_logp, behaviour_logp, cfg.ratio_floor)), None


@CORRECTIONS.register("shaped")
def shaped(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """The ratio over the base; a spliced token's loss times LUFFY's shaping weight."""
    if not spliced_rows.any():
        return base_logp, None
    token_weights = np.asarray(shaping_weights(base_logp, mask, cfg.shaping_gamma))
    return base_logp, np.where(spliced_rows[:, None], token_weights, 1.0).astype(np.float32)


@CORRECTIONS.register("guide")
def guide(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """The ratio over the base; a spliced token's loss times Guide-GRPO's reshaping weight."""
    if not spliced_rows.any():
        return base_logp, None
    return base_logp, guide_weights(base_logp, behaviour_logp, mask, spliced_rows, cfg.guide_percentile)


@CORRECTIONS.register("none")
def none(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """Spliced rows count as on-policy."""
    return base_logp, None


# ------------------------------------------------------------------------------------------ arithmetic
def sequence_weights(logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array, cap: float) -> jax.Array:
    """``[B]`` truncated sequence importance weights ``min(prod_t pi(y_t) / mu(y_t), cap)`` over each row's mask.

    Computed in log space, ``exp(min(sum_t (log pi - log mu), log cap))``: the product of thousands of per-token
    ratios under- or overflows float32 long before the cap acts.
    """
    log_ratio = jnp.sum(jnp.where(mask > 0, logp - behaviour_logp, 0.0), axis=-1)
    return jnp.exp(jnp.minimum(log_ratio, jnp.log(cap)))


def token_weights(logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array, cap: float) -> jax.Array:
    """``[B, T]`` truncated per-token importance weights ``min(pi(y_t) / mu(y_t), cap)``, 1 off the mask."""
    log_ratio = jnp.where(mask > 0, logp - behaviour_logp, 0.0)
    return jnp.where(mask > 0, jnp.exp(jnp.minimum(log_ratio, jnp.log(cap))), 1.0)


def floored_old_logp(base_logp: jax.Array, behaviour_logp: jax.Array, floor: float) -> jax.Array:
    """``old_logp`` of the ``floor`` correction: ``min(log mu, log pi_theta_old - log floor)``, so that
    ``rho = pi_theta / old = max(pi_theta / mu, floor * pi_theta / pi_theta_old)``.

    At the sampling base the ratio is ``max(pi_theta_old / mu, floor)``: clipped from below, where the paper's
    per-token ratio lets a token the base finds unlikely (p << q) contribute almost nothing. It stays a ratio of
    the current policy, so its gradient ``A * rho * grad log pi`` never vanishes and later updates of the step
    (``optim.epochs``) move it as they move any ratio. Rows with ``mu = pi_theta_old`` keep their ``old_logp``
    for ``floor <= 1``.
    """
    return jnp.minimum(behaviour_logp, base_logp - jnp.log(floor))


def shaping_weights(base_logp: jax.Array, mask: jax.Array, gamma: float) -> jax.Array:
    """``[B, T]`` detached weights of the ``shaped`` correction (LUFFY's policy shaping), 1 off the mask.

    LUFFY puts ``f(pi) = pi / (pi + gamma)`` in place of the ratio on off-policy tokens, unclipped, so a token's
    loss is ``-A f(pi)`` with gradient ``-A * gamma pi / (pi + gamma)^2 * grad log pi``. With ``old_logp = log
    pi_theta_old`` the surrogate's gradient at the sampling base is ``-A * grad log pi`` (rho = 1, inside the
    clip), so a weight ``w = gamma p / (p + gamma)^2`` at ``p = pi_theta_old`` gives LUFFY's gradient exactly for
    the step's first update (the only one by default); later updates of the same step keep ``w`` from the
    sampling base, as the sequence weight does.
    """
    p = jnp.exp(base_logp)
    return jnp.where(mask > 0, gamma * p / jnp.square(p + gamma), 1.0)


def guide_weights(base_logp, behaviour_logp, mask, spliced_rows: np.ndarray, percentile: float) -> np.ndarray:
    """``[B, T]`` detached weights of the ``guide`` correction (Guide-GRPO's released configuration), 1 off the
    spliced tokens.

    Guide puts ``f(rho) = rho / (rho + gamma)`` in place of the clipped ratio on its guided (off-policy) tokens,
    ``rho = pi_theta / pi_mu``, unclipped, with gamma the ``percentile`` quantile of the batch's ratios: here the
    spliced tokens' ``rho`` at the update's start (numpy's linear interpolation), since the base rows' ratios are 1
    there. The loss ``-A f(rho)`` has the gradient ``-A * gamma rho / (rho + gamma)^2 * grad log pi``; with
    ``old_logp = log pi_theta_old`` the surrogate's own ratio is 1 at the start (the clip does not bind), so the
    weight ``w = gamma rho / (rho + gamma)^2`` gives Guide's gradient exactly for the first update, as ``shaped``
    does LUFFY's. A token at the quantile (rho = gamma) gets 1/4; far above or below it, little.
    """
    selected = (np.asarray(mask) > 0) & np.asarray(spliced_rows)[:, None]
    rho = np.exp(np.asarray(base_logp, np.float64) - np.asarray(behaviour_logp, np.float64))
    gamma = np.quantile(rho[selected], percentile)
    return np.where(selected, gamma * rho / np.square(rho + gamma), 1.0).astype(np.float32)
