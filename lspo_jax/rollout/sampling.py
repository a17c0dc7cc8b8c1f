"""One token per row from the logits: temperature, then top-k and top-p, drawn by inverting cumulative sums, with the
row's log-prob of the sampling distribution (before truncation: the quantity the trainer computes for ``old_logp``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax.rollout.buckets import pow2_bucket


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """The static part of sampling: each distinct value compiles its own programs."""

    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False


def sample_token(
    logits_BV: jax.Array,
    key: jax.Array,
    temperature: jax.Array | float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row and its log-prob ``log_softmax(logits / T)[token]`` (before truncation).

    ``key`` is one key per row (``[B]``) or one for the batch, in which case row b draws with
    ``fold_in(key, b)``: a row's token depends on its own key and logits only, never on the other rows.
    Order as in Hugging Face: temperature, then top-k, then top-p on the renormalised top-k distribution,
    keeping the smallest prefix (by probability) whose mass reaches ``top_p``, the top token always.
    ``top_k``, ``top_p`` and ``greedy`` are Python values: the plain path has no sort at all.
    """
    scaled_BV = logits_BV.astype(jnp.float32) / temperature
    # Sampling is shift-invariant, so the normalised [B, V] log-probs are never materialised: one
    # log-sum-exp per row and one gather give the reported log-prob (fewer full-vocab passes per step).
    if greedy:
        token_B, lse_B = jnp.argmax(logits_BV, axis=-1), jax.nn.logsumexp(scaled_BV, axis=-1)
    else:
        per_row = key.ndim == (1 if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else 2)  # legacy: [2]
        keys_B = key if per_row else jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(scaled_BV.shape[0]))
        u_B2 = jax.vmap(lambda k: jax.random.uniform(k, (2,)))(keys_B)
        if top_k == 0 and top_p >= 1.0:
            token_B, lse_B = _inverse_cdf(scaled_BV, u_B2)
        else:
            token_B, lse_B = _sample_truncated(scaled_BV, u_B2[:, 0], top_k, top_p), jax.nn.logsumexp(scaled_BV, -1)
    token_B = token_B.astype(jnp.int32)
    picked_B = jnp.take_along_axis(scaled_BV, token_B[:, None], axis=-1)[:, 0]
    return token_B, picked_B - lse_B


def _inverse_cdf(scaled_BV: jax.Array, u_B2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """An exact draw from ``softmax(scaled)`` with two uniforms per row, and the row's log-sum-exp.

    The Gumbel-max trick (``jax.random.categorical``) draws one noise value per vocabulary entry: at a 32k
    vocabulary that costs more than the head matmul on a CPU. Here the vocabulary is cut into blocks of about
    sqrt(V) entries: the first uniform picks a block by its mass, the second an entry within it, each by
    inverting a cumulative sum. Two short cumulative sums keep float32 rounding at the scale of one block's
    mass, and the second uniform resolves an entry at 2^-24 of its block's mass, not of the whole vocabulary's.
    """
    b, v = scaled_BV.shape
    width = pow2_bucket(int(np.ceil(np.sqrt(v))))
    blocks = -(-v // width)
    max_B = jnp.max(scaled_BV, axis=-1)
    weight_BV = jnp.exp(scaled_BV - max_B[:, None])
    weight_BGW = jnp.pad(weight_BV, ((0, 0), (0, blocks * width - v))).reshape(b, blocks, width)
    mass_BG = jnp.sum(weight_BGW, axis=-1)
    block_B = _invert(mass_BG, u_B2[:, 0])
    within_BW = jnp.take_along_axis(weight_BGW, block_B[:, None, None], axis=1)[:, 0]
    token_B = block_B * width + _invert(within_BW, u_B2[:, 1])
    return token_B, max_B + jnp.log(jnp.sum(mass_BG, axis=-1))


def _invert(weight_BN: jax.Array, u_B: jax.Array) -> jax.Array:
    """Per row, the first index whose inclusive cumulative weight exceeds ``u * total``.

    An entry of weight 0 is never the first to exceed (its predecessor has the same sum), so padding and
    truncated entries are never picked; rounding that leaves every sum at or below the target is clamped to
    the last entry of positive weight.
    """
    cum_BN = jnp.cumsum(weight_BN, axis=-1)
    index_B = jnp.sum(cum_BN <= (u_B * cum_BN[:, -1])[:, None], axis=-1)
    last_B = weight_BN.shape[-1] - 1 - jnp.argmax(weight_BN[:, ::-1] > 0, axis=-1)
    return jnp.minimum(index_B, last_B)


def _sample_truncated(scaled_BV: jax.Array, u_B: jax.Array, top_k: int, top_p: float) -> jax.Array:
    vocab = scaled_BV.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    # top_k returns candidates sorted by probability; with k < V it is a partial selection, not a sort.
    cand_BK, cand_id_BK = jax.lax.top_k(scaled_BV, k)
    weight_BK = jnp.exp(cand_BK - cand_BK[:, :1])
    if top_p < 1.0:
        probs_BK = weight_BK / jnp.sum(weight_BK, axis=-1, keepdims=True)
        mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
        keep_BK = (mass_before_BK < top_p) | (jnp.arange(k) == 0)
        weight_BK = jnp.where(keep_BK, weight_BK, 0.0)
    choice_B = _invert(weight_BK, u_B)
    return jnp.take_along_axis(cand_id_BK, choice_B[:, None], axis=-1)[:, 0]
