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

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from lspo_jax import losses, model
from lspo_jax.config import ModelConfig
from lspo_jax.model import Params

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
) -> tuple[jax.Array, jax.Array | None]:
    """Per-token log-probs aligned with ``tokens``, and the logits they came from.

    ``logp[:, t] = log softmax(logits[:, t - 1] / temperature)[tokens[:, t]]`` for ``t >= 1`` and
    ``logp[:, 0] = 0`` (nothing predicts the first token), so a loss mask in token coordinates (True on the
    generated tokens) applies directly; position 0 must be masked out (in packed rows, each segment's first
    token). Returns ``(logp [B, T], logits)``. With ``chunk_size`` the LM head runs that many positions at a
    time (``losses.chunked_token_logprobs``) and the logits, never held whole, are returned as None.
    """
    rows = dict(attention_mask=attention_mask, segment_ids=segment_ids, positions=positions)
    if chunk_size is not None:
        logp, _ = _chunked_logprobs(config, params, tokens, rows, lora_scale, temperature, chunk_size)
        return logp, None
    logits = model.forward(config, params, tokens, **rows, lora_scale=lora_scale)
    logp = losses.token_logprobs(logits[:, :-1], tokens[:, 1:], temperature)
    return jnp.pad(logp, ((0, 0), (1, 0))), logits


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
    split = jax.tree.map(lambda x: losses.split_rows(x, num_micro_batches), inputs)
    return losses.merge_rows(jax.lax.map(one, split))


def _chunked_logprobs(config, params, tokens, rows, lora_scale, temperature, chunk_size, entropy=False):
    h_BTD = model.hidden_states(
        config, params, tokens, rows["attention_mask"], lora_scale=lora_scale,
        segment_ids_BT=rows["segment_ids"], positions_BT=rows["positions"],
    )  # fmt: skip
    logp, ent = losses.chunked_token_logprobs(
        h_BTD[:, :-1],
        lambda h: model.lm_logits(config, params, h),
        tokens[:, 1:],
        chunk_size=chunk_size,
        temperature=temperature,
        with_entropy=entropy,
    )
    shift = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
    return shift(logp), None if ent is None else shift(ent)


def logprobs_and_entropy(
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
) -> tuple[jax.Array, jax.Array]:
    """``sequence_logprobs`` and the entropy of each predicting distribution (``losses.token_entropy``,
    a metric without gradient), ``[B, T]`` each, aligned alike (position 0 holds 0); chunked as there."""
    rows = dict(attention_mask=attention_mask, segment_ids=segment_ids, positions=positions)
    if chunk_size is not None:
        return _chunked_logprobs(config, params, tokens, rows, lora_scale, temperature, chunk_size, True)
    logp, logits = sequence_logprobs(config, params, tokens, **rows, lora_scale=lora_scale, temperature=temperature)
    entropy = losses.token_entropy(jax.lax.stop_gradient(logits[:, :-1]), temperature)
    return logp, jnp.pad(entropy, ((0, 0), (1, 0)))
