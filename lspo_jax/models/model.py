"""The decoder of Qwen2, Qwen3 and Llama 3.x as pure functions of a params pytree, with LoRA as a separate subtree.

The families (``config.FAMILIES``) share one pre-norm layer and differ in a few features, chosen at trace time from
the static config: Qwen2's q/k/v biases, Qwen3's per-head RMSNorm of q and k before RoPE, Llama 3's remapped rotary
frequencies (``layer.rope_frequencies``).

Shape legend (einsum letters; array names carry them as suffixes, e.g. ``x_BTD``):
    B batch            T query positions        S key positions (T, or the KV-cache length)
    D hidden (embed)   H query heads            K key/value heads        G query heads per KV head (H = K*G)
    E head dim         F MLP hidden             V vocabulary             R LoRA rank
    L layers (leading axis of every stacked layer weight)

The pass is split by concern over the folder: the params and their one description (``specs``: init, abstract
shapes, logical axes), one decoder layer and its parts (``layer``: norms, rotary, q/k/v, MLP), attention and its
registries (``attention``), LoRA applied to a projection and merged into the base (``lora``). This module puts them
together: embeddings, the layer stack, the final norm and the head, as ``forward``.

Layer weights are stacked on a leading L axis and the cache-free decoder (training, log-probs) is a
``jax.lax.scan`` over them, so its compile time does not grow with depth. The cached decoder (sampling) runs
the layers unrolled, each with its own KV-cache buffer: decode is memory-bound and a scan would copy each
layer's slice of the stacked weights and cache before reading it (``_cached_layers``).

Attention in cache-free passes is ``config.attention`` (``attention.ATTENTIONS``): the written-out einsums, or
``jax.nn.dot_product_attention`` (``xla``, or ``cudnn``'s fused flash kernel on a GPU), which takes
right-padded rows of given lengths, so each row is rotated to right padding and back (``_fused_hidden_states``),
or ``blocked`` (``flash.blocked_attention``, pure JAX, flash-style, over segment ids: a row's real tokens), or a
vendor kernel over segment ids (``kernels``: ``pallas`` on GPUs, ``splash`` on TPUs).

LoRA adapters enter every projection as ``c * (x A) B`` (``lora``): the policy adapter ``params["policy"]`` always
on, the scaffold's ``params["lora"]`` at ``c = (alpha / rank) * lora_scale``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lspo_jax.config import ModelConfig
from lspo_jax.models.attention import (
    ATTENTIONS,
    CACHE_LEAF_AXES,
    attention_positions,
    causal_padding_mask,
    require_backend,
    segment_mask,
)
from lspo_jax.models.axes import constrain
from lspo_jax.models.layer import block, rms_norm
from lspo_jax.models.lora import effective_lora
from lspo_jax.models.specs import Params

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
    keys as ``"kT": [B, K, E, S]`` where ``attention.cache_key_name`` says so);
    the cached path runs the layers unrolled (see ``_cached_layers``), the cache-free one as a scan.
    ``seq_lengths_B`` (cache-free, right-padded rows only) selects the fused attention, ``segment_ids_BT``
    (cache-free) the blocked one or ``config.attention``'s vendor kernel; see ``layer.block``.
    """
    lora, lora_c = effective_lora(config, params, lora_scale)
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
    The fused attentions (``attention.packs_segments`` False) take rows of one segment starting at slot 0: each
    row's length is its segment's.
    """
    x_BTD = embed(config, params, tokens_BT)
    segment_ids_BT = segment_ids_BT.astype(jnp.int32)
    kw: dict[str, Any] = dict(lora_scale=lora_scale)
    mask_BTS = None
    attention = ATTENTIONS.resolve(config.attention)
    if attention.over_segments is not None:
        kw["segment_ids_BT"] = segment_ids_BT
    elif attention.fused is not None:
        require_backend(config.attention, attention)
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
    require_backend(config.attention, ATTENTIONS.resolve(config.attention))
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
