"""The decoder of Qwen2, Qwen3 and Llama 3.x as pure functions of a params pytree, with LoRA as a separate subtree.

The families (``config.FAMILIES``) share one pre-norm layer and differ in a few features, chosen at trace time from
the static config: Qwen2's q/k/v biases, Qwen3's per-head RMSNorm of q and k before RoPE, Llama 3's remapped rotary
frequencies (``rope_frequencies``).

Shape legend (einsum letters; array names carry them as suffixes, e.g. ``x_BTD``):
    B batch            T query positions        S key positions (T, or the KV-cache length)
    D hidden (embed)   H query heads            K key/value heads        G query heads per KV head (H = K*G)
    E head dim         F MLP hidden             V vocabulary             R LoRA rank
    L layers (leading axis of every stacked layer weight)

Params are ``{"base": ..., "lora": ...}``. Everything about them (shape, dtype, logical axes, initialiser)
is written once in ``param_specs``; init, abstract shapes and logical axes for sharding derive from it.
Layer weights are stacked on a leading L axis and the cache-free decoder (training, log-probs) is a
``jax.lax.scan`` over them, so its compile time does not grow with depth. The cached decoder (sampling) runs
the layers unrolled, each with its own KV-cache buffer: decode is memory-bound and a scan would copy each
layer's slice of the stacked weights and cache before reading it (``_cached_layers``).

Attention in cache-free passes is ``config.attention``: the written-out einsums (``attend``, any backend) or
``jax.nn.dot_product_attention`` (``xla``, or ``cudnn``'s fused flash kernel on a GPU), which takes
right-padded rows of given lengths, so each row is rotated to right padding and back (``_fused_hidden_states``),
or ``blocked`` (``flash.blocked_attention``, pure JAX, flash-style, over segment ids: a row's real tokens), or a
vendor kernel over segment ids (``kernels``: ``pallas`` on GPUs, ``splash`` on TPUs).

LoRA on a projection ``y = x W`` adds ``c * (x A) B`` with ``c = (alpha / rank) * lora_scale``; A has
the input dims of W followed by R, B has R followed by the output dims of W, so ``A B`` has W's shape.
Two adapters may stack on one projection, ``y = x W + c_p (x A_p) B_p + c (x A) B``: the policy adapter
``params["policy"]`` (LoRA RL, ``config.policy_lora``), always on at ``c_p = alpha_p / rank_p``, and the scaffold's
``params["lora"]`` switched by ``lora_scale``. Adapters are float32 whatever ``param_dtype`` (a frozen bf16 base
keeps trained float32 adapters beside it: AdamW's steps of 1e-5 vanish in bf16's 8-bit mantissa).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lspo_jax import options
from lspo_jax.config import LoraConfig, ModelConfig
from lspo_jax.models.axes import constrain, logical_spec
from lspo_jax.models.flash import blocked_attention
from lspo_jax.models.kernels import decode_attention, segment_attention

Params = dict[str, Any]

# (input dims, output dims) of each LoRA-able projection, as names of ModelConfig sizes.
_PROJ_DIMS = {
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
        ins, outs = _PROJ_DIMS[name]
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
        ins, outs = _PROJ_DIMS[name]
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


# Logical axes of each layer's KV-cache leaf ``[B, K, S, E]`` (``decoder``), for its layout on a mesh. KV heads
# sit before the slots so that a decode step's ``q k^T`` and ``p v`` are batched over leading (B, K) dims:
# with slots first, XLA copied every layer's whole cache into that order at every step (seen in the CPU HLO).
CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")
# With ``decode_attention: reduce`` the keys are stored slots-last, as ``"kT": [B, K, E, S]``: the decode
# step's q k^T then sums over E across vectors of S contiguous slots, which XLA's CPU backend vectorizes, where
# summing each slot's E values is a horizontal reduction per slot. The other implementations take slots-first
# keys (``"k"``); the name says the layout, so the cache functions need no config.
KEYS_T_AXES = ("batch", "kv_heads", "head_dim", "length")
CACHE_LEAF_AXES = {"k": CACHE_AXES, "kT": KEYS_T_AXES, "v": CACHE_AXES}


def cache_key_name(config: ModelConfig) -> str:
    """The cache leaf that holds the keys: ``"kT"`` (``[B, K, E, S]``) for ``reduce``, ``"k"`` otherwise."""
    return DECODE_ATTENTIONS.resolve(config.decode_attention).key_name


def count_params(tree: Any) -> int:
    """Total number of elements over the leaves of a pytree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------------------- primitives
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``w * x / sqrt(mean(x^2) + eps)``; statistics in float32 even for bf16 x (as HF Qwen2RMSNorm)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    # HF casts back to the input dtype before the weight multiply; same order keeps bf16 parity.
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_frequencies(config: ModelConfig) -> jax.Array:
    """float32 ``[E/2]`` rotary frequencies ``theta^(-2i/E)``, remapped as Llama 3 does when ``config.rope_scaling``
    is set: the operations of transformers' ``_compute_llama3_parameters`` in its order and dtype, so both models
    rotate by the same float32 angles."""
    e = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(e // 2, dtype=jnp.float32) * 2.0 / e))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (beyond the original context) stretched by the factor, short ones kept, the band between
    # interpolated smoothly.
    llama = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * llama / scaling.factor + smooth * llama
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return jnp.where(medium, smoothed, llama)


def rotary(x_BTHE: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding of q or k (H or K heads), HF ``rotate_half`` layout: dims (i, i + E/2) form the pair rotated by
    ``pos * inv_freq[i]`` (``rope_frequencies``); ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2,
    x1]``.
    """
    half = x_BTHE.shape[-1] // 2
    angle_BTE = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
    angle_BTE = jnp.concatenate([angle_BTE, angle_BTE], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angle_BTE).astype(x_BTHE.dtype), jnp.sin(angle_BTE).astype(x_BTHE.dtype)
    x1, x2 = x_BTHE[..., :half], x_BTHE[..., half:]
    return x_BTHE * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


# The adapters on a pass, in order: (this layer's adapter tree, its multiplier c), the policy's then the scaffold's.
Adapters = tuple[tuple[Params, Any], ...]


def _linear(x: jax.Array, w: jax.Array, adapters: Adapters, name: str, n_in: int = 1) -> jax.Array:
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


def attention_positions(attention_mask_BT: jax.Array) -> jax.Array:
    """Positions of a left-padded batch: ``cumsum(mask) - 1`` clipped at 0 (pads sit at position 0)."""
    return jnp.maximum(jnp.cumsum(attention_mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def causal_padding_mask(attention_mask_BT: jax.Array) -> jax.Array:
    """``[B, T, S]`` bool: query t may see key s iff s <= t and key s is a real token."""
    t = attention_mask_BT.shape[-1]
    causal_TS = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return causal_TS[None] & attention_mask_BT.astype(bool)[:, None, :]


# Finite stand-in for -inf: a query with no visible key (a left pad) gets a uniform softmax, not NaN.
_MASKED = -1e30


def attend(q_BTHE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    """Grouped-query attention ``softmax(q k^T / sqrt(E) + mask) v``; query head h reads KV head h // G.

    Keys and values come heads-first (the KV cache's layout). Scores and softmax are float32 whatever the
    compute dtype (bf16 exponentials lose too much).
    """
    b, t, h, e = q_BTHE.shape
    k_heads = k_BKSE.shape[1]
    q_BTKGE = q_BTHE.reshape(b, t, k_heads, h // k_heads, e)
    scores_BKGTS = jnp.einsum("btkge,bkse->bkgts", q_BTKGE, k_BKSE, preferred_element_type=jnp.float32)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS * (e**-0.5), _MASKED)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BKSE.dtype)
    out_BTKGE = jnp.einsum("bkgts,bkse->btkge", probs_BKGTS, v_BKSE)
    return out_BTKGE.reshape(b, t, h, e)


def decode_attend(
    implementation: str, q_B1HE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, mask_B1S: jax.Array
) -> jax.Array:
    """One query per row over the KV cache: ``attend``'s result through ``implementation`` (a name of
    ``DECODE_ATTENTIONS``), keys in that implementation's cache layout (``cache_key_name``)."""
    return DECODE_ATTENTIONS.resolve(implementation).attend(q_B1HE, k_BKSE, v_BKSE, mask_B1S)


def _decode_xla(q_B1HE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, mask_B1S: jax.Array) -> jax.Array:
    """``jax.nn.dot_product_attention`` over the cache."""
    heads_last = lambda x: jnp.swapaxes(x, 1, 2)  # [B, S, K, E], the layout dot_product_attention takes
    out = jax.nn.dot_product_attention(q_B1HE, heads_last(k_BKSE), heads_last(v_BKSE), mask=mask_B1S[:, None])
    return out.astype(q_B1HE.dtype)


def _decode_reduce(q_B1HE: jax.Array, k_BKES: jax.Array, v_BKSE: jax.Array, mask_B1S: jax.Array) -> jax.Array:
    """The two products as broadcast multiplies and sums, over the head dim (across slots-last keys) and over the
    slots: one pass over each cache buffer, where XLA's CPU backend lowers the einsums to many small batched
    matmuls (measured 5x slower at 32 rows of 256 slots)."""
    b, _, h, e = q_B1HE.shape
    k_heads = k_BKES.shape[1]
    f32 = jnp.float32
    q_BKGE = q_B1HE.reshape(b, k_heads, h // k_heads, e).astype(f32) * (e**-0.5)
    scores_BKGS = jnp.sum(q_BKGE[..., None] * k_BKES[:, :, None].astype(f32), axis=-2)
    scores_BKGS = jnp.where(mask_B1S[:, None], scores_BKGS, _MASKED)
    probs_BKGS = jax.nn.softmax(scores_BKGS, axis=-1)
    out_BKGE = jnp.sum(probs_BKGS[..., None] * v_BKSE[:, :, None].astype(f32), axis=-2)
    return out_BKGE.reshape(b, 1, h, e).astype(q_B1HE.dtype)


def fused_attend(
    q_BTHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, lengths_B: jax.Array, implementation: str
) -> jax.Array:
    """Causal grouped-query attention over right-padded rows (the first ``lengths_B`` tokens of each are real)
    through ``jax.nn.dot_product_attention``: ``xla`` or ``cudnn`` (a fused flash kernel that never holds the
    ``[B, H, T, S]`` scores and skips the blocks above the diagonal). Queries past a row's length get 0.
    """
    lengths_B = constrain(lengths_B, ("batch",))  # each shard of rows must read its own lengths
    mesh = jax.sharding.get_abstract_mesh()
    heads = ("batch", None, "heads", None)
    split = lambda x, names: None if mesh.empty else logical_spec(x.shape, names, mesh)[2]
    q_split = split(q_BTHE, heads)
    if q_split is not None and q_split != split(k_BTKE, ("batch", None, "kv_heads", None)):
        # cuDNN's partitioner needs q, k and v split alike. When tp splits the query heads but not the KV
        # heads (12 and 2 on tp = 4), each query head gets its own copy of its KV head (h reads h // G).
        groups = q_BTHE.shape[2] // k_BTKE.shape[2]
        k_BTKE, v_BTKE = (constrain(jnp.repeat(x, groups, axis=2), heads) for x in (k_BTKE, v_BTKE))
    return jax.nn.dot_product_attention(
        q_BTHE,
        k_BTKE,
        v_BTKE,
        is_causal=True,
        query_seq_lengths=lengths_B,
        key_value_seq_lengths=lengths_B,
        implementation=implementation,
    )


def _write_cache(cache: Params, k_BTKE: jax.Array, v_BTKE: jax.Array, index: jax.Array) -> Params:
    # Static-shape cache (the decode step compiles once): new keys/values overwrite slots [index, index+T).
    def put(c_BKSE: jax.Array, new_BTKE: jax.Array) -> jax.Array:
        new_BKTE = jnp.swapaxes(new_BTKE, 1, 2).astype(c_BKSE.dtype)
        return jax.lax.dynamic_update_slice(c_BKSE, new_BKTE, (0, 0, index, 0))

    if "k" in cache:
        return {"k": put(cache["k"], k_BTKE), "v": put(cache["v"], v_BTKE)}
    new_BKET = jnp.transpose(k_BTKE, (0, 2, 3, 1)).astype(cache["kT"].dtype)
    return {"kT": jax.lax.dynamic_update_slice(cache["kT"], new_BKET, (0, 0, 0, index)), "v": put(cache["v"], v_BTKE)}


def _qkv(
    config: ModelConfig, layer: Params, x_BTD: jax.Array, adapters: Adapters
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values of a layer before RoPE: the projections of the normed input, with the family's
    biases (Qwen2) or per-head RMSNorm of q and k (Qwen3, after any adapter: peft wraps the projections)."""
    dt = x_BTD.dtype
    h_BTD = rms_norm(x_BTD, layer["attn_norm"], config.rms_norm_eps)
    q_BTHE, k_BTKE, v_BTKE = (_linear(h_BTD, layer[n], adapters, n) for n in ("q", "k", "v"))
    if config.qkv_bias:
        q_BTHE, k_BTKE, v_BTKE = (q_BTHE + layer["q_bias"].astype(dt), k_BTKE + layer["k_bias"].astype(dt),
                                  v_BTKE + layer["v_bias"].astype(dt))  # fmt: skip
    q_BTHE = constrain(q_BTHE, ("batch", None, "heads", None))
    k_BTKE = constrain(k_BTKE, ("batch", None, "kv_heads", None))
    v_BTKE = constrain(v_BTKE, ("batch", None, "kv_heads", None))
    if config.qk_norm:
        q_BTHE = rms_norm(q_BTHE, layer["q_norm"], config.rms_norm_eps)
        k_BTKE = rms_norm(k_BTKE, layer["k_norm"], config.rms_norm_eps)
    return q_BTHE, k_BTKE, v_BTKE


# ------------------------------------------------------------------------------ attention registries
@dataclasses.dataclass(frozen=True)
class CacheFreeAttention:
    """What a cache-free attention (``config.attention``) takes: a ``[B, T, S]`` mask (neither field set), segment
    ids (``over_segments(q, k, v, segment_ids)``) or right-padded rows of given lengths (``fused``, the
    implementation of ``jax.nn.dot_product_attention``; such rows hold one segment each)."""

    over_segments: Callable[..., jax.Array] | None = None
    fused: str | None = None
    needs_gpu: bool = False  # refused, with the backend named, before a trace elsewhere


@dataclasses.dataclass(frozen=True)
class DecodeAttention:
    """A decode step's attention over the KV cache and the cache leaf its keys live in (``cache_key_name``)."""

    attend: Callable[..., jax.Array]
    key_name: str = "k"  # "k": [B, K, S, E]; "kT": [B, K, E, S]


ATTENTIONS = options.Registry(options.Attention, "attention")
ATTENTIONS.register("einsum")(CacheFreeAttention())
ATTENTIONS.register("xla")(CacheFreeAttention(fused="xla"))
ATTENTIONS.register("cudnn")(CacheFreeAttention(fused="cudnn", needs_gpu=True))
ATTENTIONS.register("blocked")(CacheFreeAttention(over_segments=blocked_attention))
ATTENTIONS.register("pallas")(CacheFreeAttention(over_segments=functools.partial(segment_attention, "pallas")))
ATTENTIONS.register("splash")(CacheFreeAttention(over_segments=functools.partial(segment_attention, "splash")))

DECODE_ATTENTIONS = options.Registry(options.DecodeAttention, "decode attention")
DECODE_ATTENTIONS.register("einsum")(DecodeAttention(attend))
DECODE_ATTENTIONS.register("reduce")(DecodeAttention(_decode_reduce, key_name="kT"))
DECODE_ATTENTIONS.register("xla")(DecodeAttention(_decode_xla))
# The Pallas GPU kernel needs each row's visible slots to be one contiguous range, as the sampler's are (the
# left-padded prompt, then the generated slots).
DECODE_ATTENTIONS.register("pallas")(DecodeAttention(decode_attention))


def traced_platform() -> str:
    """The platform of the devices being traced for: the context mesh's (a mesh of compile-only H100s while this
    CPU compiles for them), else JAX's default backend (a mesh of axis sizes only names no devices)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def _require_backend(name: str, attention: CacheFreeAttention) -> None:
    if attention.needs_gpu and (platform := traced_platform()) not in ("gpu", "cuda"):
        raise ValueError(f"model attention {name!r} needs a CUDA GPU; the devices traced for are {platform!r}")


def block(
    config: ModelConfig,
    layer: Params,
    x_BTD: jax.Array,
    positions_BT: jax.Array,
    mask_BTS: jax.Array,
    *,
    adapters: Adapters = (),
    kv_cache: Params | None = None,
    cache_index: jax.Array | int = 0,
    seq_lengths_B: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> tuple[jax.Array, Params | None]:
    """One pre-norm decoder layer: ``x += attn(norm(x)); x += mlp(norm(x))``, mlp = ``down(silu(gate) * up)``;
    the family's q/k/v biases and q/k norms (``config.qkv_bias``, ``config.qk_norm``) where it has them.

    ``layer`` and each of ``adapters``' trees are this layer's slices (no L axis), each adapter with its multiplier
    (``lora_c = (alpha / rank) * lora_scale`` for the scaffold's).
    Without a cache, S = T. With this layer's ``kv_cache = {"k": [B, K, S, E], "v": ...}`` (keys as ``"kT":
    [B, K, E, S]`` where ``cache_key_name`` says so) the new keys and
    values are written at slot ``cache_index`` and the queries attend over all S slots; ``mask_BTS`` must
    then hide the unwritten slots. With ``seq_lengths_B`` (no cache, right-padded rows) attention is
    ``config.attention``'s fused kernel and ``mask_BTS`` is unused; with ``segment_ids_BT`` (no cache) it is
    ``flash.blocked_attention`` (or ``config.attention``'s vendor kernel) over those segments, ``mask_BTS``
    unused. Returns ``(x, updated kv_cache or None)``.
    """
    dt = x_BTD.dtype
    with jax.named_scope("attention"):
        q_BTHE, k_BTKE, v_BTKE = _qkv(config, layer, x_BTD, adapters)
        inv_freq = rope_frequencies(config)
        q_BTHE = rotary(q_BTHE, positions_BT, inv_freq)
        k_BTKE = rotary(k_BTKE, positions_BT, inv_freq)
        attention = ATTENTIONS.resolve(config.attention)
        if seq_lengths_B is not None:
            out_BTHE = fused_attend(q_BTHE, k_BTKE, v_BTKE, seq_lengths_B, attention.fused)
        elif segment_ids_BT is not None:
            out_BTHE = attention.over_segments(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT)
        elif kv_cache is None:
            out_BTHE = attend(q_BTHE, jnp.swapaxes(k_BTKE, 1, 2), jnp.swapaxes(v_BTKE, 1, 2), mask_BTS)
        else:
            kv_cache = _write_cache(kv_cache, k_BTKE, v_BTKE, cache_index)
            values = kv_cache["v"].astype(dt)
            keys = (kv_cache["k"] if "k" in kv_cache else kv_cache["kT"]).astype(dt)
            if q_BTHE.shape[1] == 1:  # a decode step: keys in the cache's layout (``cache_key_name``)
                out_BTHE = decode_attend(config.decode_attention, q_BTHE, keys, values, mask_BTS)
            else:  # the prompt pass, once a call
                out_BTHE = attend(q_BTHE, keys if "k" in kv_cache else jnp.swapaxes(keys, 2, 3), values, mask_BTS)
        x_BTD = x_BTD + _linear(out_BTHE, layer["o"], adapters, "o", n_in=2)
    with jax.named_scope("mlp"):
        h_BTD = rms_norm(x_BTD, layer["mlp_norm"], config.rms_norm_eps)
        gate_BTF = _linear(h_BTD, layer["gate"], adapters, "gate")
        up_BTF = _linear(h_BTD, layer["up"], adapters, "up")
        gate_BTF = constrain(gate_BTF, ("batch", None, "mlp"))
        up_BTF = constrain(up_BTF, ("batch", None, "mlp"))
        x_BTD = x_BTD + _linear(jax.nn.silu(gate_BTF) * up_BTF, layer["down"], adapters, "down")
    return x_BTD, kv_cache


# Logical axes of the residual stream [B, T, D]; None is replicated (see ``axes.constrain``).
_RESIDUAL_AXES = ("batch", None, None)


def _save_dots(rank: int, prim: Any, *avals: Any, **params: Any) -> bool:
    """ "dots": save the matmuls without batch dimensions, the projections, whose outputs are cheap to keep, and not
    the [B, K, G, T, S] attention scores, the largest activations of long sequences. Of an adapter's two products
    only the rank-R ``x A`` is kept: ``(x A) B``, the one that contracts over ``rank``, has a projection's output
    size (keeping it doubled the SFT step's saved activations: 64.7 GiB a device on an H100 at the paper's shape)
    and is recomputed from ``x A`` for ``R / D`` of its projection's FLOPs."""
    if not jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params):
        return False
    (contract, _), _ = params["dimension_numbers"]
    return math.prod(avals[0].shape[d] for d in contract) != rank


def _remat_policy(config: ModelConfig) -> Callable[..., bool] | None:
    """What ``config.remat`` keeps for the backward pass (None: only the layer inputs)."""
    if config.remat == "full":
        return None
    return functools.partial(_save_dots, config.lora.rank)


def _effective_lora(config: ModelConfig, params: Params, lora_scale: jax.Array | float) -> tuple[tuple, tuple]:
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


def embed(config: ModelConfig, params: Params, tokens_BT: jax.Array) -> jax.Array:
    """Token embeddings ``E[tokens]`` in the compute dtype."""
    with jax.named_scope("embed"):
        x_BTD = jnp.take(params["base"]["embed"], tokens_BT, axis=0).astype(config.compute_dtype)
        return constrain(x_BTD, _RESIDUAL_AXES)


def decoder(
    config: ModelConfig,
    params: Params,
    x_BTD: jax.Array,
    positions_BT: jax.Array,
    mask_BTS: jax.Array,
    *,
    lora_scale: jax.Array | float = 0.0,
    kv_cache: Params | None = None,
    cache_index: jax.Array | int = 0,
    seq_lengths_B: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> tuple[jax.Array, Params | None]:
    """All layers then the final RMSNorm: ``(h [B, T, D], kv_cache)``.

    ``kv_cache``, when given, holds one ``{"k": [B, K, S, E], "v": [B, K, S, E]}`` per layer (a tuple of L;
    keys as ``"kT": [B, K, E, S]`` where ``cache_key_name`` says so);
    the cached path runs the layers unrolled (see ``_cached_layers``), the cache-free one as a scan.
    ``seq_lengths_B`` (cache-free, right-padded rows only) selects the fused attention, ``segment_ids_BT``
    (cache-free) the blocked one or ``config.attention``'s vendor kernel; see ``block``.
    """
    lora, lora_c = _effective_lora(config, params, lora_scale)
    layers = params["base"]["layers"]

    def layer_step(x_BTD, xs):
        layer, layer_lora = xs
        # The residual stream is split by rows only (embed whole), so each layer gathers its FSDP-split
        # weights instead of the partitioner gathering activations: the weights are the smaller of the two.
        x_BTD = constrain(x_BTD, _RESIDUAL_AXES)
        adapters = tuple(zip(layer_lora, lora_c, strict=True))
        kw = dict(adapters=adapters, seq_lengths_B=seq_lengths_B, segment_ids_BT=segment_ids_BT)
        return block(config, layer, x_BTD, positions_BT, mask_BTS, **kw)[0]

    if config.remat != "none" and kv_cache is None:
        # Only the layer inputs (and, for "dots", the weight matmul outputs) stay alive for the backward
        # pass; the rest of a layer is recomputed there. prevent_cse=False: scan already keeps XLA from
        # merging the recomputation into the forward pass (jax.checkpoint's documented advice for scans).
        layer_step = jax.checkpoint(layer_step, policy=_remat_policy(config), prevent_cse=False)
    with jax.named_scope("layers"):
        if kv_cache is None:
            x_BTD, _ = jax.lax.scan(lambda x, xs: (layer_step(x, xs), None), x_BTD, (layers, lora))
        else:
            step = (positions_BT, mask_BTS, kv_cache, cache_index)
            x_BTD, kv_cache = _cached_layers(config, layers, lora, lora_c, x_BTD, *step)
    with jax.named_scope("final_norm"):
        return rms_norm(x_BTD, params["base"]["final_norm"], config.rms_norm_eps), kv_cache


def _cached_layers(config, layers, lora, lora_c, x_BTD, positions_BT, mask_BTS, kv_cache, cache_index):
    """The layers one after another (unrolled), each reading and writing its own cache buffer in place.

    Decode is memory-bound, so every extra byte per step counts. A scan would slice each layer's weights
    and cache out of the stacked arrays, and XLA copies such a slice before a matmul reads it: three times
    the bytes of one read. Here the weights come per layer (``unstack_layers``, once per sampling call; a
    stacked tree is sliced at static indices) and each layer's cache is its own buffer.
    """
    if not isinstance(layers, list | tuple):
        # Stacked weights (a call outside the sampler, which unstacks once per call): split here, adapters alike.
        layers, lora = unstack_layers(config, layers)[0], tuple(unstack_layers(config, t)[0] for t in lora)
    new_cache = []
    for i, layer in enumerate(layers):
        x_BTD = constrain(x_BTD, _RESIDUAL_AXES)
        adapters = tuple((tree[i], c) for tree, c in zip(lora, lora_c, strict=True))
        kw = dict(adapters=adapters, kv_cache=kv_cache[i], cache_index=cache_index)
        x_BTD, layer_cache = block(config, layer, x_BTD, positions_BT, mask_BTS, **kw)
        new_cache.append({name: constrain(c, CACHE_LEAF_AXES[name]) for name, c in layer_cache.items()})
    return x_BTD, tuple(new_cache)


def unstack_layers(config: ModelConfig, layers: Params, lora: Params | None = None) -> tuple[tuple, tuple | None]:
    """Stacked ``[L, ...]`` layer weights (and adapter) as L per-layer trees, for the unrolled decode."""

    def split(tree: Params) -> tuple[Params, ...]:
        return tuple(jax.tree.map(lambda w, i=i: w[i], tree) for i in range(config.num_layers))

    return split(layers), (split(lora) if lora else None)


def segment_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """``[B, T, S]`` bool of packed rows: query t sees key s iff both are in the same non-zero segment and s <= t."""
    t = segment_ids_BT.shape[-1]
    causal_TS = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return causal_TS[None] & same_BTS & (segment_ids_BT[:, :, None] > 0)


def packs_segments(config: ModelConfig) -> bool:
    """Whether ``config.attention`` can attend within several segments of a row (``packing.pack_rows``); the
    fused ``jax.nn.dot_product_attention`` takes right-padded rows of given lengths only (one segment a row)."""
    return ATTENTIONS.resolve(config.attention).fused is None


def hidden_states(
    config: ModelConfig,
    params: Params,
    tokens_BT: jax.Array,
    attention_mask_BT: jax.Array | None = None,
    *,
    lora_scale: jax.Array | float = 0.0,
    segment_ids_BT: jax.Array | None = None,
    positions_BT: jax.Array | None = None,
) -> jax.Array:
    """Final-normed hidden states [B, T, D] (compute dtype) of a left-padded batch, no cache.

    Positions are ``cumsum(mask) - 1`` so a left-padded row sees the same positions as unpadded. Packed rows
    (``packing.pack_rows``) come with ``segment_ids_BT`` and ``positions_BT`` instead of a mask
    (``packed_hidden_states``).
    """
    if segment_ids_BT is not None:
        return packed_hidden_states(config, params, tokens_BT, segment_ids_BT, positions_BT, lora_scale=lora_scale)
    if attention_mask_BT is None:
        attention_mask_BT = jnp.ones(tokens_BT.shape, jnp.int32)
    attention = ATTENTIONS.resolve(config.attention)
    if attention.fused is not None:
        return _fused_hidden_states(config, params, tokens_BT, attention_mask_BT, lora_scale)
    positions_BT = attention_positions(attention_mask_BT)
    if attention.over_segments is not None:  # one segment per row (its real tokens), no [B, T, S] mask
        x_BTD = embed(config, params, tokens_BT)
        segments_BT = attention_mask_BT.astype(jnp.int32)
        return decoder(config, params, x_BTD, positions_BT, None, lora_scale=lora_scale, segment_ids_BT=segments_BT)[0]
    mask_BTS = causal_padding_mask(attention_mask_BT)
    x_BTD = embed(config, params, tokens_BT)
    return decoder(config, params, x_BTD, positions_BT, mask_BTS, lora_scale=lora_scale)[0]


def packed_hidden_states(
    config: ModelConfig,
    params: Params,
    tokens_BT: jax.Array,
    segment_ids_BT: jax.Array,
    positions_BT: jax.Array,
    *,
    lora_scale: jax.Array | float = 0.0,
) -> jax.Array:
    """``hidden_states`` of packed rows: each segment attends causally to itself only, at its own positions.

    ``einsum`` masks with ``segment_mask``; ``blocked`` and the vendor kernels (``kernels``) take the segment ids.
    The fused attentions (``packs_segments`` False) take rows of one segment starting at slot 0: each row's length
    is its segment's.
    """
    x_BTD = embed(config, params, tokens_BT)
    segment_ids_BT = segment_ids_BT.astype(jnp.int32)
    kw: dict[str, Any] = dict(lora_scale=lora_scale)
    mask_BTS = None
    attention = ATTENTIONS.resolve(config.attention)
    if attention.over_segments is not None:
        kw["segment_ids_BT"] = segment_ids_BT
    elif attention.fused is not None:
        _require_backend(config.attention, attention)
        lengths_B = jnp.sum(segment_ids_BT > 0, axis=1, dtype=jnp.int32)
        kw["seq_lengths_B"] = jnp.maximum(lengths_B, 1)
        # A row that is not one segment from slot 0 cannot be expressed so: NaN, never silently wrong.
        slots_T = jnp.arange(segment_ids_BT.shape[1])
        one_run_B = jnp.all((segment_ids_BT > 0) == (slots_T < lengths_B[:, None]), axis=1)
        one_run_B &= jnp.max(segment_ids_BT, axis=1) <= 1
    else:
        mask_BTS = segment_mask(segment_ids_BT)
    h_BTD = decoder(config, params, x_BTD, positions_BT, mask_BTS, **kw)[0]
    if "seq_lengths_B" in kw:
        h_BTD = jnp.where(one_run_B[:, None, None], h_BTD, jnp.nan).astype(h_BTD.dtype)
    return h_BTD


def _fused_hidden_states(
    config: ModelConfig, params: Params, tokens_BT: jax.Array, attention_mask_BT: jax.Array, lora_scale: Any
) -> jax.Array:
    """``hidden_states`` through the fused attention, which takes right-padded rows of given lengths.

    The real tokens of a row are one run (a left-padded prompt, then a right-padded response), so each row
    is rotated to start at slot 0, run, and rotated back: two gathers per pass instead of a [B, T, S] mask.
    A row whose mask has a hole cannot be expressed so; its hidden states are NaN, never silently wrong.
    """
    _require_backend(config.attention, ATTENTIONS.resolve(config.attention))
    mask_BT = attention_mask_BT.astype(bool)
    slots_T = jnp.arange(mask_BT.shape[1])
    start_B = jnp.argmax(mask_BT, axis=1)  # first real token; 0 for an empty row
    lengths_B = jnp.sum(mask_BT, axis=1, dtype=jnp.int32)
    to_right_BT = (slots_T + start_B[:, None]) % mask_BT.shape[1]
    mask_BT = jnp.take_along_axis(mask_BT, to_right_BT, axis=1)
    one_run_B = jnp.all(mask_BT == (slots_T < lengths_B[:, None]), axis=1)
    x_BTD = embed(config, params, jnp.take_along_axis(tokens_BT, to_right_BT, axis=1))
    # An empty row (mesh padding) keeps one "real" slot so that no kernel sees a row with nothing to attend.
    lengths_B = jnp.maximum(lengths_B, 1)
    h_BTD = decoder(
        config, params, x_BTD, attention_positions(mask_BT), None, lora_scale=lora_scale, seq_lengths_B=lengths_B
    )[0]
    back_BT = (slots_T - start_B[:, None]) % mask_BT.shape[1]
    h_BTD = jnp.take_along_axis(h_BTD, back_BT[:, :, None], axis=1)
    return jnp.where(one_run_B[:, None, None], h_BTD, jnp.nan).astype(h_BTD.dtype)


def lm_logits(config: ModelConfig, params: Params, h_BTD: jax.Array) -> jax.Array:
    """float32 logits ``h W_out`` with ``W_out = embed^T`` when tied; any leading dims on h."""
    base = params["base"]
    with jax.named_scope("lm_head"):
        if config.tie_word_embeddings:
            w_VD = base["embed"].astype(h_BTD.dtype)
            logits = jnp.einsum("...d,vd->...v", h_BTD, w_VD, preferred_element_type=jnp.float32)
        else:
            w_DV = base["lm_head"].astype(h_BTD.dtype)
            logits = jnp.einsum("...d,dv->...v", h_BTD, w_DV, preferred_element_type=jnp.float32)
        rows = ("batch", *(None,) * (logits.ndim - 2)) if logits.ndim > 1 else ()
        return constrain(logits, (*rows, "vocab"))


def forward(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    lora_scale: jax.Array | float = 0.0,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Logits [B, T, V] (float32) of ``tokens`` [B, T]; ``attention_mask`` [B, T] is 1 on real tokens (or packed
    rows' ``segment_ids`` and ``positions``, see ``hidden_states``).

    The adapter ``params["lora"]`` (optional) enters as ``(alpha / rank) * lora_scale * B A``; with
    ``lora_scale = 0`` the output equals the base model's exactly and the adapter gets zero gradient.
    """
    packed = dict(segment_ids_BT=segment_ids, positions_BT=positions)
    h_BTD = hidden_states(config, params, tokens, attention_mask, lora_scale=lora_scale, **packed)
    return lm_logits(config, params, h_BTD)


def merge_lora(config: ModelConfig, params: Params, lora_scale: float = 1.0) -> Params:
    """Base params with the adapters folded in: ``W <- W + c_p A_p B_p + (alpha / rank) * lora_scale * A B`` per
    target, the policy adapter's term (``params["policy"]``, at ``c_p = alpha_p / rank_p``) wherever it is present,
    the scaffold's (``params["lora"]``) unless ``lora_scale`` is 0.

    Returns the base subtree only (the ``params["base"]`` layout), for engines that take plain weights. The deltas
    are summed in float32 and added to W once, so a bf16 base is rounded once.
    """
    base = params["base"]
    trees, scales = _effective_lora(config, params, lora_scale)
    # Per layer, contract A's rank axis with B's: [*in, R] x [R, *out] -> [*in, *out] = W's shape.
    # HIGHEST precision: on GPU a float32 matmul may otherwise run in TF32 and lose ~3 digits.
    product = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1, precision=jax.lax.Precision.HIGHEST))
    layers = dict(base["layers"])
    for name in _PROJ_DIMS:
        terms = [c * product(t[name]["a"].astype(jnp.float32), t[name]["b"].astype(jnp.float32))
                 for t, c in zip(trees, scales, strict=True) if name in t]  # fmt: skip
        if terms:
            layers[name] = (layers[name].astype(jnp.float32) + sum(terms)).astype(layers[name].dtype)
    return {**base, "layers": layers}
