"""One pre-norm decoder layer (``block``) and its parts: RMSNorm, the rotary embedding (with Llama 3's remapped
frequencies), the projections to queries, keys and values with the family's biases or q/k norms, the write into the
layer's KV-cache buffer, and the MLP (letters as in ``model``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lspo_jax.config import ModelConfig
from lspo_jax.models.attention import ATTENTIONS, attend, decode_attend, fused_attend
from lspo_jax.models.axes import constrain
from lspo_jax.models.lora import Adapters, linear
from lspo_jax.models.specs import Params


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
    q_BTHE, k_BTKE, v_BTKE = (linear(h_BTD, layer[n], adapters, n) for n in ("q", "k", "v"))
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
    [B, K, E, S]`` where ``attention.cache_key_name`` says so) the new keys and
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
            if q_BTHE.shape[1] == 1:  # a decode step: keys in the cache's layout (``attention.cache_key_name``)
                out_BTHE = decode_attend(config.decode_attention, q_BTHE, keys, values, mask_BTS)
            else:  # the prompt pass, once a call
                out_BTHE = attend(q_BTHE, keys if "k" in kv_cache else jnp.swapaxes(keys, 2, 3), values, mask_BTS)
        x_BTD = x_BTD + linear(out_BTHE, layer["o"], adapters, "o", n_in=2)
    with jax.named_scope("mlp"):
        h_BTD = rms_norm(x_BTD, layer["mlp_norm"], config.rms_norm_eps)
        gate_BTF = linear(h_BTD, layer["gate"], adapters, "gate")
        up_BTF = linear(h_BTD, layer["up"], adapters, "up")
        gate_BTF = constrain(gate_BTF, ("batch", None, "mlp"))
        up_BTF = constrain(up_BTF, ("batch", None, "mlp"))
        x_BTD = x_BTD + linear(jax.nn.silu(gate_BTF) * up_BTF, layer["down"], adapters, "down")
    return x_BTD, kv_cache
