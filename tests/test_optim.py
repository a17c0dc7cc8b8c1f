"""Disjoint gradient routing on the tiny Qwen2: RL moves only the base, SFT only the adapter."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close_relative

from lspo_jax.config import ModelConfig
from lspo_jax.models.specs import ParamSpec, param_specs
from lspo_jax.rl import logprobs, losses, optim

CONFIG = ModelConfig.preset("tiny")
# A large SFT lr so that a few steps visibly fit; routing does not depend on it.
SFT = optim.SFTOptimConfig(lr=1e-2)
RL = optim.RLOptimConfig(lr=1e-4, warmup_steps=2)
B, T, PROMPT = 4, 12, 4


def _trees_equal(a, b) -> bool:
    """Bit-identical pytrees: same structure, dtypes and every element equal (no tolerance)."""
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    same_structure = jax.tree.structure(a) == jax.tree.structure(b)
    return same_structure and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def _numpy_init(spec: ParamSpec, rng: np.random.Generator) -> np.ndarray:
    """The spec's initialiser in numpy: jax.random would compile one program per shape, slowly on CPU."""
    if spec.init in ("zeros", "ones"):
        return np.full(spec.shape, float(spec.init == "ones"), spec.dtype)
    if spec.init == "uniform":
        return rng.uniform(-spec.init_scale, spec.init_scale, spec.shape).astype(spec.dtype)
    return (spec.init_scale * rng.standard_normal(spec.shape)).astype(spec.dtype)


@functools.cache
def _params():
    rng = np.random.default_rng(0)
    specs = param_specs(CONFIG)
    params = jax.tree.map(lambda spec: _numpy_init(spec, rng), specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    # A non-zero B makes the adapter change the output when it is on, so "scale 0 ignores it" means something.
    params["lora"] = jax.tree.map(lambda x: x + np.float32(0.05), params["lora"])
    return params


@functools.cache
def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, size=(B, T)).astype(np.int32)
    lengths = np.array([T, 7, 10, 5])  # right padding after each row's length
    positions = np.arange(T)[None, :]
    attention_mask = positions < lengths[:, None]
    return {
        "tokens": tokens,
        "attention_mask": attention_mask,
        "mask": attention_mask & (positions >= PROMPT),  # response tokens only
        # The random tiny model is close to uniform (log-probs near -ln 96 = -4.56); +-0.3 nats around that
        # makes ratios differ from 1 and some of them clip.
        "old_logp": (-np.log(CONFIG.vocab_size) + rng.uniform(-0.3, 0.3, size=(B, T))).astype(np.float32),
        "advantages": losses.group_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), 2),
    }


_rl_step = jax.jit(functools.partial(optim.rl_step, CONFIG, rl=RL), static_argnames="num_micro_batches")
_sft_step = jax.jit(functools.partial(optim.sft_step, CONFIG, sft=SFT))


@functools.cache
def _trajectory():
    """init -> RL step -> SFT step -> RL step, keeping every (params, opt_state, metrics)."""
    params = _params()
    state = optim.make_optimizer(RL, SFT).init(params)
    steps = [(params, state, {})]
    # RL steps in two micro-batches: the scan path of accumulate_gradients through the real model.
    rl_step = functools.partial(_rl_step, num_micro_batches=2)
    for step in (rl_step, _sft_step, rl_step):
        params, state, metrics = step(params, state, _batch())
        steps.append((params, state, metrics))
    return steps


def test_rl_step_leaves_adapter_and_sft_state_bit_identical():
    # Step 3 runs after an SFT step, so the SFT state holds non-zero moments that a wrongly routed
    # AdamW would turn into a non-zero update even from a zero gradient.
    for before, after in (_trajectory()[0:2], _trajectory()[2:4]):
        assert _trees_equal(after[0]["lora"], before[0]["lora"])
        assert _trees_equal(after[1].inner_states["lora"], before[1].inner_states["lora"])
        assert not _trees_equal(after[0]["base"], before[0]["base"])
    assert np.isfinite(float(_trajectory()[1][2]["loss"]))


