"""L2RR: hand-computed allocation, weight update and masked advantages; the jvp against explicit gradients."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_relative

from lspo_jax.config import ModelConfig
from lspo_jax.methods import l2rr
from lspo_jax.methods.l2rr.config import L2RRConfig
from lspo_jax.rl import logprobs, losses, packing, rounds

CONFIG = ModelConfig.preset("tiny")


# ----------------------------------------------------------------------------------- masked advantages
def test_group_advantages_of_unequal_groups():
    # K = 4 slots per group; x marks padding (its reward must not matter).
    # g0 = [1, 0, 0, x]: mean 1/3, Bessel var = ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std 0.57735
    #     -> (2/3) / 0.57735 = 1.15470 and (-1/3) / 0.57735 = -0.57735 (times std / (std + 1e-6) for eps).
    # g1 = [1, 0, x, x]: mean 0.5, std sqrt(2 * 0.25 / 1) = 0.70711 -> +-0.70711.
    # g2 = [1, x, x, x]: one valid row -> 0.   g3 = [1, 1, x, x]: equal valid rewards -> exactly 0.
    rewards = jnp.array([1.0, 0.0, 0.0, 5.0, 1.0, 0.0, 9.0, 9.0, 1.0, 7.0, 7.0, 7.0, 1.0, 1.0, 0.0, 3.0])
    valid = jnp.array([1, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0], bool)
    adv = np.asarray(losses.group_advantages(rewards, 4, valid=valid))
    s0, s1 = math.sqrt(1 / 3), math.sqrt(0.5)
    want0 = np.array([2 / 3, -1 / 3, -1 / 3]) / (s0 + 1e-6)
    np.testing.assert_allclose(adv[:3], want0, rtol=1e-6)
    np.testing.assert_allclose(adv[4:6], np.array([0.5, -0.5]) / (s1 + 1e-6), rtol=1e-6)
    assert np.all(adv[~np.asarray(valid)] == 0.0)  # padding rows
    assert np.all(adv[8:] == 0.0)  # groups g2 and g3


def test_group_advantages_all_valid_equals_the_unmasked_path():
    rewards = np.random.default_rng(0).uniform(size=24).astype(np.float32)
    rewards[6:9] = 0.1  # an equal-rewards group
    for k in (3, 4):
        old = losses.group_advantages(rewards, k)
        np.testing.assert_array_equal(losses.group_advantages(rewards, k, valid=np.ones(24, bool)), old)
    with pytest.raises(ValueError, match="valid"):
        losses.group_advantages(rewards, 4, valid=np.ones(23, bool))


# -------------------------------------------------------------------------------------------- allocation
def _sampler(num_prompts: int, group_size: int, *, log_w=None, zero_streak=None, **config) -> l2rr.L2RRSampler:
    """An L2RR sampler whose weights and streaks are set through its checkpoint state."""
    sampler = l2rr.L2RRSampler(num_prompts, group_size, L2RRConfig(enabled=True, **config))
    state = sampler.state_dict()
    if log_w is not None:
        state["log_w"] = list(log_w)
    if zero_streak is not None:
        state["zero_streak"] = list(zero_streak)
    sampler.load_state_dict(state)
    return sampler


def test_allocation_by_hand():
    # G = 16, g_min = 2, rho_min = 0.25, p_e = 0.5. Weights w = [1, 4, 9, 16] / 30, streaks z = [0, 1, 1, 2].
    # survival p_e^z = [1, .5, .5, .25]: s_bar = 2.25 / 4 = 0.5625, budget RO = 4 * 16 * 0.5625 = 36.
    # w^(3/2) is proportional to [1, 8, 27, 64]. With c = 36 / 100 the shares are [.36, 2.88, 9.72, 23.04]:
    # prompt 3 is capped at 16 and prompt 0 floored at 2, leaving 18 for prompts 1 and 2 in ratio 8 : 27,
    # 18 * 8 / 35 = 4.114 and 18 * 27 / 35 = 13.886 (both inside [2, 16]). Floors [2, 4, 13, 16] sum to 35;
    # the one rollout left goes to the largest remainder, prompt 2 (.886 > .114): [2, 4, 14, 16], total 36.
    sampler = _sampler(4, 16, log_w=np.log(np.array([1, 4, 9, 16]) / 30), zero_streak=[0, 1, 1, 2])
    counts = sampler.allocate(np.array([3, 1, 0, 2]))  # the order of a draw, not of the indices
    np.testing.assert_array_equal(counts, [16, 4, 2, 14])
    assert sampler.last_budget_fraction == 36 / 64


def test_allocation_budget_below_the_floor_gives_everyone_the_floor():
    # rho_min = 0.1: RO = round(4 * 16 * 0.1) = round(6.4) = 6 < B * g_min = 8, so it is raised to 8.
    sampler = _sampler(4, 16, zero_streak=[9, 9, 9, 9], rho_min=0.1)
    np.testing.assert_array_equal(sampler.allocate(np.arange(4)), [2, 2, 2, 2])
    # No streaks: RO = 4 * 16 = B * G, every prompt at the cap whatever its weight.
    fresh = _sampler(4, 16, log_w=np.log(np.array([1, 4, 9, 16]) / 30))
    np.testing.assert_array_equal(fresh.allocate(np.arange(4)), [16, 16, 16, 16])


def test_split_budget_keeps_the_total_and_bounds():
    rng = np.random.default_rng(0)
    for _ in range(20):
        priority = rng.uniform(0, 1, size=7) ** 3
        total = int(rng.integers(7 * 2, 7 * 8 + 1))
        counts = l2rr.split_budget(priority, total, 2, 8)
        assert counts.sum() == total and counts.min() >= 2 and counts.max() <= 8
    with pytest.raises(ValueError, match="does not split"):
        l2rr.split_budget(np.ones(3), 25, 2, 8)


# ----------------------------------------------------------------------------------------- weight update
def test_weight_update_by_hand():
    # N = 4 prompts, uniform weights, streaks z = [3, 1, 0, 0]; a = 1, horizon 4: eta = 1 / sqrt(4) = 0.5.
    # The step observes prompts [0, 1, 2]: zero variance [no, yes, no] -> z = [0, 2, 0] (prompt 3 keeps 0).
    # Waste v = -(1 - 0.5^z) = [0, -0.75, 0]. Target d = [3, unscored, 1]: centred over the scored ones
    # [1, -1], population std 1 -> t = [1, 0, -1]. s = t + v = [1, -0.75, -1].
    # log w += 0.5 s: w is proportional to [e^0.5, e^-0.375, e^-0.5, e^0] = [1.64872, 0.68729, 0.60653, 1],
    # sum 3.94254 -> w = [0.41819, 0.17433, 0.15384, 0.25364].
    sampler = _sampler(4, 4, zero_streak=[3, 1, 0, 0], a=1.0, horizon=4, p_e=0.5)
    sampler.observe(np.array([0, 1, 2]), np.array([False, True, False]), np.array([3.0, np.nan, 1.0]))
    unnormalised = np.exp([0.5, -0.375, -0.5, 0.0])
    np.testing.assert_allclose(sampler.weights(), unnormalised / unnormalised.sum(), rtol=1e-12)
    np.testing.assert_allclose(sampler.weights(), [0.41819, 0.17433, 0.15384, 0.25364], atol=1e-5)
    np.testing.assert_array_equal(sampler.zero_streak, [0, 2, 0, 0])
    assert sampler.last_eta == 0.5


@pytest.mark.parametrize(
    "normalise, want",
    # d = [4, 1, 1, unscored]: centred [2, -1, -1]; population std sqrt((4 + 1 + 1) / 3) = sqrt(2).
    [("std", [2 / math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2), 0]), ("max_abs", [1, -0.5, -0.5, 0]),
     ("none", [2, -1, -1, 0])],
)  # fmt: skip
def test_target_signal_normalisations(normalise, want):
    np.testing.assert_allclose(l2rr.target_signal(np.array([4.0, 1.0, 1.0, np.nan]), normalise), want)
    assert np.all(l2rr.target_signal(np.array([2.5, 2.5, np.nan]), normalise) == 0.0)  # no spread, no signal


def test_config_validation_and_step_size():
    bad_values = {"a": 0.0, "horizon": 0, "rho_min": 0.0, "g_min": 1, "p_e": 1.5, "normalise": "l2",
                  "target_loss": "kl", "prompt_loss_norm": "row", "explore": 1.0, "max_draw_rounds": 0}  # fmt: skip
    for bad in ({field: value} for field, value in bad_values.items()):
        with pytest.raises(ValueError, match=next(iter(bad))):
            L2RRConfig(**bad)
    anytime = L2RRConfig(a=2.0)
    assert anytime.step_size(0) == 2.0 and anytime.step_size(3) == 1.0  # a / sqrt(t), t = 1 and 4
    assert L2RRConfig(a=2.0, horizon=16).step_size(3) == 0.5
    with pytest.raises(ValueError, match="g_min"):
        l2rr.L2RRSampler(4, 4, L2RRConfig(g_min=5))


# --------------------------------------------------------------------------------------------- samplers
def _fake_round(indices, rollouts):
    """Every third prompt gives a zero-variance group; the others join the batch."""
    zero_variance = indices % 3 == 0
    return zero_variance, ~zero_variance


def _run_steps(sampler, steps, *, first_step=0, batch=3):
    """Steps of draw rounds and observations; returns what each step drew and allocated."""
    log = []
    for step in range(first_step, first_step + steps):
        rng = np.random.default_rng([7, step])
        drawn = rounds.collect_batch(sampler, batch, rng, _fake_round, max_rounds=3)
        assert len(np.unique(drawn.indices)) == len(drawn.indices)  # without replacement within the step
        scores = np.sin(drawn.batch.astype(np.float64))
        sampler.observe(drawn.indices, drawn.zero_variance, drawn.scores_for_observe(scores))
        log.append((drawn.indices.tolist(), drawn.rollouts.tolist(), sampler.rollouts_step))
    return log


def test_l2rr_sampler_is_deterministic_and_resumes_from_its_state():
    make = lambda: _sampler(10, 8, a=1.0, rho_min=0.25)
    first, second = make(), make()
    assert _run_steps(first, 4) == _run_steps(second, 4)
    assert not np.allclose(first.weights(), 0.1)  # the weights did move
    restored = make()
    restored.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert _run_steps(restored, 3, first_step=4) == _run_steps(first, 3, first_step=4)
    assert restored.state_dict() == first.state_dict()
    log = _run_steps(make(), 1)
    assert make().metrics()["sampler/rollouts_total"] == 0
    assert first.metrics()["sampler/rollouts_total"] > 0 and log[0][2] == sum(log[0][1])


def test_l2rr_draw_rounds_collect_a_full_batch_and_charge_every_rollout():
    sampler = _sampler(10, 8)
    drawn = rounds.collect_batch(sampler, 4, np.random.default_rng(0), _fake_round, max_rounds=10)
    assert int(drawn.usable.sum()) == 4 and np.all(drawn.batch % 3 != 0)
    assert sampler.rollouts_step == 0  # charged at the step's end
    sampler.observe(drawn.indices, drawn.zero_variance)
    assert sampler.rollouts_step == drawn.rollouts.sum() == sampler.metrics()["sampler/rollouts_total"]
    sampler.draw(6, np.random.default_rng(1))
    with pytest.raises(ValueError, match="left in this step"):
        sampler.draw(5, np.random.default_rng(2))


# ------------------------------------------------------------------------------ directional derivatives
P, K, PROMPT, T = 3, 3, 4, 10


@functools.cache
def _rl_batch():
    """3 prompts x 3 slots; prompt 2 has two rollouts (its third slot is padding, masked out)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(4, CONFIG.vocab_size, size=(P * K, T)).astype(np.int32)
    lengths = np.array([T, 8, 9, 6, 7, T, 8, 9, 0])
    positions = np.arange(T)[None, :]
    rewards = np.array([1, 0, 0, 0, 1, 1, 1, 0, 0], np.float32)
    return {
        "tokens": tokens,
        "attention_mask": (positions < np.maximum(lengths, PROMPT)[:, None]).astype(np.int32),
        "mask": (positions < lengths[:, None]) & (positions >= PROMPT),
        "old_logp": (-np.log(CONFIG.vocab_size) + rng.uniform(-0.3, 0.3, size=(P * K, T))).astype(np.float32),
        "advantages": np.asarray(losses.group_advantages(rewards, K, valid=lengths > 0)),
    }


