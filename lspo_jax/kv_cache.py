"""The decoder's key/value cache as a plain pytree value: per layer ``{"k": [B, K, S, E], "v": [B, K, S, E]}``.

A tuple of L such dicts, one buffer per layer, so the unrolled decode step reads and writes each in place.
Letters as in ``model.py`` (L layers, B rows, S cache slots, K key/value heads, E head dim). The cache is
never mutated in place by Python code: functions take it and return a new one, and the jitted decode
loop that owns it has it donated, so XLA updates the buffer in place. Under a mesh every function here
returns the cache in the layout ``sharding.kv_cache_sharding`` describes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lspo_jax import axes
from lspo_jax.config import ModelConfig
from lspo_jax.model import CACHE_AXES, Params


def init_cache(config: ModelConfig, batch: int, length: int, dtype: str | None = None) -> Params:
    """A zero cache of ``length`` slots per row, in the compute dtype unless ``dtype`` is given.

    Keeping it in the compute dtype (bf16 on accelerators) halves the bytes every decode step reads.
    """
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    dtype = jnp.dtype(dtype or config.compute_dtype)
    layers = tuple({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(config.num_layers))
    return constrain(layers)


def repeat_rows(cache: Params, n: int) -> Params:
    """Each row ``n`` times in a row (row b becomes rows b*n .. b*n+n-1), as ``jnp.repeat`` on the B axis."""
    return constrain(jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), cache))


def grow_cache(cache: Params, length: int) -> Params:
    """The same cache with empty slots appended up to ``length`` (written slots keep their indices)."""
    return constrain(jax.tree.map(lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0))), cache))


def constrain(cache: Params) -> Params:
    """Pin the cache's layout under a mesh: rows over the data axes, KV heads over ``tp`` (``sharding``)."""
    return jax.tree.map(lambda x: axes.constrain(x, CACHE_AXES), cache)


def cache_nbytes(config: ModelConfig, batch: int, length: int, dtype: str | None = None) -> int:
    """Bytes of keys plus values for ``batch`` rows of ``length`` slots."""
    itemsize = jnp.dtype(dtype or config.compute_dtype).itemsize
    return 2 * config.num_layers * batch * length * config.num_kv_heads * config.head_dim * itemsize