def test_sft_step_leaves_base_and_rl_state_bit_identical():
    (p1, s1, _), (p2, s2, metrics) = _trajectory()[1:3]
    assert _trees_equal(p2["base"], p1["base"])
    assert _trees_equal(s2.inner_states["base"], s1.inner_states["base"])
    assert not _trees_equal(p2["lora"], p1["lora"])
    assert float(metrics["num_tokens"]) == float(_batch()["mask"].sum())


def test_sft_steps_fit_the_batch():
    params, state, _ = _trajectory()[0]
    fitted = []
    for _ in range(3):
        params, state, metrics = _sft_step(params, state, _batch())
        fitted.append(float(metrics["sft_loss"]))
    assert fitted[2] < fitted[0]


@jax.jit
def _rl_grads(params, lora_scale):
    """RL gradient w.r.t. the base of (base alone, base + adapter at a traced ``lora_scale``).

    A traced scale makes the model compute the adapter path and multiply it by the scale (the harder case;
    a Python 0.0 skips the adapter altogether). One compiled function serves scales 0 and 1.
    """
    batch = _batch()

    def loss(base, lora):
        full = {"base": base} if lora is None else {"base": base, "lora": lora}
        scale = 0.0 if lora is None else lora_scale
        logp, _ = logprobs.sequence_logprobs(CONFIG, full, batch["tokens"], batch["attention_mask"], lora_scale=scale)
        return losses.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["mask"])[0]

    return jax.grad(loss)(params["base"], None), jax.grad(loss)(params["base"], params["lora"])


def test_rl_gradient_with_adapter_at_scale_zero_equals_base_alone():
    alone, at_zero = _rl_grads(_params(), 0.0)
    # The forward pass adds exact zeros, but XLA may order the backward's sums differently once the adapter's path
    # is in the program: the base's gradient agrees to float32 rounding (<= 1.9e-7 of a leaf's norm measured, under
    # both of XLA's CPU fusion emitters), where an adapter leaking through at scale 0 moves it by O(1).
    assert jax.tree.structure(at_zero) == jax.tree.structure(alone)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(at_zero), jax.tree.leaves(alone), strict=True):
        assert got.dtype == want.dtype, jax.tree_util.keystr(path)
        assert_close_relative(got, want, 1e-5, jax.tree_util.keystr(path))
    # The adapter is real: switched on, it changes the gradient.
    alone, at_one = _rl_grads(_params(), 1.0)
    differs = [not np.allclose(x, y) for x, y in zip(jax.tree.leaves(at_one), jax.tree.leaves(alone), strict=True)]
    assert any(differs)


def test_update_subtree_matches_multi_transform_for_its_label():
    params = {"base": {"w": jnp.array([1.0, -2.0])}, "lora": {"a": jnp.array([0.5])}}
    grads = {"base": {"w": jnp.array([0.3, -0.1])}, "lora": {"a": jnp.array([0.7])}}
    tx = optim.make_optimizer(optim.RLOptimConfig(lr=0.1), optim.SFTOptimConfig(lr=0.2))
    state = tx.init(params)
    # Both jitted: eagerly, each of optax's small ops would compile on its own.
    updates, full_state = jax.jit(tx.update)(grads, state, params)
    rl_tx = optim.adamw_transform(optim.RLOptimConfig(lr=0.1))
    new_params, new_state = jax.jit(functools.partial(optim.update_subtree, rl_tx, "base"))(
        grads["base"], params, state
    )
    assert _trees_equal(new_params["base"], optax.apply_updates(params["base"], updates["base"]))
    assert _trees_equal(new_state.inner_states["base"], full_state.inner_states["base"])
    assert _trees_equal(new_state.inner_states["lora"], state.inner_states["lora"])


def test_reset_adapter_gives_fresh_adapter_and_sft_state():
    params, state, _ = _trajectory()[2]  # after an SFT step: moments and count are non-zero
    new_params, new_state = optim.reset_adapter(CONFIG, params, state, jax.random.key(7), sft=SFT)
    for name, ab in new_params["lora"].items():
        assert np.all(np.asarray(ab["b"]) == 0.0), name
        assert not np.array_equal(ab["a"], params["lora"][name]["a"]), name
    fresh = new_state.inner_states["lora"]
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(fresh))  # counts 0, mu = nu = 0
    assert jax.tree.structure(fresh) == jax.tree.structure(state.inner_states["lora"])
    assert _trees_equal(new_params["base"], params["base"])
    assert _trees_equal(new_state.inner_states["base"], state.inner_states["base"])
    with pytest.raises(ValueError, match="SFTOptimConfig"):
        optim.reset_adapter(CONFIG, params, state, jax.random.key(7), sft=optim.SFTOptimConfig(max_grad_norm=None))


