"""Properties of the Qwen2 forward pass and the params description that need no external reference.

(Parity with transformers lives in test_hf.py.)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_relative

from lspo_jax.config import LoraConfig, ModelConfig
from lspo_jax.models.attention import attention_positions, causal_padding_mask
from lspo_jax.models.lora import merge_lora
from lspo_jax.models.model import decoder, embed, forward, hidden_states, lm_logits
from lspo_jax.models.specs import abstract_params, count_params, init_lora, init_params, logical_axes, param_specs
from lspo_jax.rollout.kv_cache import init_cache

# One compiled forward per (config, shapes, params structure); a traced lora_scale never takes the
# trace-time shortcut for a Python 0, so both code paths of the adapter get exercised below.
_forward = jax.jit(forward, static_argnums=0)


def _base_only(params):
    return {"base": params["base"]}


# ------------------------------------------------------------------------------------ params and config
def test_deepseek_preset_param_count_without_allocation():
    config = ModelConfig.preset("deepseek-r1-distill-qwen-1.5b")
    abstract = abstract_params(config)
    # Published size of DeepSeek-R1-Distill-Qwen-1.5B: embed 151936*1536 twice (untied) + 28 layers of
    # 46,797,824 + final norm 1536 = 1,777,088,000.
    assert count_params(abstract["base"]) == 1_777_088_000
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    # init_params traced abstractly must agree with the description it derives from.
    traced = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
    assert jax.tree.structure(traced) == jax.tree.structure(abstract)
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(abstract), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


def test_logical_axes_name_every_dim(tiny_config):
    axes = logical_axes(tiny_config)
    shapes = abstract_params(tiny_config)
    is_axes = lambda x: isinstance(x, tuple)
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(shapes)
    for ax, s in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(shapes), strict=True):
        assert len(ax) == len(s.shape)
    assert axes["base"]["layers"]["q"] == ("layers", "embed", "heads", "head_dim")
    assert axes["base"]["embed"] == ("vocab", "embed")
    assert axes["lora"]["o"]["a"] == ("layers", "heads", "head_dim", "lora_rank")
    assert "lm_head" not in param_specs(dataclasses.replace(tiny_config, tie_word_embeddings=True))["base"]


@pytest.fixture(scope="module")
def tiny_init(tiny_config):
    # jit: one XLA compile for all leaves (eager would compile the PRNG once per distinct shape).
    return jax.jit(init_params, static_argnums=0)(tiny_config, jax.random.key(3))


def test_init_params_follows_specs(tiny_config, tiny_init):
    params = tiny_init
    layers = params["base"]["layers"]
    assert np.all(np.asarray(layers["attn_norm"]) == 1) and np.all(np.asarray(params["base"]["final_norm"]) == 1)
    assert np.all(np.asarray(layers["q_bias"]) == 0)
    assert abs(float(jnp.std(params["base"]["embed"])) - 0.02) < 0.003
    for target, ab in params["lora"].items():
        assert np.all(np.asarray(ab["b"]) == 0), target
    # A of the q projection: U(-1/sqrt(64), 1/sqrt(64)), fan_in = hidden 64.
    a = np.asarray(params["lora"]["q"]["a"])
    assert a.shape == (2, 64, 4) and np.abs(a).max() <= 1 / 8 and np.abs(a).max() > 0.1
    assert set(params["lora"]) == set(tiny_config.lora.targets)
    fresh = jax.eval_shape(lambda k: init_lora(tiny_config, k), jax.random.key(1))
    assert jax.tree.structure(fresh) == jax.tree.structure(params["lora"])


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="LoraConfig.targets: unknown target.*'qkv'"):
        LoraConfig(targets=("q", "qkv"))
    with pytest.raises(ValueError, match="LoraConfig.rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="ModelConfig.num_kv_heads"):
        ModelConfig.preset("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="ModelConfig.compute_dtype"):
        ModelConfig.preset("tiny", compute_dtype="float8")
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("gpt2")
    with pytest.raises(ValueError, match="ModelConfig.attention.*'flash'"):
        ModelConfig.preset("tiny", attention="flash")
    with pytest.raises(ValueError, match="ModelConfig.attention: cudnn needs compute_dtype bfloat16"):
        ModelConfig.preset("tiny", attention="cudnn")
    with pytest.raises(ValueError, match="ModelConfig.attention: cudnn needs head_dim % 8 == 0, got 12"):
        ModelConfig.preset("tiny", attention="cudnn", compute_dtype="bfloat16", head_dim=12)
    assert LoraConfig(rank=16, alpha=64.0).scale == 4.0
    assert LoraConfig(targets=["q", "v"]).targets == ("q", "v")  # YAML lists become tuples
    assert ModelConfig.preset("tiny", head_dim=None).head_dim == 16  # hidden / heads


# ------------------------------------------------------------------------------------------------ LoRA
def test_fresh_adapter_equals_base_exactly(tiny_config, tiny_params, tiny_init, left_padded_batch):
    tokens, mask = left_padded_batch
    params = {"base": tiny_params["base"], "lora": tiny_init["lora"]}  # init_lora's A, B = 0
    base = _forward(tiny_config, _base_only(params), tokens, mask)
    np.testing.assert_array_equal(_forward(tiny_config, params, tokens, mask, lora_scale=1.0), base)


def test_lora_scale_zero_equals_base_exactly(tiny_config, tiny_params, left_padded_batch):
    tokens, mask = left_padded_batch
    base = _forward(tiny_config, _base_only(tiny_params), tokens, mask)
    on = _forward(tiny_config, tiny_params, tokens, mask, lora_scale=1.0)
    assert np.abs(np.asarray(on - base)).max() > 1e-2  # the adapter does something when on
    # Under jit the scale is traced: the adapter runs and must contribute exact zeros.
    np.testing.assert_array_equal(_forward(tiny_config, tiny_params, tokens, mask, lora_scale=0.0), base)
    # Eagerly a Python 0 skips the adapter at trace time; same result.
    eager = forward(tiny_config, tiny_params, tokens, mask, lora_scale=0.0)
    assert_close_relative(eager, base, 2e-5)  # jit fuses the same float32 ops otherwise (~4e-8 measured)
    np.testing.assert_array_equal(eager, forward(tiny_config, _base_only(tiny_params), tokens, mask))


@pytest.mark.parametrize("lora_scale", [1.0, 0.5])
def test_merged_adapter_equals_unmerged(tiny_config, tiny_params, left_padded_batch, lora_scale):
    tokens, mask = left_padded_batch
    unmerged = _forward(tiny_config, tiny_params, tokens, mask, lora_scale=lora_scale)
    merged = {"base": merge_lora(tiny_config, tiny_params, lora_scale=lora_scale)}
    # (W + s BA) x against W x + s B (A x): float32 rounding of two layers (<= 9e-7 of the norm measured).
    assert_close_relative(_forward(tiny_config, merged, tokens, mask), unmerged, 2e-5)
    assert set(merged["base"]) == set(tiny_params["base"])


def test_lora_gets_exactly_zero_gradient_at_scale_zero(tiny_config, tiny_params, left_padded_batch):
    tokens, mask = left_padded_batch

    @jax.jit
    def grads(params, scale):
        def loss(p):
            logits = forward(tiny_config, p, tokens, mask, lora_scale=scale)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 5] * mask)

        return jax.grad(loss)(params)

    # A traced 0 is the hard case (the adapter is computed, scaled by 0); a Python 0 never reaches it.
    g = grads(tiny_params, 0.0)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(g["lora"]))
    assert np.abs(np.asarray(g["base"]["layers"]["q"])).max() > 0
    g = grads(tiny_params, 1.0)
    assert all(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(g["lora"]))


# -------------------------------------------------------------------------------- forward properties
def test_causality(tiny_config, tiny_params, left_padded_batch):
    tokens = left_padded_batch[0].copy()
    tokens[0] = np.arange(4, 14)
    changed = tokens.copy()
    changed[0, 6] = 50
    a = _forward(tiny_config, tiny_params, tokens, lora_scale=1.0)
    b = _forward(tiny_config, tiny_params, changed, lora_scale=1.0)
    np.testing.assert_array_equal(a[0, :6], b[0, :6])
    assert np.abs(np.asarray(a[0, 6:] - b[0, 6:])).min(axis=-1).max() > 0


def test_left_padding_does_not_change_real_tokens(tiny_config, tiny_params, left_padded_batch):
    tokens, mask = left_padded_batch
    padded = np.asarray(_forward(tiny_config, tiny_params, tokens, mask, lora_scale=1.0))
    assert np.isfinite(padded).all()  # pad queries see no key at all: uniform softmax, not NaN
    # The same real tokens unpadded, at the start of a row; what follows them cannot matter (causality),
    # so one [3, 10] batch compares every row without another compile.
    unpadded = np.full_like(tokens, 7)
    for row in range(3):
        real = tokens[row, mask[row] == 1]
        unpadded[row, : len(real)] = real
    alone = np.asarray(_forward(tiny_config, tiny_params, unpadded, lora_scale=1.0))
    for row in range(3):
        n = int(mask[row].sum())
        # Masked keys add exact zeros, but the real ones sit in other slots of the vector sums: rounding only.
        assert_close_relative(padded[row, mask[row] == 1], alone[row, :n], 2e-5)
    all_pad = _forward(tiny_config, tiny_params, tokens, np.zeros_like(mask), lora_scale=1.0)
    assert np.isfinite(np.asarray(all_pad)).all()


def test_positions_and_mask_of_left_padding():
    mask = np.array([[0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(attention_positions(mask), [[0, 0, 0, 1, 2]])
    m = np.asarray(causal_padding_mask(mask))[0]
    assert m[4].tolist() == [False, False, True, True, True] and not m[1].any()


def test_jit_equals_eager_and_hidden_path(tiny_config, tiny_params, left_padded_batch):
    tokens, mask = left_padded_batch
    eager = forward(tiny_config, tiny_params, tokens, mask, lora_scale=1.0)
    # Fused under jit, op by op eagerly: the same float32 ops in another order (~4e-8 of the norm measured).
    assert_close_relative(_forward(tiny_config, tiny_params, tokens, mask, lora_scale=1.0), eager, 2e-5)
    h = hidden_states(tiny_config, tiny_params, tokens, mask, lora_scale=1.0)
    assert h.shape == (3, 10, 64) and eager.dtype == jnp.float32
    np.testing.assert_array_equal(lm_logits(tiny_config, tiny_params, h), eager)


def test_kv_cache_hook_matches_full_forward(tiny_config, tiny_params, left_padded_batch):
    """Prefill 6 tokens into a static cache of 10 slots, then feed the last 4: same logits as one pass."""
    tokens, mask = left_padded_batch
    c = tiny_config
    full = _forward(c, tiny_params, tokens, mask, lora_scale=1.0)
    positions, allowed = attention_positions(mask), causal_padding_mask(mask)  # [B, T], [B, T, S]
    cache = init_cache(c, 3, 10)  # one {"k", "v"} of [B, K, S, E] per layer

    @jax.jit
    def step(cache, start):
        x = embed(c, tiny_params, jax.lax.dynamic_slice_in_dim(tokens, start, 2, axis=1))
        pos = jax.lax.dynamic_slice_in_dim(positions, start, 2, axis=1)
        # Slots not yet written are hidden by the causal part of the mask (s <= t).
        mask_BTS = jax.lax.dynamic_slice_in_dim(allowed, start, 2, axis=1)
        h, cache = decoder(c, tiny_params, x, pos, mask_BTS, lora_scale=1.0, kv_cache=cache, cache_index=start)
        return lm_logits(c, tiny_params, h), cache

    logits = []
    for start in range(0, 10, 2):  # 5 chunks of 2 tokens, one compile
        chunk, cache = step(cache, start)
        logits.append(chunk)
    real = mask == 1
    # Attention over 2-token chunks and a cache against one pass: float32 rounding (~5e-7 of the norm measured).
    assert_close_relative(np.concatenate(logits, axis=1)[real], np.asarray(full)[real], 2e-5)


def test_bfloat16_compute_stays_close(tiny_config, tiny_params, left_padded_batch):
    tokens, mask = left_padded_batch
    bf16 = dataclasses.replace(tiny_config, compute_dtype="bfloat16")
    ref = np.asarray(_forward(tiny_config, tiny_params, tokens, mask, lora_scale=1.0))
    out = _forward(bf16, tiny_params, tokens, mask, lora_scale=1.0)
    assert out.dtype == jnp.float32
    real = mask == 1
    # bf16 keeps 8 mantissa bits (~0.4% relative); two layers of it stay within a few percent of the range.
    assert np.abs(np.asarray(out)[real] - ref[real]).max() < 0.05 * np.abs(ref[real]).max()


# ------------------------------------------------------------------------------------- fused attention
def _prompt_response_batch():
    """``(tokens [4, 12], mask)`` laid out as the trainer's batches: a left-padded prompt then a right-padded
    response, so the real tokens of a row are one run anywhere in it; row 3 is empty (mesh padding)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(4, 96, size=(4, 12)).astype(np.int32)
    mask = np.zeros((4, 12), np.int32)
    for row, (start, stop) in enumerate([(0, 12), (3, 12), (2, 7), (0, 0)]):
        mask[row, start:stop] = 1
    return np.where(mask == 1, tokens, 0), mask


