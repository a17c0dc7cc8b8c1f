"""The blocked attention (``flash``) against the einsum path: values and gradients over segments, left-padded
prompts, empty rows and one-token segments; blocks no query can see are skipped; the model through it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_relative

from lspo_jax.config import ModelConfig
from lspo_jax.models import attention, flash, kernels, specs
from lspo_jax.rl import logprobs

B, T, H, K, E = 5, 37, 4, 2, 16  # T is no multiple of the blocks below: the last block is padded inside


def segments() -> np.ndarray:
    seg = np.zeros((B, T), np.int32)
    seg[0, 5:] = 1  # a left-padded row: 5 pads, then one sequence
    seg[1, :10], seg[1, 10], seg[1, 11:30] = 1, 2, 3  # packed: 10 tokens, a one-token segment, 19, right padding
    seg[3, :] = np.arange(1, T + 1)  # every token its own segment: each query sees itself only
    seg[4, 3:20], seg[4, 20:] = 7, 8  # left padding, then two packed sequences with arbitrary ids
    return seg  # row 2: empty (mesh or bucket padding)


def visible(seg: np.ndarray) -> np.ndarray:
    """``[B, T, S]``: the definition written out (same non-zero segment, key not after query)."""
    pos = np.arange(T)
    return (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0) & (pos[:, None] >= pos[None, :])


def qkv(seed: int = 0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return normal(B, T, H, E), normal(B, T, K, E), normal(B, T, K, E), normal(B, T, H, E)


def einsum_attention(seg):
    mask = jnp.asarray(visible(seg))
    return lambda q, k, v: attention.attend(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask)


# Scale of the comparison: outputs are convex combinations of O(1) values, gradients sums of O(T) such terms;
# float32 summation in another order (blocks, online rescaling) moves them by ~1e-7 of their norm (2.4e-7
# measured), a wrong mask or a missing rescale by O(1). 2e-5 and 1e-4 as for the model's logits and gradients.
@pytest.mark.parametrize("block", [8, 128])  # several blocks (and a padded last one); one block
def test_blocked_attention_equals_einsum_with_segments_padding_and_empty_rows(block):
    seg = segments()
    q, k, v, w = qkv()
    seen = jnp.asarray(visible(seg).any(axis=-1))[:, :, None, None]  # queries that see a key
    got_fn = lambda q, k, v: flash.blocked_attention(q, k, v, jnp.asarray(seg), block=block)
    want_fn = einsum_attention(seg)
    assert_close_relative(got_fn(q, k, v) * seen, want_fn(q, k, v) * seen, 2e-5)
    assert not np.any(np.asarray(got_fn(q, k, v))[~np.asarray(seen[..., 0, 0])])  # a query that sees nothing: 0
    # Gradients of a loss over the queries that see a key (no result ever reads the others).
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * w * seen)
    got = jax.jit(jax.grad(loss(got_fn), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(want_fn), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", got, want, strict=True):
        assert_close_relative(g, r, 1e-4, err_msg=f"d{name}")


def test_blocks_no_query_sees_are_never_computed():
    """NaN keys and values in blocks that no query of a block can see (above the causal diagonal) would poison
    a computed block (0 * NaN); skipped, they leave the earlier queries' outputs and query gradients as without
    them. (The keys' gradients are not checked: the later queries do see the NaN keys, so their log-normaliser
    is NaN and so is what they pass back to every key.)"""
    seg = np.ones((B, 32), np.int32)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(B, 32, n, E)), jnp.float32) for n in (H, K, K))
    poisoned = lambda x: x.at[:, 16:].set(jnp.nan)  # keys 16-31: only queries 16-31 may see them
    attn = lambda q, k, v: flash.blocked_attention(q, k, v, jnp.asarray(seg), block=8)[:, :16]
    clean, dirty = attn(q, k, v), attn(q, poisoned(k), poisoned(v))
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
    dq = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)))(q, poisoned(k), poisoned(v))
    np.testing.assert_array_equal(
        np.asarray(dq[:, :16]), np.asarray(jax.grad(lambda q: jnp.sum(attn(q, k, v)))(q)[:, :16])
    )


def test_the_model_through_the_blocked_attention_equals_einsum():
    """Log-probs and their gradient for left-padded rows (a prompt, a response, right padding) and an empty row."""
    config = ModelConfig.preset("tiny")
    params = specs.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(1, config.vocab_size, size=(3, 24)), jnp.int32)
    mask = np.zeros((3, 24), np.int32)
    mask[0, 4:20], mask[1, :24] = 1, 1  # row 2 empty
    mask = jnp.asarray(mask)
    blocked = dataclasses.replace(config, attention="blocked")

    def summed(cfg):
        def fn(p):
            logp, _ = logprobs.sequence_logprobs(cfg, p, tokens, mask)
            return jnp.sum(jnp.where(mask[:, 1:] * mask[:, :-1] > 0, logp[:, 1:], 0.0))  # real token after real

        return fn

    # A token's log-prob is read from the position before it: only where both are real (the first real token of a
    # row is predicted from a padding query, which attends to nothing in the blocked path; no loss reads it).
    read = jnp.pad(mask[:, 1:] * mask[:, :-1], ((0, 0), (1, 0)))
    want_logp = logprobs.sequence_logprobs(config, params, tokens, mask)[0] * read
    got_logp = logprobs.sequence_logprobs(blocked, params, tokens, mask)[0] * read
    assert_close_relative(got_logp, want_logp, 2e-5)
    want, got = jax.grad(summed(config))(params), jax.jit(jax.grad(summed(blocked)))(params)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close_relative(g, r, 1e-4)


@pytest.mark.parametrize("kernel", kernels.KERNELS)
def test_vendor_kernels_equal_einsum_in_the_interpreter(kernel):
    """Pallas GPU attention and TPU splash attention (``kernels``), run by Pallas's interpreter on the CPU, against
    the einsum path on every query that sees a key: segments, left padding, one-token segments, an empty row.
    Padding queries are left out: the kernels let them attend to other padding, and no result reads them."""
    seg = segments()
    q, k, v, w = qkv(seed=3)
    seen = jnp.asarray(visible(seg).any(axis=-1))[:, :, None, None]
    got_fn = lambda q, k, v: kernels.segment_attention(kernel, q, k, v, jnp.asarray(seg))
    want_fn = einsum_attention(seg)
    assert_close_relative(got_fn(q, k, v) * seen, want_fn(q, k, v) * seen, 2e-5)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * w * seen)
    got = jax.grad(loss(got_fn), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(want_fn), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", got, want, strict=True):
        assert_close_relative(g, r, 1e-4, err_msg=f"{kernel} d{name}")


@pytest.mark.parametrize("implementation", ["reduce", "xla", "pallas"])
def test_decode_attention_equals_einsum(implementation):
    """The decode step's attention (one query per row over a cache of 48 slots) against ``attend``: each row sees
    one contiguous range of slots, as in the sampler (a left-padded prompt, then the generated slots); the ranges
    cover the whole cache, a middle stretch, a single slot, and a range crossing the kernel's 16-slot splits."""
    rng = np.random.default_rng(3)
    slots = 48
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, k, v = normal(4, 1, H, E), normal(4, K, slots, E), normal(4, K, slots, E)
    start, end = np.array([0, 5, 16, 31]), np.array([48, 40, 17, 35])
    mask = jnp.asarray((np.arange(slots) >= start[:, None]) & (np.arange(slots) < end[:, None]))[:, None]
    ref = attention.attend(q, k, v, mask)
    config = ModelConfig.preset("tiny", decode_attention=implementation)
    keys = k if attention.cache_key_name(config) == "k" else jnp.swapaxes(k, 2, 3)  # the cache's layout for it
    out = jax.jit(attention.decode_attend, static_argnums=0)(implementation, q, keys, v, mask)
    # A weighted mean of unit normals: float32 sums of <= 48 terms in another order differ by about
    # sqrt(48) * 6e-8 = 4e-7 of the values at worst, so 1e-6 of the norm holds on any x86 build.
    assert_close_relative(out, ref, 1e-6)