def test_warmup_schedule_first_steps():
    # Adam's first steps with a constant gradient: m_hat / sqrt(v_hat) = g / |g| = 1 (eps 1e-8 aside), so
    # the update is -lr_t with lr_t = 1e-3 * min(1, (t + 1) / 4) = 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3.
    tx = optim.adamw_transform(optim.AdamWConfig(lr=1e-3, warmup_steps=4, weight_decay=0.0, max_grad_norm=None))
    params, grads = jnp.array([1.0]), jnp.array([0.5])
    state = tx.init(params)
    for expected in (2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3):
        updates, state = tx.update(grads, state, params)
        # rel 1e-3: the float32 bias correction 1 - 0.999^t ~ 1e-3 magnifies each ulp of 0.999^t (6e-8) about
        # 500 times (~3e-5 at t = 2; 1e-5 measured), and pow's last ulps differ between CPU builds; a warm-up one
        # step off moves the update by 25% or more.
        assert float(updates[0]) == pytest.approx(-expected, rel=1e-3)


def test_config_defaults_and_validation():
    assert optim.RLOptimConfig().lr == 1e-6 and optim.SFTOptimConfig().lr == 2.5e-5
    assert optim.RLOptimConfig().weight_decay == 0.01 and optim.RLOptimConfig().max_grad_norm == 1.0
    for bad in ({"lr": 0.0}, {"warmup_steps": -1}, {"max_grad_norm": 0.0}, {"b2": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            optim.RLOptimConfig(**bad)
    with pytest.raises(ValueError, match="extra"):
        optim.param_labels({"base": {}, "other": {}})


# ------------------------------------------------------------------------------------ memory savers
@functools.partial(jax.jit, static_argnames=("config", "chunk_size"))
def _logprob_outputs(config, chunk_size, params, batch):
    """Log-probs, entropies and the RL gradient of the base, by ``chunk_size`` (None: whole logits)."""

    def loss(base):
        args = (config, {"base": base}, batch["tokens"], batch["attention_mask"])
        logp, entropy = logprobs.logprobs_and_entropy(*args, temperature=0.7, chunk_size=chunk_size)
        value = losses.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["mask"])[0]
        return value, (logp, entropy, logprobs.sequence_logprobs(*args, temperature=0.7, chunk_size=chunk_size))

    (_, (logp, entropy, (seq_logp, logits))), grads = jax.value_and_grad(loss, has_aux=True)(params["base"])
    return logp, entropy, seq_logp, logits is None, grads


@pytest.mark.parametrize("chunk_size", [5, 16])  # 5 does not divide the 11 predicted positions: padded
def test_chunked_logprobs_equal_full_logits(chunk_size):
    logp, entropy, _, _, grads = _logprob_outputs(CONFIG, None, _params(), _batch())
    c_logp, c_entropy, c_seq_logp, no_logits, c_grads = _logprob_outputs(CONFIG, chunk_size, _params(), _batch())
    # The head's matmul and log-softmax per chunk instead of whole: the same float32 ops in another order
    # (~1e-7 of the norm measured); gradients add the backward pass (~5e-7), each leaf against its own norm.
    assert_close_relative(c_logp, logp, 2e-5)
    assert_close_relative(c_seq_logp, logp, 2e-5)
    assert_close_relative(c_entropy, entropy, 2e-5)
    assert no_logits  # the chunked path never holds them whole
    for got, want in zip(jax.tree.leaves(c_grads), jax.tree.leaves(grads), strict=True):
        assert_close_relative(got, want, 1e-4)


@pytest.mark.parametrize("positions, chunk_size, size", [(11, 5, 4), (11, 16, 11), (11, 11, 11), (12, 4, 4)])
def test_the_head_runs_on_even_chunks_no_longer_than_the_batch(positions, chunk_size, size):
    # 11 positions in chunks of at most 5: three chunks, evened out to 4 (one pad position, not 15 - 11 = 4); a
    # batch shorter than chunk_size is one chunk of its own length: padded to chunk_size, a short step over the
    # paper's 151,936-word vocabulary spent most of its time on pad logits.
    seen = []

    def head(h_BCD):
        seen.append(h_BCD.shape[1])  # at trace time: lax.map traces the chunk once
        return h_BCD @ jnp.ones((3, 7))

    hidden, targets = jnp.ones((2, positions, 3)), jnp.zeros((2, positions), jnp.int32)
    logp, _ = logprobs.chunked_token_logprobs(hidden, head, targets, chunk_size=chunk_size)
    assert logp.shape == (2, positions) and seen == [size]
    # uniform logits over 7 words: every log-prob is -log 7, pad positions dropped
    np.testing.assert_allclose(np.asarray(logp), -np.log(7.0), rtol=1e-6)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_the_same_gradient(remat):
    _, _, _, _, grads = _logprob_outputs(CONFIG, None, _params(), _batch())
    _, _, _, _, remat_grads = _logprob_outputs(dataclasses.replace(CONFIG, remat=remat), None, _params(), _batch())
    for got, want in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(grads), strict=True):
        assert_close_relative(got, want, 1e-4)  # the forward recomputed, maybe fused otherwise: rounding only
    with pytest.raises(ValueError, match="remat"):
        dataclasses.replace(CONFIG, remat="some")


