"""Every parameter described once: shape, dtype, logical axes and initialiser (``ParamSpec``), from which init,
abstract shapes (restore targets, shardings, counts) and the logical axes for sharding all derive.

Params are ``{"base": ..., "lora": ...}`` and ``"policy"`` where ``config.policy_lora`` is set (LoRA RL's
persistent adapter). Layer weights are stacked on a leading L axis (letters as in ``model``). A LoRA adapter on a
projection ``W [in..., out...]`` is ``A [L, in..., R]`` and ``B [L, R, out...]``, float32 whatever ``param_dtype``
(a frozen bf16 base keeps trained float32 adapters beside it: AdamW's steps of 1e-5 vanish in bf16's 8-bit
mantissa).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from lspo_jax.config import LoraConfig, ModelConfig

Params = dict[str, Any]

# (input dims, output dims) of each LoRA-able projection, as names of ModelConfig sizes.
PROJ_DIMS = {
    "q": (("embed",), ("heads", "head_dim")),
    "k": (("embed",), ("kv_heads", "head_dim")),
    "v": (("embed",), ("kv_heads", "head_dim")),
    "o": (("heads", "head_dim"), ("embed",)),
    "gate": (("embed",), ("mlp",)),
    "up": (("embed",), ("mlp",)),
    "down": (("mlp",), ("embed",)),
}


# ------------------------------------------------------------------------------------ parameter specs
@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Shape, dtype, logical axis names and initialiser of one parameter array.

    ``init`` is "normal" (std = init_scale), "uniform" (in [-init_scale, init_scale]), "zeros" or "ones".
    """

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str, ...]
    init: str = "normal"
    init_scale: float = 0.02


def _axis_sizes(config: ModelConfig) -> dict[str, int]:
    return {
        "layers": config.num_layers,
        "vocab": config.vocab_size,
        "embed": config.hidden_size,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "mlp": config.intermediate_size,
        "lora_rank": config.lora.rank,
    }


def _spec(config: ModelConfig, axes: tuple[str, ...], init: str = "normal", init_scale: float = 0.02) -> ParamSpec:
    sizes = _axis_sizes(config)
    shape = tuple(sizes[a] for a in axes)
    return ParamSpec(shape, jnp.dtype(config.param_dtype), axes, init, init_scale)


def _base_specs(config: ModelConfig) -> Params:
    s = lambda *axes, init="normal": _spec(config, ("layers", *axes), init)  # stacked layer weight
    layers = {"attn_norm": s("embed", init="ones"), "mlp_norm": s("embed", init="ones")}
    for name in ("q", "k", "v", "o", "gate", "up", "down"):
        ins, outs = PROJ_DIMS[name]
        layers[name] = s(*ins, *outs)
        if name in ("q", "k", "v") and config.qkv_bias:  # Qwen2 has biases on q/k/v only
            layers[f"{name}_bias"] = s(*outs, init="zeros")
    if config.qk_norm:  # Qwen3: one RMSNorm weight per head dim, shared by all heads
        layers["q_norm"] = s("head_dim", init="ones")
        layers["k_norm"] = s("head_dim", init="ones")
    base = {
        "embed": _spec(config, ("vocab", "embed")),
        "layers": layers,
        "final_norm": _spec(config, ("embed",), "ones"),
    }
    if not config.tie_word_embeddings:
        base["lm_head"] = _spec(config, ("embed", "vocab"))
    return base


def _lora_specs(config: ModelConfig, adapter: LoraConfig | None = None) -> Params:
    """An adapter's specs (``adapter``: its shape, default the scaffold's ``config.lora``), float32 always."""
    adapter = config.lora if adapter is None else adapter
    sizes = {**_axis_sizes(config), "lora_rank": adapter.rank}
    lora = {}
    for name in adapter.targets:
        ins, outs = PROJ_DIMS[name]
        a_axes, b_axes = ("layers", *ins, "lora_rank"), ("layers", "lora_rank", *outs)
        # peft's default for A: kaiming-uniform(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(math.prod(sizes[a] for a in ins))
        lora[name] = {
            "a": ParamSpec(tuple(sizes[a] for a in a_axes), jnp.dtype("float32"), a_axes, "uniform", bound),
            # B = 0 so that base + fresh adapter equals the base exactly.
            "b": ParamSpec(tuple(sizes[a] for a in b_axes), jnp.dtype("float32"), b_axes, "zeros"),
        }
    return lora


def param_specs(config: ModelConfig) -> Params:
    """The single description of all parameters: ``{"base": {...}, "lora": {...}}`` of ``ParamSpec``, and
    ``"policy"`` (the persistent policy adapter) where ``config.policy_lora`` is set."""
    specs = {"base": _base_specs(config), "lora": _lora_specs(config)}
    if config.policy_lora is not None:
        specs["policy"] = _lora_specs(config, config.policy_lora)
    return specs


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def _init_tree(specs: Params, key: jax.Array) -> Params:
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))

    def init_one(spec: ParamSpec, k: jax.Array) -> jax.Array:
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, spec.dtype)
        if spec.init == "ones":
            return jnp.ones(spec.shape, spec.dtype)
        if spec.init == "uniform":
            return jax.random.uniform(k, spec.shape, jnp.float32, -spec.init_scale, spec.init_scale).astype(spec.dtype)
        return (spec.init_scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(spec.dtype)

    return jax.tree.unflatten(treedef, [init_one(s, k) for s, k in zip(leaves, keys, strict=True)])


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random ``{"base", "lora"}`` params: base ~ N(0, 0.02^2), norms 1, biases 0; LoRA A uniform, B = 0."""
    base_key, lora_key = jax.random.split(key)
    params = {"base": _init_tree(_base_specs(config), base_key), "lora": init_lora(config, lora_key)}
    if config.policy_lora is not None:
        params["policy"] = init_lora(config, jax.random.fold_in(key, 1), config.policy_lora)
    return params


def init_lora(config: ModelConfig, key: jax.Array, adapter: LoraConfig | None = None) -> Params:
    """A fresh adapter subtree: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), B = 0 (so it starts as a no-op); of shape
    ``adapter`` (default the scaffold's ``config.lora``; ``config.policy_lora`` for the policy adapter)."""
    return _init_tree(_lora_specs(config, adapter), key)


def abstract_params(config: ModelConfig) -> Params:
    """``jax.ShapeDtypeStruct`` for every parameter (no allocation): restore targets, shardings, counts."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), param_specs(config), is_leaf=_is_spec)


def logical_axes(config: ModelConfig) -> Params:
    """Logical axis names per parameter, e.g. ``("layers", "embed", "heads", "head_dim")`` for q.

    The tuples are leaves: map over them with ``is_leaf=lambda x: isinstance(x, tuple)``.
    """
    return jax.tree.map(lambda s: s.axes, param_specs(config), is_leaf=_is_spec)


def count_params(tree: Any) -> int:
    """Total number of elements over the leaves of a pytree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))