def test_fused_attention_equals_the_einsum_path(tiny_config, tiny_params, remat="dots"):
    """``attention: xla`` (``jax.nn.dot_product_attention``, rows rotated to right padding) gives the einsum
    path's logits on every real token and the same gradients, adapter on. On a GPU ``cudnn`` swaps only the
    kernel of this path; ``benchmarks/gpu.py`` checks it against einsum there before timing it. Under remat
    (``dots``) the kernel is recomputed in the backward pass; without remat, ``tests/sharded_checks.py`` compares
    it with einsum on a mesh and on one device."""
    tokens, mask = _prompt_response_batch()
    fused = dataclasses.replace(tiny_config, attention="xla", remat=remat)
    real = mask == 1

    def loss(config, params):
        logits = forward(config, params, tokens, mask, lora_scale=1.0)
        return jnp.sum(jnp.where(real[..., None], jax.nn.log_softmax(logits), 0.0) ** 2), logits

    grad = jax.jit(jax.grad(loss, argnums=1, has_aux=True), static_argnums=0)
    want_grads, want = grad(tiny_config, tiny_params)
    got_grads, got = grad(fused, tiny_params)
    # Another attention kernel on rotated rows: float32 rounding of two layers (~5e-7 of the norm measured).
    assert_close_relative(np.asarray(got)[real], np.asarray(want)[real], 2e-5)
    assert np.isfinite(np.asarray(got)).all()  # padding slots too, the empty row included
    # Gradients add the backward pass and sums over every position: each leaf against its own norm (<= 1.2e-6
    # measured), not per element, where entries that cancel differ between CPU builds (AVX2 vs AVX-512).
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads), strict=True):
        assert_close_relative(g, w, 1e-4, jax.tree_util.keystr(path))
    assert max(np.abs(np.asarray(w)).max() for w in jax.tree.leaves(want_grads["lora"])) > 1e-2  # not vacuous