@functools.cache
def _target_rows():
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 90, size=n).tolist() for n in (3, 4)]
    solutions = [rng.integers(4, 90, size=n).tolist() for n in (6, 4)]
    return packing.pack_sft(prompts, solutions, PROMPT, T - PROMPT)


def _target_loss(base, rows):
    logp, _ = logprobs.sequence_logprobs(CONFIG, {"base": base}, rows["tokens"], rows["attention_mask"])
    return losses.sft_loss(logp, rows["mask"])


def _example_mean_loss(base, rows):
    logp, _ = logprobs.sequence_logprobs(CONFIG, {"base": base}, rows["tokens"], rows["attention_mask"])
    return jnp.mean(jax.vmap(losses.sft_loss)(logp, rows["mask"]))


def _tree_dots(stacked, tree) -> np.ndarray:
    """``<stacked[i], tree>`` for every i (leaves of ``stacked`` carry a leading axis), in float64."""
    pairs = zip(jax.tree.leaves(stacked), jax.tree.leaves(tree), strict=True)
    return sum(np.tensordot(np.asarray(s, np.float64), np.asarray(t, np.float64), axes=np.ndim(t)) for s, t in pairs)


def _target_gradient(base, rows, kind="nll_token_mean"):
    # With TargetSide's options: the program its mesh program (l2rr.sharded_target_gradient) runs inside.
    weighted = {**rows, "weight": jnp.asarray(l2rr.target_row_weights(rows["mask"], kind))}
    return l2rr.target_gradient(CONFIG, base, weighted, num_micro_batches=1, chunk_size=None)


