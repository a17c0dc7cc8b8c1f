"""The params as the sampler's programs read them: the adapter subtree kept or dropped (``sampling_params``), cast to
the compute dtype, placed in the decode layout on the mesh and split per layer for the unrolled decode, once per call
(``decode_weights``)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lspo_jax.config import ModelConfig
from lspo_jax.models import sharding
from lspo_jax.models.model import unstack_layers
from lspo_jax.models.specs import Params


def sampling_params(config: ModelConfig, params: Params, lora_scale: Any) -> tuple[Params, jax.Array]:
    """The params subtree the programs see and the traced scale.

    The policy adapter (``params["policy"]``, LoRA RL) is kept: it is part of the policy.
    A Python 0 drops the adapter subtree, so the model skips the adapter matmuls: the base-policy program
    (the bulk of all sampling) is exactly the base model. Any other scale is traced, so every adapter-on
    value shares one second program. ``decode_weights`` then makes the call's one copy of the weights.
    """
    adapter_on = not (isinstance(lora_scale, int | float) and lora_scale == 0)
    if adapter_on and not params.get("lora"):
        raise ValueError(f"lora_scale={lora_scale!r} but params have no 'lora' subtree")
    tree = {k: params[k] for k in ("base", "policy", *(("lora",) if adapter_on else ())) if k in params}
    return tree, jnp.asarray(lora_scale if adapter_on else 0.0, jnp.float32)


def decode_weights(config: ModelConfig, tree: Params, mesh: jax.sharding.Mesh) -> Params:
    """The weights as the programs read them: in the compute dtype (an fp32 master copy is cast once, so a
    decode step reads half the bytes) and split per layer. The cast comes before the placement, so the weights
    gathered over ``fsdp`` are the narrow ones."""
    dtype = jnp.dtype(config.compute_dtype)
    if any(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype for x in jax.tree.leaves(tree)):
        tree = _cast(tree, dtype.name)  # an fp32 master copy for a bf16 sampler; nothing to do when they agree
    tree = _place_on_mesh(config, tree, mesh)
    return unstack_weights(config, tree)


def _place_on_mesh(config: ModelConfig, tree: Params, mesh: jax.sharding.Mesh) -> Params:
    """The sampling params in the decode layout: split over ``tp`` only, whole on every data-parallel replica.

    Gathering FSDP-split weights at every generated token would move the whole model per step; holding
    them (in the compute dtype) on each replica costs less than the KV cache of a long rollout.
    """
    return sharding.shard_params(tree, sharding.param_shardings(config, mesh, gather_fsdp=True))


def _cast_floats(tree: Params, dtype: Any) -> Params:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


_cast = jax.jit(_cast_floats, static_argnames=("dtype",))


@functools.partial(jax.jit, static_argnames=("config",))
def unstack_weights(config: ModelConfig, tree: Params) -> Params:
    """Per-layer weights in the compute dtype for the unrolled decode (``model.decoder``): cast and split in one
    program, so a call holds one extra copy of the weights (none per step)."""
    tree = _cast_floats(tree, jnp.dtype(config.compute_dtype))
    layers, lora = unstack_layers(config, tree["base"]["layers"], tree.get("lora"))
    out = {"base": {**tree["base"], "layers": layers}}
    if "policy" in tree:  # LoRA RL's policy adapter, applied unmerged at every step (``model.decoder``)
        out["policy"] = unstack_layers(config, tree["policy"])[0]
    return out if lora is None else {**out, "lora": lora}


def layer_shardings(shardings: Params, num_layers: int) -> tuple[Params, ...]:
    """The per-layer shardings of stacked ones: each spec without its leading L entry (never split)."""
    drop_l = lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
    return (jax.tree.map(drop_l, shardings),) * num_layers