def test_fused_attention_refuses_a_mask_with_a_hole(tiny_config, tiny_params):
    """A row whose real tokens are not one run cannot be rotated into right padding: NaN, not a wrong value."""
    tokens, mask = _prompt_response_batch()
    mask[1, 6] = 0
    logits = np.asarray(_forward(dataclasses.replace(tiny_config, attention="xla"), tiny_params, tokens, mask))
    assert np.isnan(logits[1]).all()
    assert np.isfinite(logits[[0, 2, 3]]).all()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the error is for backends without cuDNN")
def test_cudnn_attention_off_gpu_names_the_option(tiny_config, tiny_params, left_padded_batch):
    tokens, mask = left_padded_batch
    with pytest.raises(ValueError, match="attention 'cudnn' needs a CUDA GPU"):
        cudnn = dataclasses.replace(tiny_config, compute_dtype="bfloat16", attention="cudnn")
        forward(cudnn, tiny_params, tokens, mask)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="off a GPU, JAX's own cuDNN check is the one reached")
def test_the_cudnn_guard_asks_the_devices_traced_for_not_the_default_backend(tiny_config, tiny_params):
    """Traced for a mesh of GPUs (as when this CPU compiles for H100s) the guard lets ``cudnn`` through to JAX's own
    attention, which here finds no cuDNN library; traced for the CPU, the guard refuses first."""
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh, AxisType

    cudnn = dataclasses.replace(tiny_config, compute_dtype="bfloat16", attention="cudnn")
    tokens, mask = jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32)
    trace = jax.jit(lambda p: forward(cudnn, p, tokens, mask), inline=True).trace
    h100 = AbstractDevice("NVIDIA H100 80GB HBM3", None, "gpu")
    axes = dict(axis_sizes=(1, 8, 1), axis_names=("data", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
    gpus = AbstractMesh(**axes, abstract_device=h100)
    with jax.sharding.use_abstract_mesh(gpus), pytest.raises(RuntimeError, match="cuDNN is not detected"):
        trace(tiny_params)
    cpus = AbstractMesh(
        (8,), ("fsdp",), axis_types=(AxisType.Auto,), abstract_device=AbstractDevice("cpu", None, "cpu")
    )
    with jax.sharding.use_abstract_mesh(cpus), pytest.raises(ValueError, match="the devices traced for are 'cpu'"):
        trace(tiny_params)


def test_remat_dots_keeps_an_adapters_rank_r_product_not_its_projection_sized_one(tiny_config, tiny_params):
    """With the adapter on, "dots" saves for the backward pass what it saves for the base alone plus each adapted
    projection's ``x A`` ([rows, T, R]); its ``(x A) B``, the size of the projection's output, is recomputed."""
    from jax._src.ad_checkpoint import saved_residuals

    config = dataclasses.replace(tiny_config, remat="dots")
    tokens, mask = jnp.ones((2, 16), jnp.int32), jnp.ones((2, 16), jnp.int32)

    def layer_bytes(fn, arg):  # what the layer scan keeps: every layer's saved values, stacked
        kept = [aval for aval, source in saved_residuals(fn, arg) if "output of scan" in source]
        return sum(math.prod(aval.shape) * aval.dtype.itemsize for aval in kept)

    base = tiny_params["base"]
    off = layer_bytes(lambda b: forward(config, {"base": b}, tokens, mask).sum(), base)
    on = layer_bytes(lambda lora: forward(config, {"base": base, "lora": lora}, tokens, mask, lora_scale=1.0).sum(),
                     tiny_params["lora"])  # fmt: skip
    # 2 layers x 2 rows x 16 tokens x rank 4 x 4 bytes (float32) x 7 adapted projections = 7,168 bytes; keeping the
    # (x A) B products too measured 121,856.
    rank_r = config.num_layers * 2 * 16 * config.lora.rank * 4 * len(config.lora.targets)
    assert (config.num_layers, config.lora.rank, len(config.lora.targets)) == (2, 4, 7)
    assert on - off == rank_r