def test_learner_logprobs_in_micro_batches_and_chunks_equal_one_pass():
    """The learner's log-prob pass over 3 padded rows, in 2 micro-batches (rows padded to 4) with a 5-token head
    chunk, equals the plain pass; so does the packed pass; positions off the response mask are 0."""
    from lspo_jax.rl.learner import Learner
    from lspo_jax.rollout.generator import Policy
    from lspo_jax.step_config import LossConfig, RolloutConfig
    from lspo_jax.train_config import TrainConfig

    batch = _batch()
    rows = {k: np.asarray(batch[k])[:3] for k in ("tokens", "attention_mask", "mask")}
    rollout = RolloutConfig(temperature=0.7)

    def learner(loss: LossConfig) -> Learner:
        return Learner(TrainConfig(rollout=rollout, loss=loss), Policy(CONFIG, None, ()), _params())

    plain = learner(LossConfig(packing=False)).logprobs(rows, lora_scale=0.0)
    split = learner(LossConfig(micro_batches=2, chunk_size=5, packing=False)).logprobs(rows, lora_scale=0.0)
    assert_close_relative(split, plain, 2e-5)  # other batch and chunk shapes of the same float32 ops
    packed = learner(LossConfig(chunk_size=5)).logprobs(rows, lora_scale=0.0)
    assert_close_relative(packed, plain, 2e-5)
    assert np.all(plain[rows["mask"] == 0] == 0) and np.all(plain[rows["mask"] > 0] < 0)


def test_learning_rate_follows_the_warm_up():
    from lspo_jax.rl.optim import RLOptimConfig, learning_rate

    config = RLOptimConfig(lr=1e-3, warmup_steps=4)
    # lr * min(1, (count + 1) / warmup): 1e-3 * 1/4, 1e-3 * 4/4, then flat. The schedule computes in float32
    # (one rounding: relative error below 6e-8).
    assert [learning_rate(config, n) for n in (0, 3, 10)] == pytest.approx([2.5e-4, 1e-3, 1e-3], rel=1e-6)


