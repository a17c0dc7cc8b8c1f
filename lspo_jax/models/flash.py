"""Blocked (flash-style) attention in pure JAX: causal within segments, never a ``[T, T]`` score matrix.

``blocked_attention(q, k, v, segment_ids)`` is grouped-query attention where query t sees key s iff both hold
the same segment id, that id is not 0 (0 marks padding) and s <= t. One segment per row with 0 on the padding
is the left-padded rollout row; several segments in a row are packed sequences, each attending to itself only.

The forward pass walks query blocks (``lax.map``) and, inside each, key blocks (``fori_loop``) with an online
softmax (running max, normaliser and weighted sum in float32), so it holds ``[B, H, block_q, block_k]`` scores
at a time. The backward pass (a ``custom_vjp``, FlashAttention-2's recurrences) recomputes each block's
probabilities from the saved per-query log-normaliser and walks key blocks outside, query blocks inside; it
too stays O(T x block). A block pair in which no query sees any key (above the causal diagonal, or between
disjoint segments) is skipped in both passes (``lax.cond``).

A query that sees no key (padding) gets output 0 and passes no gradient; the einsum path (``attention.attend``)
gives such a query the values' mean instead. No real token ever reads a padding query's output, so the two
agree wherever a result is used: on every query that sees a key.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Finite stand-in for -inf (as ``attention._MASKED``): masked scores stay finite, so no NaN from inf - inf.
_MASKED = -1e30
DEFAULT_BLOCK = 128


def blocked_attention(
    q_BTHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, segment_ids_BT: jax.Array, *, block: int = DEFAULT_BLOCK
) -> jax.Array:
    """``softmax(q k^T / sqrt(E) + mask) v`` over segments (module docstring); query head h reads KV head h // G.

    ``q`` ``[B, T, H, E]``, ``k`` and ``v`` ``[B, T, K, E]``, ``segment_ids`` ``[B, T]`` int (0: padding).
    Rows are padded to a multiple of ``min(block, T)`` inside (padding is segment 0) and cut back.
    """
    t = q_BTHE.shape[1]
    size = min(block, t)
    pad = -t % size
    if pad:
        widen = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        q_BTHE, k_BTKE, v_BTKE, segment_ids_BT = map(widen, (q_BTHE, k_BTKE, v_BTKE, segment_ids_BT))
    out_BTHE = _flash(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT.astype(jnp.int32), size)
    return out_BTHE[:, :t]


def _visible(seg_q_BQ: jax.Array, seg_k_BS: jax.Array, pos_q_Q: jax.Array, pos_k_S: jax.Array) -> jax.Array:
    """``[B, Q, S]``: same non-zero segment and key not after query."""
    same = (seg_q_BQ[:, :, None] == seg_k_BS[:, None, :]) & (seg_q_BQ[:, :, None] > 0)
    return same & (pos_q_Q[:, None] >= pos_k_S[None, :])


def _query_heads(x_BTHE: jax.Array, kv_heads: int) -> jax.Array:
    """A query-shaped array (q, its output or their cotangents) as ``[B, K, G, T, E]``: blocks are slices along T."""
    b, t, h, e = x_BTHE.shape
    return x_BTHE.reshape(b, t, kv_heads, h // kv_heads, e).transpose(0, 2, 3, 1, 4)


def _heads(q_BTHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array):
    """q as ``[B, K, G, T, E]``, k and v as ``[B, K, T, E]``."""
    return _query_heads(q_BTHE, k_BTKE.shape[2]), k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)


def _block(x: jax.Array, index: jax.Array, size: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, size):
    return _forward(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, size)[0]


def _forward(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, size):
    """``(out [B, T, H, E], log-normaliser [B, K, G, T] float32, _MASKED where a query sees nothing)``."""
    b, t, h, e = q_BTHE.shape
    q_BKGTE, k_BKTE, v_BKTE = _heads(q_BTHE, k_BTKE, v_BTKE)
    scale, blocks = e**-0.5, t // size
    positions = jnp.arange(t)

    def query_block(i):
        q_BKGQE = _block(q_BKGTE, i, size, 3)
        seg_q, pos_q = _block(segment_ids_BT, i, size, 1), _block(positions, i, size, 0)

        def key_block(j, carry):
            visible_BQS = _visible(seg_q, _block(segment_ids_BT, j, size, 1), pos_q, _block(positions, j, size, 0))

            def update(carry):
                m, norm, acc = carry
                k_BKSE, v_BKSE = _block(k_BKTE, j, size, 2), _block(v_BKTE, j, size, 2)
                s = jnp.einsum("bkgqe,bkse->bkgqs", q_BKGQE, k_BKSE, preferred_element_type=jnp.float32) * scale
                s = jnp.where(visible_BQS[:, None, None], s, _MASKED)
                m_new = jnp.maximum(m, s.max(axis=-1))
                p = jnp.where(visible_BQS[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqs,bkse->bkgqe", p.astype(v_BKSE.dtype), v_BKSE, preferred_element_type=jnp.float32)
                return m_new, alpha * norm + p.sum(axis=-1), alpha[..., None] * acc + pv

            return jax.lax.cond(jnp.any(visible_BQS), update, lambda c: c, carry)

        shape = q_BKGQE.shape[:-1]
        init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, e)))
        m, norm, acc = jax.lax.fori_loop(0, blocks, key_block, init)
        seen = norm > 0  # the query saw a key
        safe = jnp.where(seen, norm, 1.0)
        out = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
        return out, jnp.where(seen, m + jnp.log(safe), _MASKED)

    out_NBKGQE, lse_NBKGQ = jax.lax.map(query_block, jnp.arange(blocks))
    out_BKGTE = jnp.moveaxis(out_NBKGQE, 0, 3).reshape(q_BKGTE.shape)
    lse_BKGT = jnp.moveaxis(lse_NBKGQ, 0, 3).reshape(q_BKGTE.shape[:-1])
    out_BTHE = out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e).astype(q_BTHE.dtype)
    return out_BTHE, lse_BKGT


def _flash_fwd(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, size):
    out_BTHE, lse_BKGT = _forward(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, size)
    return out_BTHE, (q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, out_BTHE, lse_BKGT)


def _flash_bwd(size, residuals, d_out_BTHE):
    q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, out_BTHE, lse_BKGT = residuals
    b, t, h, e = q_BTHE.shape
    q_BKGTE, k_BKTE, v_BKTE = _heads(q_BTHE, k_BTKE, v_BTKE)
    do_BKGTE = _query_heads(d_out_BTHE, k_BTKE.shape[2]).astype(jnp.float32)
    # D_t = sum_e dO * O: the softmax backward's row term (FlashAttention-2).
    delta_BKGT = jnp.sum(do_BKGTE * _query_heads(out_BTHE, k_BTKE.shape[2]).astype(jnp.float32), axis=-1)
    scale, blocks = e**-0.5, t // size
    positions = jnp.arange(t)

    def key_block(dq_BKGTE, j):  # a scan step: dq is carried, each key block's dk and dv stacked
        k_BKSE, v_BKSE = _block(k_BKTE, j, size, 2), _block(v_BKTE, j, size, 2)
        seg_k, pos_k = _block(segment_ids_BT, j, size, 1), _block(positions, j, size, 0)

        def query_block(i, carry):
            visible_BQS = _visible(_block(segment_ids_BT, i, size, 1), seg_k, _block(positions, i, size, 0), pos_k)

            def update(carry):
                dq, dk, dv = carry
                q_BKGQE, do_BKGQE = _block(q_BKGTE, i, size, 3), _block(do_BKGTE, i, size, 3)
                s = jnp.einsum("bkgqe,bkse->bkgqs", q_BKGQE, k_BKSE, preferred_element_type=jnp.float32) * scale
                p = jnp.where(visible_BQS[:, None, None], jnp.exp(s - _block(lse_BKGT, i, size, 3)[..., None]), 0.0)
                dv = dv + jnp.einsum("bkgqs,bkgqe->bkse", p, do_BKGQE)
                dp = jnp.einsum("bkgqe,bkse->bkgqs", do_BKGQE, v_BKSE.astype(jnp.float32))
                ds = p * (dp - _block(delta_BKGT, i, size, 3)[..., None]) * scale
                dq_i = _block(dq, i, size, 3) + jnp.einsum("bkgqs,bkse->bkgqe", ds, k_BKSE.astype(jnp.float32))
                dk = dk + jnp.einsum("bkgqs,bkgqe->bkse", ds, q_BKGQE.astype(jnp.float32))
                return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * size, axis=3), dk, dv

            return jax.lax.cond(jnp.any(visible_BQS), update, lambda c: c, carry)

        zeros = jnp.zeros(k_BKSE.shape, jnp.float32)
        dq_BKGTE, dk_BKSE, dv_BKSE = jax.lax.fori_loop(0, blocks, query_block, (dq_BKGTE, zeros, zeros))
        return dq_BKGTE, (dk_BKSE, dv_BKSE)

    dq_BKGTE, (dk_NBKSE, dv_NBKSE) = jax.lax.scan(key_block, jnp.zeros(q_BKGTE.shape, jnp.float32), jnp.arange(blocks))
    to_btke = lambda x: jnp.moveaxis(x, 0, 2).reshape(k_BKTE.shape).transpose(0, 2, 1, 3)
    dq_BTHE = dq_BKGTE.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e)
    return (
        dq_BTHE.astype(q_BTHE.dtype),
        to_btke(dk_NBKSE).astype(k_BTKE.dtype),
        to_btke(dv_NBKSE).astype(v_BTKE.dtype),
        None,
    )


_flash.defvjp(_flash_fwd, _flash_bwd)
