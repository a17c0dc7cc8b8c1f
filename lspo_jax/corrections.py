"""The corrections of a spliced row for being sampled with the adapter on (``scaffold.correction``), by name.

Each is one function of the scaffold's config, the rows' base log-probs ``log pi_theta_old`` and behaviour
log-probs (``log pi_mu`` on spliced rows, the base's elsewhere), the response mask and the spliced rows; it returns
the update's ``old_logp`` ``[rows, T]`` and the detached loss weights (None, ``[rows]`` or ``[rows, T]``). The
table of what each does is ``train.importance_weights``'; a new correction is one function registered here.
"""

from __future__ import annotations

import numpy as np

from lspo_jax import losses, options
from lspo_jax.train_config import ScaffoldConfig

CORRECTIONS = options.Registry(options.Correction, "spliced-row correction")


@CORRECTIONS.register("token")
def token(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """The paper's: a spliced row's ratio is over pi_mu, token by token."""
    return behaviour_logp, None


@CORRECTIONS.register("sequence")
def sequence(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """The ratio over the base; a spliced row's loss times its truncated sequence weight (Eq. 2)."""
    if not spliced_rows.any():
        return base_logp, None
    row_weights = np.asarray(losses.sequence_weights(base_logp, behaviour_logp, mask, cfg.is_cap))
    return base_logp, np.where(spliced_rows, row_weights, 1.0).astype(np.float32)


@CORRECTIONS.register("floor")
def floor(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """The ratio at the sampling base floored at ``ratio_floor``."""
    return np.asarray(losses.floored_old_logp(base_logp, behaviour_logp, cfg.ratio_floor)), None


@CORRECTIONS.register("shaped")
def shaped(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """The ratio over the base; a spliced token's loss times LUFFY's shaping weight."""
    if not spliced_rows.any():
        return base_logp, None
    token_weights = np.asarray(losses.shaping_weights(base_logp, mask, cfg.shaping_gamma))
    return base_logp, np.where(spliced_rows[:, None], token_weights, 1.0).astype(np.float32)


@CORRECTIONS.register("none")
def none(cfg: ScaffoldConfig, base_logp, behaviour_logp, mask, spliced_rows):
    """Spliced rows count as on-policy."""
    return base_logp, None
