"""Random params for the tests that compare one computation with another: wider than ``init_params`` draws them.

Drawn with numpy (no per-shape XLA compile of the JAX PRNG), std 0.15 and norms around 1, so the logits are O(1) and a
layout bug (a transpose, a position off by one) moves them far beyond any tolerance; LoRA B is non-zero too: a fresh
adapter has B = 0, which would hide a wrong adapter formula.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax.config import ModelConfig
from lspo_jax.models.specs import abstract_params


def wide_params(config: ModelConfig, seed: int = 0, *, lora_std: float):
    """``{"base", "lora"}`` params of ``config``, laid out by ``abstract_params``: norms ``1 + 0.1 N(0, 1)``, LoRA
    weights ``lora_std N(0, 1)``, every other weight and bias ``0.15 N(0, 1)``."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if "norm" in name:
            return jnp.asarray(1.0 + 0.1 * noise)
        return jnp.asarray((lora_std if "lora" in name else 0.15) * noise)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(config))
