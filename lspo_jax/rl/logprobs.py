"""The teacher-forced log-prob pass: ``log pi(tokens[t] | tokens[<t])`` of given rows, and its entropy.

One pass serves every consumer: the RL update (with entropy, differentiated), the adapter's SFT step, and the
two old-log-prob passes of a step (base and adapter on). ``chunk_size`` runs the LM head over that many
positions at a time, so a ``[rows, length, vocab]`` logits array is never held whole; ``grouped_logprobs``
runs the rows in micro-batches one after another (the update's micro-batches are summed gradients, in
``losses.accumulate_gradients``).

Rows come in one of two layouts (``layout`` picks it out of a batch): left-padded rows with an ``attention_mask``,
or packed rows (``packing.pack_rows``) with ``segment_ids`` and ``positions``, several sequences to a row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lspo_jax.config import ModelConfig
from lspo_jax.models import model
from lspo_jax.models.specs import Params


# ------------------------------------------------------------------------------------ per-token math
def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``log softmax(logits / temperature)[target]`` per position, float32.

    ``logits`` ``[..., V]`` and integer ``targets`` ``[...]``. Gathering the target logit and subtracting
    the log-sum-exp avoids writing out the full ``[..., V]`` log-softmax.
    """
    z = logits.astype(jnp.float32) / temperature
    target_logit = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return target_logit - jax.nn.logsumexp(z, axis=-1)


