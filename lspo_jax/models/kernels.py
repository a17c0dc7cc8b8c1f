"""Vendor attention kernels with segment ids, behind ``model.attention``: packed rows on GPU and TPU.

    pallas   ``jax.experimental.pallas.ops.gpu.attention.mha``: the Pallas (Triton) flash attention for CUDA GPUs,
             causal, with segment ids, and its own backward kernels.
    splash   ``jax.experimental.pallas.ops.tpu.splash_attention``: TPU splash attention, a causal mask per head
             with segment ids; it skips the blocks the mask leaves empty.

Both take the same inputs as ``flash.blocked_attention`` (``q [B, T, H, E]``, ``k, v [B, T, K, E]``, segment ids
``[B, T]``, 0 on padding) and give the same result on every query that sees a key. Neither kernel takes grouped
KV heads, so each query head gets its KV head's copy (``h`` reads ``h // G``); rows are padded to a multiple of
the kernels' 128-token blocks (padding is segment 0). Off their own hardware both run in Pallas's interpreter:
correct and slow, which is how the CPU tests check them against the einsum path; ``benchmarks/gpu.py`` checks
``pallas`` against ``einsum`` on a GPU before timing it. Which of the two a program holds is decided when it is
lowered, for the platform it is lowered for (``jax.lax.platform_dependent``), not from ``jax.default_backend()``
when it is traced: a program lowered on a CPU for a GPU or a TPU (``tools/lower_check.py``) holds the real kernel.
On a mesh the kernel runs per shard (``shard_map``): rows split as the batch, heads as ``tp``, each shard its own
kernel call.

``decode_attention`` is the decode step's kernel (``attention.decode_attend``, ``decode_attention: pallas``):
``jax.experimental.pallas.ops.gpu.decode_attention.gqa``, one query per row over the KV cache, split over the
slots (flash-decoding), reading each row's visible range ``[start, end)`` only.

Query slots of segment 0 attend to the other padding slots (the kernels compare segment ids for equality only):
finite values nobody reads, as a padding query's output is never used.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lspo_jax.models.axes import logical_spec

BLOCK = 128
KERNELS = ("pallas", "splash")
# The lowering platforms each kernel is compiled for; on any other it runs in the interpreter.
_PLATFORMS = {"pallas": ("cuda",), "splash": ("tpu",)}


def segment_attention(
    kernel: str, q_BTHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, segment_ids_BT: jax.Array
) -> jax.Array:
    """Causal attention within segments through ``kernel`` (``pallas`` or ``splash``): ``[B, T, H, E]``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; known: {KERNELS}")
    b, t, h, e = q_BTHE.shape
    groups = h // k_BTKE.shape[2]
    k_BTHE, v_BTHE = (jnp.repeat(x, groups, axis=2) for x in (k_BTKE, v_BTKE))
    pad = -t % BLOCK
    if pad:
        widen = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        q_BTHE, k_BTHE, v_BTHE, segment_ids_BT = map(widen, (q_BTHE, k_BTHE, v_BTHE, segment_ids_BT))
    call = _native_or_interpreted(_pallas if kernel == "pallas" else _splash, _PLATFORMS[kernel])
    out_BTHE = _per_shard(call, q_BTHE, k_BTHE, v_BTHE, segment_ids_BT.astype(jnp.int32))
    return out_BTHE[:, :t]


def _native_or_interpreted(kernel, platforms: tuple[str, ...]):
    """``kernel(*arrays, interpret=...)``: compiled where the program is lowered for one of ``platforms``, interpreted
    elsewhere. Both branches are traced; lowering keeps only the one of its platform (a Python test of the backend at
    trace time would put the interpreter into a program lowered here for another platform)."""
    native, interpreted = functools.partial(kernel, interpret=False), functools.partial(kernel, interpret=True)

    def call(*arrays):
        return jax.lax.platform_dependent(*arrays, **dict.fromkeys(platforms, native), default=interpreted)

    return call