def test_one_loss_spec_reaches_the_update_the_logprob_passes_and_the_l2rr_target(monkeypatch):
    """The run's clip, temperature and LM-head chunk reach every program that reads the policy's tokens by one
    object: the update's, the log-prob pass's (the re-rolls' at their own temperature) and L2RR's prompt losses."""
    from lspo_jax.job.config import load_config
    from lspo_jax.methods import l2rr
    from lspo_jax.rl import distributed
    from lspo_jax.rl.learner import Learner
    from lspo_jax.rollout.generator import Policy

    overrides = ["loss.eps_high=0.3", "loss.clip_c=3.0", "rollout.temperature=0.7", "loss.chunk_size=8"]
    run = load_config(None, [*overrides, "loss.packing=false"])
    spec = losses.LossSpec.of(run)
    assert spec == losses.LossSpec(eps_low=0.2, eps_high=0.3, clip_c=3.0, temperature=0.7, chunk_size=8)
    assert spec.clip == {"eps_low": 0.2, "eps_high": 0.3, "clip_c": 3.0}
    built = []

    def recorder(result):
        def build(config, mesh, **options):
            built.append(options["spec"])
            return lambda params, *arrays: result(arrays[-1])

        return build

    monkeypatch.setattr(distributed, "sharded_logprobs", recorder(lambda rows: np.zeros(rows["tokens"].shape)))
    monkeypatch.setattr(distributed, "sharded_rl_step", recorder(lambda batch: (None, None, {"finite": True})))
    learner = Learner(run, Policy(CONFIG, None, ()), _params())
    rows = {k: np.asarray(v)[:2] for k, v in _batch().items()}
    learner.logprobs(rows, lora_scale=0.0)
    learner.logprobs(rows, lora_scale=1.0, temperature=0.9)
    learner.rl_step(rows)
    assert built == [spec, dataclasses.replace(spec, temperature=0.9), spec]
    assert l2rr.TargetScorer(run, CONFIG, None).losses.spec == spec


def test_the_learner_is_built_whole_restoring_before_the_engine_starts_and_closing_both():
    from lspo_jax.rl.learner import Learner
    from lspo_jax.rollout.generator import Policy
    from lspo_jax.train_config import TrainConfig

    events = []

    class Part:
        def __init__(self, name):
            self.name = name

        def close(self):
            events.append(f"close {self.name}")

    def resume(fresh, adapter):
        events.append(f"resume (adapter kept: {adapter})")
        return dataclasses.replace(fresh, step=7)

    def engine():
        events.append("engine")
        return Part("engine")

    verifier, token_advantages = Part("verifier"), object()
    learner = Learner(TrainConfig(), Policy(CONFIG, None, ()), _params(), verifier=verifier,
                      token_advantages=token_advantages, resume=resume, engine=engine)  # fmt: skip
    assert (learner.verifier, learner.token_advantages) == (verifier, token_advantages)
    assert learner.state.step == 7 and learner.vllm.name == "engine" and learner.generator.vllm is learner.vllm
    learner.close()
    assert events == ["resume (adapter kept: False)", "engine", "close engine", "close verifier"]
    assert learner.vllm is None


def test_an_update_that_would_write_nan_into_the_base_is_skipped_and_counted():
    """A NaN in AdamW's second moment (a damaged checkpoint restored) leaves the loss and the gradient finite, but
    the update m / (sqrt(v) + eps) writes NaN into the base: the learner's step skips it whole and counts it."""
    from run_fixtures import assert_trees_equal, copy_tree

    from lspo_jax.rl.learner import Learner
    from lspo_jax.rollout.generator import Policy
    from lspo_jax.train_config import TrainConfig

    def poison(path, leaf):
        up = jax.tree_util.keystr(path).endswith(".nu['base']['layers']['up']")
        return jnp.asarray(leaf).at[0, 0, 0].set(jnp.nan) if up else leaf

    learner = Learner(TrainConfig(), Policy(CONFIG, None, ()), _params())
    clean = copy_tree(learner.state.opt_state)
    learner.state.opt_state = jax.tree_util.tree_map_with_path(poison, learner.state.opt_state)
    before = copy_tree((learner.state.params, learner.state.opt_state))
    # Unguarded, the same update writes NaN into the base.
    unguarded = _rl_step(*before, _batch())[0]["base"]["layers"]["up"]
    assert np.isnan(np.asarray(unguarded)).any()
    rows = {k: np.asarray(v) for k, v in _batch().items()}
    metrics = learner.rl_step(rows)
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]) and not metrics["finite"]
    assert_trees_equal((learner.state.params, learner.state.opt_state), before)
    assert (learner.state.nonfinite_total, learner.state.nonfinite_in_row, learner.state.updates) == (1, 1, 0)
    # A NaN in the adapter, which the RL update does not touch, does not stop it.
    learner.state.opt_state = jax.tree.map(jnp.asarray, clean)
    learner.state.params = {**learner.state.params, "lora": jax.tree.map(lambda x: x * np.nan, _params()["lora"])}
    assert learner.rl_step(rows)["finite"] and learner.state.updates == 1
    assert np.isfinite(np.asarray(learner.state.params["base"]["layers"]["up"])).all()