def token_entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` of ``softmax(z)``, ``z = logits / temperature``.

    Returns float32 ``[...]`` for ``logits`` ``[..., V]``.
    """
    z = logits.astype(jnp.float32) / temperature
    return jax.nn.logsumexp(z, axis=-1) - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)


def chunked_token_logprobs(
    hidden_BTD: jax.Array,
    head_fn: Callable[[jax.Array], jax.Array],
    targets_BT: jax.Array,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """``token_logprobs(head_fn(hidden), targets)`` computed ``chunk_size`` positions at a time.

    ``head_fn`` maps hidden states ``[B, C, D]`` to logits ``[B, C, V]`` (the LM head). Only one chunk's
    logits exist at once: for the 1.5B model's V = 151936 a whole ``[B, T, V]`` float32 array is 0.6 MB per
    token, 5.6 GB per 9216-token row. Each chunk is rematerialised, so the backward pass recomputes its
    logits instead of keeping them. T is cut into the fewest chunks of at most ``chunk_size`` positions, all of one
    size, so it pads fewer positions than chunks (pad logits are dropped): a batch shorter than ``chunk_size`` is one
    chunk of its own length, not padded to ``chunk_size`` (with V = 151936 that padding was most of a short step).

    Returns ``(logp [B, T], entropy [B, T] or None)``; the entropy (``token_entropy``) is computed from the same
    chunk when ``with_entropy``: a metric without gradient, or with ``entropy_grad`` differentiable (an entropy
    bonus in the loss; its backward recomputes the chunk's logits as the log-probs' does).
    """
    b, t, d = hidden_BTD.shape
    n = -(-t // chunk_size)
    size = -(-t // n)
    pad = n * size - t
    h_NBCD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0))).reshape(b, n, size, d).swapaxes(0, 1)
    y_NBC = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(b, n, size).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(xs):
        h_BCD, y_BC = xs
        logits_BCV = head_fn(h_BCD)
        logp_BC = token_logprobs(logits_BCV, y_BC, temperature)
        if not with_entropy:
            return logp_BC, None
        entropy_BC = token_entropy(logits_BCV, temperature)
        return logp_BC, entropy_BC if entropy_grad else jax.lax.stop_gradient(entropy_BC)

    logp_NBC, entropy_NBC = jax.lax.map(one_chunk, (h_NBCD, y_NBC))
    unchunk = lambda x_NBC: x_NBC.swapaxes(0, 1).reshape(b, n * size)[:, :t]
    return unchunk(logp_NBC), None if entropy_NBC is None else unchunk(entropy_NBC)


def split_rows(x: jax.Array, num_micro_batches: int) -> jax.Array:
    """``[rows, ...] -> [M, rows / M, ...]``: micro-batch m holds rows ``m, m + M, m + 2M, ...``."""
    rows = x.shape[0]
    if rows % num_micro_batches:
        raise ValueError(f"batch of {rows} rows does not split into {num_micro_batches} micro-batches")
    # Micro-batch m takes rows m, m + M, m + 2M, ... (strided, not a consecutive block): the row axis of a
    # batch split over D data-parallel devices is D consecutive blocks, and a strided split keeps every
    # micro-batch spread over all D of them, where a block split would put it on one device.
    return x.reshape(rows // num_micro_batches, num_micro_batches, *x.shape[1:]).swapaxes(0, 1)


def merge_rows(x: jax.Array) -> jax.Array:
    """Inverse of ``split_rows``: ``[M, rows / M, ...] -> [rows, ...]`` in the original row order."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


# ---------------------------------------------------------------------------------------------- passes
LAYOUT_KEYS = ("attention_mask", "segment_ids", "positions")


def layout(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The layout arrays of ``batch``: ``attention_mask``, or packed rows' ``segment_ids`` and ``positions``."""
    return {k: batch[k] for k in LAYOUT_KEYS if k in batch}


def sequence_logprobs(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    lora_scale: float = 0.0,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[jax.Array, ...]:
    """Per-token log-probs aligned with ``tokens``, and the logits they came from.

    ``logp[:, t] = log softmax(logits[:, t - 1] / temperature)[tokens[:, t]]`` for ``t >= 1`` and
    ``logp[:, 0] = 0`` (nothing predicts the first token), so a loss mask in token coordinates (True on the
    generated tokens) applies directly; position 0 must be masked out (in packed rows, each segment's first
    token). Returns ``(logp [B, T], logits)``. With ``chunk_size`` the LM head runs that many positions at a
    time (``chunked_token_logprobs``) and the logits, never held whole, are returned as None. ``with_entropy``
    adds a third array, the entropy of each predicting distribution (``token_entropy``, a metric without gradient;
    differentiable with ``entropy_grad``, for an entropy bonus), ``[B, T]`` aligned alike (position 0 holds 0).
    """
    rows = dict(attention_mask=attention_mask, segment_ids=segment_ids, positions=positions)
    if chunk_size is not None:
        logp, entropy = _chunked_logprobs(
            config, params, tokens, rows, lora_scale, temperature, chunk_size, with_entropy, entropy_grad
        )
        return (logp, None, entropy) if with_entropy else (logp, None)
    logits = model.forward(config, params, tokens, **rows, lora_scale=lora_scale)
    shift = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
    logp = shift(token_logprobs(logits[:, :-1], tokens[:, 1:], temperature))
    if not with_entropy:
        return logp, logits
    head = logits[:, :-1] if entropy_grad else jax.lax.stop_gradient(logits[:, :-1])
    return logp, logits, shift(token_entropy(head, temperature))


def grouped_logprobs(
    config: ModelConfig,
    params: Params,
    batch: Mapping[str, jax.Array],
    *,
    lora_scale: float = 0.0,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    num_micro_batches: int = 1,
) -> jax.Array:
    """``sequence_logprobs``' ``logp`` of ``batch`` (``tokens`` and a ``layout``) with the rows in
    ``num_micro_batches`` strided groups run one after another (``lax.map``, as the RL step's micro-batches), so a
    long batch never holds every row's activations."""
    inputs = {"tokens": batch["tokens"], **layout(batch)}

    def one(rows):
        kwargs = dict(lora_scale=lora_scale, temperature=temperature, chunk_size=chunk_size)
        return sequence_logprobs(config, params, rows.pop("tokens"), **rows, **kwargs)[0]

    if num_micro_batches == 1:
        return one(inputs)
    split = jax.tree.map(lambda x: split_rows(x, num_micro_batches), inputs)
    return merge_rows(jax.lax.map(one, split))


def _chunked_logprobs(config, params, tokens, rows, lora_scale, temperature, chunk_size, entropy=False, grad=False):
    h_BTD = model.hidden_states(
        config, params, tokens, rows["attention_mask"], lora_scale=lora_scale,
        segment_ids_BT=rows["segment_ids"], positions_BT=rows["positions"],
    )  # fmt: skip
    logp, ent = chunked_token_logprobs(
        h_BTD[:, :-1],
        lambda h: model.lm_logits(config, params, h),
        tokens[:, 1:],
        chunk_size=chunk_size,
        temperature=temperature,
        with_entropy=entropy,
        entropy_grad=grad,
    )
    shift = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
    return shift(logp), None if ent is None else shift(ent)


def logprobs_and_entropy(
    config: ModelConfig, params: Params, tokens: jax.Array, attention_mask: jax.Array | None = None, **options: Any
) -> tuple[jax.Array, jax.Array]:
    """``sequence_logprobs`` (the same arguments, ``entropy_grad`` included) with its entropy in place of the logits:
    ``(logp, entropy)``."""
    logp, _, entropy = sequence_logprobs(config, params, tokens, attention_mask, **options, with_entropy=True)
    return logp, entropy
