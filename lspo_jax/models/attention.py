"""Attention: the written-out grouped-query einsums (any backend), the fused ``jax.nn.dot_product_attention``, the
decode step's attention over the KV cache, the masks and positions they read, and the registries that map
``config.attention`` and ``config.decode_attention`` to them (letters as in ``model``).

Cache-free passes take a ``[B, T, S]`` mask (``attend``), right-padded rows of given lengths (``fused_attend``:
``xla``, or ``cudnn``'s fused flash kernel on a GPU) or segment ids (``flash.blocked_attention``, pure JAX, or a
vendor kernel from ``kernels``: ``pallas`` on GPUs, ``splash`` on TPUs). ``ATTENTIONS`` says which each takes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from lspo_jax import options
from lspo_jax.config import ModelConfig
from lspo_jax.models.axes import constrain, logical_spec
from lspo_jax.models.flash import blocked_attention
from lspo_jax.models.kernels import decode_attention, segment_attention

# Logical axes of each layer's KV-cache leaf ``[B, K, S, E]`` (``model.decoder``), for its layout on a mesh. KV heads
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


def require_backend(name: str, attention: CacheFreeAttention) -> None:
    """Refuse a GPU-only attention (``needs_gpu``) before a trace for other devices, naming what they are."""
    if attention.needs_gpu and (platform := traced_platform()) not in ("gpu", "cuda"):
        raise ValueError(f"model attention {name!r} needs a CUDA GPU; the devices traced for are {platform!r}")


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