def _per_shard(call, q_BTHE, k_BTHE, v_BTHE, segment_ids_BT):
    """``call`` on each shard of the context mesh (rows as ``batch``, heads as ``heads``), or whole without one: a
    Pallas kernel is one device's program and cannot be split by the partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return call(q_BTHE, k_BTHE, v_BTHE, segment_ids_BT)
    heads = logical_spec(q_BTHE.shape, ("batch", None, "heads", None), mesh)
    rows = PartitionSpec(heads[0], None)
    return jax.shard_map(call, mesh=mesh, in_specs=(heads, heads, heads, rows), out_specs=heads, check_vma=False)(
        q_BTHE, k_BTHE, v_BTHE, segment_ids_BT
    )


def _pallas(q_BTHE, k_BTHE, v_BTHE, segment_ids_BT, *, interpret: bool):
    from jax.experimental.pallas.ops.gpu import attention

    scale = q_BTHE.shape[-1] ** -0.5
    return attention.mha(
        q_BTHE, k_BTHE, v_BTHE, segment_ids_BT, sm_scale=scale, causal=True, interpret=interpret
    ).astype(q_BTHE.dtype)


def _splash(q_BTHE, k_BTHE, v_BTHE, segment_ids_BT, *, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    _, t, h, e = q_BTHE.shape
    mask = masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(h)])
    kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=interpret)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, H, T, E]: the kernel's layout, one row at a time

    def one_row(q_HTE, k_HTE, v_HTE, seg_T):
        return kernel(q_HTE, k_HTE, v_HTE, segment_ids=splash.SegmentIds(q=seg_T, kv=seg_T))

    # splash does not scale the scores: the queries are scaled on the way in.
    q_BHTE = heads_first(q_BTHE) * jnp.asarray(e**-0.5, q_BTHE.dtype)
    out_BHTE = jax.vmap(one_row)(q_BHTE, heads_first(k_BTHE), heads_first(v_BTHE), segment_ids_BT)
    return heads_first(out_BHTE).astype(q_BTHE.dtype)


def decode_attention(q_B1HE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, mask_B1S: jax.Array) -> jax.Array:
    """The Pallas GPU decode kernel over the cache (``[B, 1, H, E]``); ``mask_B1S`` must be one contiguous range of
    visible slots per row, which is passed as its first and one-past-last slot."""
    slots = k_BKSE.shape[2]
    visible_BS = mask_B1S[:, 0]
    start_B = jnp.argmax(visible_BS, axis=-1).astype(jnp.int32)
    end_B = (slots - jnp.argmax(visible_BS[:, ::-1], axis=-1)).astype(jnp.int32)
    call = _native_or_interpreted(_pallas_decode, _PLATFORMS["pallas"])
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return call(q_B1HE, k_BKSE, v_BKSE, start_B, end_B)
    q_spec = logical_spec(q_B1HE.shape, ("batch", None, "heads", None), mesh)
    kv_spec = logical_spec(k_BKSE.shape, ("batch", "kv_heads", None, None), mesh)
    if kv_spec[1] is None:  # KV heads whole (tp does not divide them): each shard needs every query head of them
        q_spec = PartitionSpec(q_spec[0], None, None, None)
    rows = PartitionSpec(q_spec[0])
    specs = (q_spec, kv_spec, kv_spec, rows, rows)
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(
        q_B1HE, k_BKSE, v_BKSE, start_B, end_B
    )


def _pallas_decode(q_B1HE, k_BKSE, v_BKSE, start_B, end_B, *, interpret: bool):
    from jax.experimental.pallas.ops.gpu import decode_attention

    pad = -k_BKSE.shape[2] % _DECODE_MIN_BLOCK
    if pad:  # a cache of fewer slots than a block's multiple (generations under 16 tokens): slots past end_B go unread
        widen = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
        k_BKSE, v_BKSE = widen(k_BKSE), widen(v_BKSE)
    splits, block = _decode_split(k_BKSE.shape[2])
    slots_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, S, K, E]: the kernel's layout (it swaps back inside)
    out_BHE = decode_attention.gqa(
        q_B1HE[:, 0], slots_first(k_BKSE), slots_first(v_BKSE), start_B, end_B, k_splits=splits, block_k=block,
        interpret=interpret,
    )  # fmt: skip
    return out_BHE[:, None].astype(q_B1HE.dtype)


# The decode kernel's blocks of slots: Triton takes power-of-two tiles only, the kernel at least 16 slots.
_DECODE_MIN_BLOCK, _DECODE_MAX_BLOCK = 16, 128


def _decode_split(slots: int) -> tuple[int, int]:
    """``(k_splits, block_k)`` for a cache of ``slots`` (a multiple of 16): the kernel splits the slots into k_splits
    equal parts of at least 16, each a whole number of its power-of-two blocks. Preferred: a full block (128 slots, or
    the whole part when it is shorter), then the most splits (flash-decoding's parallelism), then the largest block.
    A part of 80 slots would be one 80-slot block, which the interpreter takes and Triton refuses: 1280 slots (a
    1024-token prompt and the first 256-token window) split in 2 parts of 128-slot blocks, not 16 parts of 80."""
    options = []
    for k in (16, 8, 4, 2, 1):
        part = slots // k
        block = math.gcd(part, _DECODE_MAX_BLOCK)  # the largest power of two up to 128 that divides the part
        if slots % k == 0 and block >= _DECODE_MIN_BLOCK:
            options.append((block == min(part, _DECODE_MAX_BLOCK), k, block))
    _, splits, block = max(options)
    return splits, block