@jax.jit
def _per_prompt_gradients(base, batch):
    """The per-prompt gradients g_i by reverse mode: the Jacobian of the per-prompt losses, row i = g_i."""
    return jax.jacrev(lambda b: l2rr.PolicyLosses(CONFIG, K)(b, batch))(base)


def test_directional_derivatives_equal_explicit_gradient_dots(tiny_params):
    base, rows = tiny_params["base"], jax.tree.map(jnp.asarray, _target_rows())
    side = l2rr.TargetSide(CONFIG, _target_rows())
    fast = side.directional_derivatives(tiny_params, l2rr.PolicyLosses(CONFIG, K).bind(_rl_batch()))
    jacobian = _per_prompt_gradients(base, _rl_batch())
    explicit = _tree_dots(jacobian, _target_gradient(base, rows))
    assert fast.shape == (P,) and np.all(np.abs(explicit) > 1e-3)
    # d_i = <g_i, g_target>: forward mode against two reverse-mode gradients dotted over ~1e5 parameters, float32
    # rounding of the forward and backward passes (~6e-7 of the norm measured); a wrong sign or row is O(1).
    assert_close_relative(fast, explicit, 1e-4)
    # The sign convention: a small step down prompt i's gradient changes the target loss by -lr * d_i.
    direction = _random_direction(base)  # unused here; the same arguments reuse one compiled program
    before = float(_target_losses(base, rows, direction)[0])
    for i in range(P):
        g_i = [np.asarray(j[i]) for j in jax.tree.leaves(jacobian)]
        lr = 1e-2 / sum(float(np.sum(g * g)) for g in g_i)
        leaves = [np.asarray(p) - lr * g for p, g in zip(jax.tree.leaves(base), g_i, strict=True)]
        stepped = jax.tree.unflatten(jax.tree.structure(base), leaves)
        change = float(_target_losses(stepped, rows, direction)[0]) - before
        assert change == pytest.approx(-lr * explicit[i], rel=0.05), i
    assert {name for name in dir(side) if not name.startswith("_")} == {"directional_derivatives", "from_examples"}


