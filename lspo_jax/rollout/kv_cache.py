"""The decoder's key/value cache as a plain pytree value: per layer ``{"k": [B, K, S, E], "v": [B, K, S, E]}``,
or with the keys slots-last as ``"kT": [B, K, E, S]`` (``attention.cache_key_name``: the leaf's name is its layout).

A tuple of L such dicts, one buffer per layer, so the unrolled decode step reads and writes each in place.
Letters as in ``model.py`` (L layers, B rows, S cache slots, K key/value heads, E head dim). The cache is
never mutated in place by Python code: functions take it and return a new one, and the jitted decode
loop that owns it has it donated, so XLA updates the buffer in place. Under a mesh every function here
returns the cache in the layout ``sharding.kv_cache_sharding`` describes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lspo_jax.config import ModelConfig
from lspo_jax.models import axes
from lspo_jax.models.attention import CACHE_LEAF_AXES, cache_key_name
from lspo_jax.models.specs import Params


def init_cache(config: ModelConfig, batch: int, length: int, dtype: str | None = None) -> Params:
    """A zero cache of ``length`` slots per row, in the compute dtype unless ``dtype`` is given.

    Keeping it in the compute dtype (bf16 on accelerators) halves the bytes every decode step reads.
    """
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    keys = cache_key_name(config)
    key_shape = shape if keys == "k" else (batch, config.num_kv_heads, config.head_dim, length)
    dtype = jnp.dtype(dtype or config.compute_dtype)
    layer = lambda: {keys: jnp.zeros(key_shape, dtype), "v": jnp.zeros(shape, dtype)}
    return constrain(tuple(layer() for _ in range(config.num_layers)))


def repeat_rows(cache: Params, n: int) -> Params:
    """Each row ``n`` times in a row (row b becomes rows b*n .. b*n+n-1), as ``jnp.repeat`` on the B axis."""
    return constrain(jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), cache))


def grow_cache(cache: Params, length: int) -> Params:
    """The same cache with empty slots appended up to ``length`` (written slots keep their indices)."""

    def grow(name: str, x: jax.Array) -> jax.Array:
        slots = CACHE_LEAF_AXES[name].index("length")
        widths = [(0, 0)] * x.ndim
        widths[slots] = (0, length - x.shape[slots])
        return jnp.pad(x, widths)

    return constrain(tuple({name: grow(name, x) for name, x in layer.items()} for layer in cache))


def constrain(cache: Params) -> Params:
    """Pin the cache's layout under a mesh: rows over the data axes, KV heads over ``tp`` (``sharding``)."""
    return tuple({name: axes.constrain(x, CACHE_LEAF_AXES[name]) for name, x in layer.items()} for layer in cache)


def cache_nbytes(config: ModelConfig, batch: int, length: int, dtype: str | None = None) -> int:
    """Bytes of keys plus values for ``batch`` rows of ``length`` slots."""
    itemsize = jnp.dtype(dtype or config.compute_dtype).itemsize
    return 2 * config.num_layers * batch * length * config.num_kv_heads * config.head_dim * itemsize
