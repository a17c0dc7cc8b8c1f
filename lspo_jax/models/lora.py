"""LoRA applied: a projection with its adapters on, the adapters a pass applies, and the adapters folded into the base.

LoRA on a projection ``y = x W`` adds ``c * (x A) B`` with ``c = (alpha / rank) * lora_scale``; A has the input dims
of W followed by R, B has R followed by the output dims of W, so ``A B`` has W's shape (``specs``). Two adapters
may stack on one projection, ``y = x W + c_p (x A_p) B_p + c (x A) B``: the policy adapter ``params["policy"]``
(LoRA RL, ``config.policy_lora``), always on at ``c_p = alpha_p / rank_p``, and the scaffold's ``params["lora"]``
switched by ``lora_scale``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lspo_jax.config import ModelConfig
from lspo_jax.models.specs import PROJ_DIMS, Params

# The adapters on a pass, in order: (this layer's adapter tree, its multiplier c), the policy's then the scaffold's.
Adapters = tuple[tuple[Params, Any], ...]


def linear(x: jax.Array, w: jax.Array, adapters: Adapters, name: str, n_in: int = 1) -> jax.Array:
    """``x W + sum_i c_i (x A_i) B_i`` over the ``adapters`` that target projection ``name``, contracting the last
    ``n_in`` dims of x with the leading (input) dims of W."""
    y = jnp.tensordot(x, w.astype(x.dtype), axes=n_in)
    for lora, lora_c in adapters:
        if name not in lora:
            continue
        # Scale the rank-R intermediate, not the output: cheaper, and c = 0 gives exact zeros (0 * finite),
        # so lora_scale = 0 adds exact zeros to the base's output and gives the adapter exactly zero gradient.
        xa = jnp.tensordot(x, lora[name]["a"].astype(x.dtype), axes=n_in) * jnp.asarray(lora_c, x.dtype)
        y = y + jnp.tensordot(xa, lora[name]["b"].astype(x.dtype), axes=1)
    return y


def effective_lora(config: ModelConfig, params: Params, lora_scale: jax.Array | float) -> tuple[tuple, tuple]:
    """The adapters a pass applies, as (stacked trees, multipliers): the policy adapter always, at its alpha / rank;
    the scaffold's at ``config.lora.scale * lora_scale`` unless ``lora_scale`` is a Python 0."""
    trees, scales = [], []
    if params.get("policy"):
        trees.append(params["policy"])
        scales.append(config.policy_lora.scale)
    lora = params.get("lora")
    # A Python 0 is known at trace time: skip the adapter matmuls altogether (the RL forward pass).
    if lora and not (isinstance(lora_scale, int | float) and lora_scale == 0):
        trees.append(lora)
        scales.append(config.lora.scale * lora_scale)
    return tuple(trees), tuple(scales)


def merge_lora(config: ModelConfig, params: Params, lora_scale: float = 1.0) -> Params:
    """Base params with the adapters folded in: ``W <- W + c_p A_p B_p + (alpha / rank) * lora_scale * A B`` per
    target, the policy adapter's term (``params["policy"]``, at ``c_p = alpha_p / rank_p``) wherever it is present,
    the scaffold's (``params["lora"]``) unless ``lora_scale`` is 0.

    Returns the base subtree only (the ``params["base"]`` layout), for engines that take plain weights. The deltas
    are summed in float32 and added to W once, so a bf16 base is rounded once.
    """
    base = params["base"]
    trees, scales = effective_lora(config, params, lora_scale)
    # Per layer, contract A's rank axis with B's: [*in, R] x [R, *out] -> [*in, *out] = W's shape.
    # HIGHEST precision: on GPU a float32 matmul may otherwise run in TF32 and lose ~3 digits.
    product = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1, precision=jax.lax.Precision.HIGHEST))
    layers = dict(base["layers"])
    for name in PROJ_DIMS:
        terms = [c * product(t[name]["a"].astype(jnp.float32), t[name]["b"].astype(jnp.float32))
                 for t, c in zip(trees, scales, strict=True) if name in t]  # fmt: skip
        if terms:
            layers[name] = (layers[name].astype(jnp.float32) + sum(terms)).astype(layers[name].dtype)
    return {**base, "layers": layers}