def test_look_ahead_takes_the_target_gradient_at_other_params(tiny_params):
    """``target_params``: d_i = <g_tgt(theta'), g_i(theta)>, against the same reverse-mode references with the target
    gradient taken at theta' = theta + 0.1 * a random direction (a stand-in for the updated base)."""
    base, rows = tiny_params["base"], jax.tree.map(jnp.asarray, _target_rows())
    ahead = jax.tree.map(lambda p, d: p + 0.1 * d, base, _random_direction(base))
    side = l2rr.TargetSide(CONFIG, _target_rows())
    fast = side.directional_derivatives(tiny_params, l2rr.PolicyLosses(CONFIG, K).bind(_rl_batch()), {"base": ahead})
    jacobian = _per_prompt_gradients(base, _rl_batch())
    explicit = _tree_dots(jacobian, _target_gradient(ahead, rows))
    here = _tree_dots(jacobian, _target_gradient(base, rows))
    assert_close_relative(fast, explicit, 1e-4)  # as above
    assert np.max(np.abs(explicit - here)) > 1e-2 * np.max(np.abs(here))  # the look-ahead point matters


@jax.jit
def _target_losses(base, rows, direction):
    """The token-mean target loss, and the slope of each target loss along ``direction`` by forward mode."""
    token_loss, token_slope = jax.jvp(lambda b: _target_loss(b, rows), (base,), (direction,))
    example_slope = jax.jvp(lambda b: _example_mean_loss(b, rows), (base,), (direction,))[1]
    return token_loss, token_slope, example_slope


def _random_direction(base, seed=3):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), base)


def test_target_gradient_of_each_kind(tiny_params):
    base, rows = tiny_params["base"], jax.tree.map(jnp.asarray, _target_rows())
    direction = _random_direction(base)
    _, token_slope, example_slope = _target_losses(base, rows, direction)
    stacked = lambda tree: jax.tree.map(lambda x: x[None], tree)
    token = _tree_dots(stacked(_target_gradient(base, rows)), direction)[0]
    example = _tree_dots(stacked(_target_gradient(base, rows, "nll_example_mean")), direction)[0]
    # Slopes along a random direction of ~1e5 parameters: sums with cancelling signs of float32 gradients and
    # tangents (~8e-7 relative measured); the two kinds differ by ~30%, far above rel 1e-4.
    assert token == pytest.approx(float(token_slope), rel=1e-4)
    assert example == pytest.approx(float(example_slope), rel=1e-4)
    assert abs(token - example) > 1e-3 * abs(token)  # the two kinds weigh the rows differently


def test_target_row_weights_by_hand():
    # Rows with 3, 1 and 0 target tokens. Token mean: 1 / 4 each. Example mean over the 2 rows with tokens:
    # 1 / (3 * 2) and 1 / (1 * 2); the empty row weighs 0.
    mask = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0]])
    np.testing.assert_allclose(l2rr.target_row_weights(mask, "nll_token_mean"), [0.25, 0.25, 0.25])
    np.testing.assert_allclose(l2rr.target_row_weights(mask, "nll_example_mean"), [1 / 6, 1 / 2, 0.0])


@jax.jit
def _loss_views(base, batch):
    prompt_norm = l2rr.PolicyLosses(CONFIG, K)(base, batch)
    batch_norm = l2rr.PolicyLosses(CONFIG, K, normalise="batch")(base, batch)
    logp, _ = logprobs.sequence_logprobs(CONFIG, {"base": base}, batch["tokens"], batch["attention_mask"])
    names = ("old_logp", "advantages", "mask")
    whole = losses.policy_loss(logp, *(batch[n] for n in names))[0]
    alone = [losses.policy_loss(logp[i * K : (i + 1) * K], *(batch[n][i * K : (i + 1) * K] for n in names))[0]
             for i in range(P)]  # fmt: skip
    return prompt_norm, batch_norm, whole, jnp.stack(alone)


def test_per_prompt_losses_normalisations(tiny_params):
    prompt_norm, batch_norm, whole, alone = _loss_views(tiny_params["base"], _rl_batch())
    np.testing.assert_allclose(prompt_norm, alone, rtol=1e-6)  # each prompt's own token-mean
    np.testing.assert_allclose(float(batch_norm.sum()), float(whole), rtol=1e-5)  # shares of the batch loss
