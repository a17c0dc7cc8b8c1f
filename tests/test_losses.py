"""Loss math against hand-computed numbers, plus property tests that need no reference."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_relative
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lspo_jax.rl import corrections, logprobs, losses

PROPERTY = settings(max_examples=25, deadline=None)


# ----------------------------------------------------------------------------------------- advantages
def test_group_advantages_one_pass_in_four():
    # mean = 0.25; Bessel std = sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt((0.5625 + 0.1875) / 3) = 0.5
    # A = (1 - 0.25) / 0.5 = 1.5 and (0 - 0.25) / 0.5 = -0.5, each times 0.5 / (0.5 + 1e-6) for eps.
    adv = losses.group_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), 4)
    np.testing.assert_allclose(adv, np.array([1.5, -0.5, -0.5, -0.5]) * 0.5 / (0.5 + 1e-6), rtol=1e-6)


def test_group_advantages_two_groups_are_independent():
    # group 0 = [1, 0]: mean 0.5, std sqrt(2 * 0.25 / 1) = 0.7071 -> +-0.7071; group 1 = [0.5, 0.5] -> 0.
    adv = losses.group_advantages(jnp.array([1.0, 0.0, 0.5, 0.5]), 2)
    np.testing.assert_allclose(adv, [math.sqrt(0.5), -math.sqrt(0.5), 0.0, 0.0], rtol=1e-5)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -0.37])
def test_group_advantages_equal_rewards_give_exact_zero(value):
    # 0.1 * 3 / 3 != 0.1 in float32, so r - mean(r) alone would leave a residue divided by eps.
    adv = losses.group_advantages(jnp.full((6,), value), 3)
    assert np.all(np.asarray(adv) == 0.0)


def test_group_advantages_rejects_ragged_groups_and_handles_k1():
    with pytest.raises(ValueError, match="multiple of group_size"):
        losses.group_advantages(jnp.zeros(5), 4)
    assert np.all(np.asarray(losses.group_advantages(jnp.array([1.0, 0.0, 3.0]), 1)) == 0.0)


def test_group_advantages_mean_only_and_leave_one_out():
    # Group 0 = [1, 0, 0, 0], mean 0.25. mean_only: r - 0.25 = [0.75, -0.25, -0.25, -0.25].
    # loo: r_0 - mean(0, 0, 0) = 1; r_1 - mean(1, 0, 0) = -1/3 (= 4/3 * (r - 0.25)).
    # Group 1 = [2, 2, 2, 2]: equal rewards, exactly 0 under both.
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    mean_only = losses.group_advantages(rewards, 4, estimator="mean_only")
    np.testing.assert_allclose(mean_only, [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], rtol=1e-6)
    loo = losses.group_advantages(rewards, 4, estimator="loo")
    np.testing.assert_allclose(loo, [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0], rtol=1e-6)
    assert np.all(np.asarray(loo)[4:] == 0.0)
    with pytest.raises(ValueError, match="unknown advantage estimator 'rloo'"):
        losses.group_advantages(rewards, 4, estimator="rloo")


def test_group_advantages_estimators_over_valid_rows_only():
    # Group 0 has 3 valid rows [3, 0, 0] (the 4th is padding): mean 1; loo: 3 - 0 = 3, 0 - mean(3, 0) = -1.5.
    # Group 1 has one valid row: no other row to leave out, so 0 under both.
    rewards = jnp.array([3.0, 0.0, 0.0, 9.0, 5.0, 9.0, 9.0, 9.0])
    valid = jnp.array([True, True, True, False, True, False, False, False])
    mean_only = losses.group_advantages(rewards, 4, valid=valid, estimator="mean_only")
    np.testing.assert_allclose(mean_only, [2.0, -1.0, -1.0, 0, 0, 0, 0, 0], rtol=1e-6)
    loo = losses.group_advantages(rewards, 4, valid=valid, estimator="loo")
    np.testing.assert_allclose(loo, [3.0, -1.5, -1.5, 0, 0, 0, 0, 0], rtol=1e-6)


def test_importance_weights_by_hand():
    # Row 0: log pi - log mu = [-0.5, -0.25, (masked) 9] -> sum -0.75, w = exp(-0.75) = 0.47237 (under cap 1).
    # Row 1: [0.5, 0.5, 0.5] -> sum 1.5, exp(1.5) = 4.48 capped at 2.
    logp = jnp.array([[-1.0, -1.0, 5.0], [-1.0, -1.0, -1.0]])
    mu = jnp.array([[-0.5, -0.75, -4.0], [-1.5, -1.5, -1.5]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]])
    np.testing.assert_allclose(corrections.sequence_weights(logp, mu, mask, 2.0), [math.exp(-0.75), 2.0], rtol=1e-6)
    # Per token, cap 1.5: exp(-0.5) = 0.60653, exp(-0.25) = 0.77880, 1 off the mask; exp(0.5) = 1.6487 -> 1.5.
    want = [[math.exp(-0.5), math.exp(-0.25), 1.0], [1.5, 1.5, 1.5]]
    np.testing.assert_allclose(corrections.token_weights(logp, mu, mask, 1.5), want, rtol=1e-6)
    # Row advantages [2, -1] times per-row weights [0.5, 3]: [1, 1, 1] and [-3, -3, -3].
    weighted = losses.weighted_advantages(jnp.array([2.0, -1.0]), jnp.array([0.5, 3.0]), (2, 3))
    np.testing.assert_allclose(weighted, [[1.0] * 3, [-3.0] * 3])


@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_a_weight_on_the_advantage_is_a_weight_on_the_loss(clip_c):
    # The surrogate is positively homogeneous in A (dual clip included), which weighted_advantages relies on.
    rng = np.random.default_rng(0)
    logp, old = (jnp.asarray(rng.normal(size=(3, 6)) * 0.5 - 2.0, jnp.float32) for _ in range(2))
    adv, mask = jnp.array([1.5, -2.0, -0.5]), jnp.asarray(rng.random((3, 6)) < 0.8)
    w = jnp.asarray(rng.uniform(0.1, 3.0, size=(3, 6)), jnp.float32)

    def per_token(a):
        return jax.vmap(jax.vmap(lambda *x: losses.policy_loss(*(v[None, None] for v in x[:3]), jnp.ones((1, 1)),
                                                               clip_c=clip_c)[0]))(logp, old, a)  # fmt: skip

    weighted = per_token(losses.weighted_advantages(adv, w, mask.shape))
    # One token's loss of A * w against w times its loss of A: the same up to float32 rounding of a product.
    np.testing.assert_allclose(weighted, w * per_token(jnp.broadcast_to(adv[:, None], mask.shape)), rtol=1e-6)


# ------------------------------------------------------------------------------------- policy loss
@functools.partial(jax.jit, static_argnames="clip_c")
def _one_token_jit(logp, old_logp, adv, clip_c=None):
    def f(x):
        return losses.policy_loss(x[None, None], old_logp[None, None], adv[None], jnp.ones((1, 1)), clip_c=clip_c)[0]

    return jax.value_and_grad(f)(logp)


def _one_token(logp, old_logp, adv, clip_c=None):
    """Loss and d loss / d logp of a batch holding one token."""
    loss, grad = _one_token_jit(jnp.float32(logp), jnp.float32(old_logp), jnp.float32(adv), clip_c=clip_c)
    return float(loss), float(grad)


def test_policy_loss_clip_high_positive_advantage():
    # rho = e^(-1 + 1.5) = e^0.5 = 1.6487 > 1.28: min(1.6487, 1.28) * 1 = 1.28 -> loss -1.28, gradient 0.
    loss, grad = _one_token(-1.0, -1.5, 1.0)
    assert loss == pytest.approx(-1.28, rel=1e-6) and grad == 0.0


def test_policy_loss_clip_low_negative_advantage():
    # rho = e^(-1 + 0.5) = e^-0.5 = 0.6065 < 0.8: min(-0.6065, -0.8) = -0.8 -> loss +0.8, gradient 0.
    loss, grad = _one_token(-1.0, -0.5, -1.0)
    assert loss == pytest.approx(0.8, rel=1e-6) and grad == 0.0


def test_policy_loss_inside_clip_range():
    # rho = e^(-1 + 1.1) = e^0.1 = 1.10517 inside [0.8, 1.28]: loss -rho * A = -1.10517,
    # d(-e^(logp - old)) / d logp = -rho = -1.10517.
    loss, grad = _one_token(-1.0, -1.1, 1.0)
    assert loss == pytest.approx(-math.exp(0.1), rel=1e-6)
    assert grad == pytest.approx(-math.exp(0.1), rel=1e-6)


def test_policy_loss_dual_clip_caps_negative_advantage():
    # rho = e^(ln 5 - 0) = 5, A = -1: -min(-5, clip(5) * -1 = -1.28) = 5; dual clip caps it at 3 * |A| = 3.
    loss, grad = _one_token(math.log(5.0), 0.0, -1.0)
    assert loss == pytest.approx(5.0, rel=1e-5) and grad == pytest.approx(5.0, rel=1e-5)
    loss, grad = _one_token(math.log(5.0), 0.0, -1.0, clip_c=3.0)
    assert loss == pytest.approx(3.0, rel=1e-6) and grad == 0.0
    # Positive advantages are never dual-clipped: rho 5, A = +1 -> -1.28 as without clip_c.
    assert _one_token(math.log(5.0), 0.0, 1.0, clip_c=3.0)[0] == pytest.approx(-1.28, rel=1e-6)
    with pytest.raises(ValueError, match="clip_c"):
        _one_token(0.0, 0.0, 1.0, clip_c=0.5)


def test_policy_loss_token_mean_and_metrics():
    # The three tokens above in one row plus one pad holding garbage (A = +1, -1, +1 per token):
    # loss = (-1.28 + 0.8 - 1.10517) / 3 = -0.52839; one clipped low, one clipped high -> 1/3 each;
    # ratio mean = (e^0.5 + e^-0.5 + e^0.1) / 3 = 1.12013, max e^0.5 = 1.64872;
    # k3 = mean(rho - 1 - log rho) = ((0.64872 - 0.5) + (-0.39347 + 0.5) + (0.10517 - 0.1)) / 3 = 0.08679.
    logp = jnp.array([[-1.0, -1.0, -1.0, 7e3]])
    old = jnp.array([[-1.5, -0.5, -1.1, -9e3]])
    adv = jnp.array([[1.0, -1.0, 1.0, 5.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    loss, m = losses.policy_loss(logp, old, adv, mask)
    assert float(loss) == pytest.approx((-1.28 + 0.8 - math.exp(0.1)) / 3, rel=1e-6)
    assert float(m["clip_frac_low"]) == pytest.approx(1 / 3) and float(m["clip_frac_high"]) == pytest.approx(1 / 3)
    assert float(m["dual_clip_frac"]) == 0.0 and float(m["num_tokens"]) == 3.0
    ratios = np.exp([0.5, -0.5, 0.1])
    assert float(m["ratio_mean"]) == pytest.approx(ratios.mean(), rel=1e-6)
    assert float(m["ratio_max"]) == pytest.approx(ratios.max(), rel=1e-6)
    assert float(m["approx_kl"]) == pytest.approx(np.mean(ratios - 1 - np.log(ratios)), rel=1e-5)


def test_policy_loss_row_advantages_broadcast_and_num_tokens_override():
    logp = jnp.array([[-1.0, -2.0], [-0.5, -0.1]])
    old = logp - 0.05
    mask = jnp.array([[1, 1], [1, 0]])
    row, _ = losses.policy_loss(logp, old, jnp.array([0.7, -1.3]), mask)
    token, _ = losses.policy_loss(logp, old, jnp.array([[0.7, 0.7], [-1.3, 9.0]]), mask)
    assert float(row) == pytest.approx(float(token), rel=1e-7)
    # Same sum over 3 tokens, divided by 12 instead of 3.
    wide, _ = losses.policy_loss(logp, old, jnp.array([0.7, -1.3]), mask, num_tokens=12.0)
    assert float(wide) == pytest.approx(float(row) * 3 / 12, rel=1e-6)


def test_sft_loss_and_logprob_helpers():
    # NLL of tokens with log-probs -1 and -2 (a pad holds garbage): (1 + 2) / 2 = 1.5.
    assert float(losses.sft_loss(jnp.array([[-1.0, -2.0, jnp.nan]]), jnp.array([[1, 1, 0]]))) == pytest.approx(1.5)
    # logits [0, ln 3]: softmax = [1/4, 3/4]; at temperature 2, z = [0, ln(3)/2], p1 = sqrt3 / (1 + sqrt3).
    logits = jnp.array([[0.0, math.log(3.0)]])
    assert float(logprobs.token_logprobs(logits, jnp.array([1]))[0]) == pytest.approx(math.log(0.75), rel=1e-6)
    p1 = math.sqrt(3) / (1 + math.sqrt(3))
    assert float(logprobs.token_logprobs(logits, jnp.array([1]), 2.0)[0]) == pytest.approx(math.log(p1), rel=1e-6)
    # H([1/4, 3/4]) = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.56234; uniform over 4 -> ln 4.
    assert float(logprobs.token_entropy(logits)[0]) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    assert float(logprobs.token_entropy(jnp.zeros((1, 4)))[0]) == pytest.approx(math.log(4.0))
    assert logprobs.token_logprobs(logits.astype(jnp.bfloat16), jnp.array([1])).dtype == jnp.float32


# ---------------------------------------------------------------------------------- micro-batching
B, T, D, V = 4, 8, 3, 5
LENGTHS = (1, 8, 3, 5)  # uneven responses: micro-batches hold 9 and 8 tokens, or 1, 8, 3, 5


def _linear_policy_batch():
    # numpy randomness: eager jax.random ops would each compile, which costs more than the test itself.
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(B, T, D)).astype(np.float32),
        "targets": rng.integers(0, V, size=(B, T)),
        "old_logp": -rng.uniform(0.5, 2.5, size=(B, T)).astype(np.float32),
        "advantages": rng.normal(size=(B,)).astype(np.float32),
        "mask": np.arange(T)[None, :] < np.array(LENGTHS)[:, None],
    }
    return rng.normal(size=(D, V)).astype(np.float32), batch


def _linear_policy_loss(w, batch, num_tokens):
    logp = logprobs.token_logprobs(batch["x"] @ w, batch["targets"])
    return losses.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["mask"], num_tokens=num_tokens)


@pytest.mark.parametrize("num_micro_batches", [2, 4])
def test_accumulated_gradient_equals_full_batch(num_micro_batches):
    w, batch = _linear_policy_batch()
    full_loss, full_grad, full_m = jax.jit(losses.accumulate_gradients, static_argnums=(0, 3))(
        _linear_policy_loss, w, batch, 1
    )
    loss, grad, m = jax.jit(losses.accumulate_gradients, static_argnums=(0, 3))(
        _linear_policy_loss, w, batch, num_micro_batches
    )
    np.testing.assert_allclose(loss, full_loss, atol=1e-6)
    assert_close_relative(grad, full_grad, 1e-5)  # sums over 17 tokens in another order: ~5e-8 of the norm measured
    assert float(m["num_tokens"]) == sum(LENGTHS)
    for name in ("ratio_mean", "ratio_max", "clip_frac_low", "clip_frac_high", "approx_kl"):
        np.testing.assert_allclose(m[name], full_m[name], rtol=1e-5, err_msg=name)
    # A mean of per-micro-batch token-means is a different (wrong) number for these uneven lengths.
    first, second = jax.tree.map(lambda x: x[:2], batch), jax.tree.map(lambda x: x[2:], batch)
    per_mb_mean = (float(_linear_policy_loss(w, first, None)[0]) + float(_linear_policy_loss(w, second, None)[0])) / 2
    assert abs(per_mb_mean - float(full_loss)) > 1e-3


def test_accumulate_gradients_rejects_uneven_split():
    w, batch = _linear_policy_batch()
    with pytest.raises(ValueError, match="micro-batches"):
        losses.accumulate_gradients(_linear_policy_loss, w, batch, 3)


# ------------------------------------------------------------------------------------------ properties
PB, PT, PAD = 4, 6, 3
logps = hnp.arrays(np.float32, (PB, PT), elements=st.floats(-6.0, 0.0, width=32))
garbage = hnp.arrays(np.float32, (PB, PAD), elements=st.floats(-1e4, 1e4, width=32))
row_advantages = hnp.arrays(np.float32, (PB,), elements=st.floats(-3.0, 3.0, width=32))
masks = hnp.arrays(np.bool_, (PB, PT))


@jax.jit
def _loss_and_grad(logp, old, adv, mask):
    return jax.value_and_grad(lambda x: losses.policy_loss(x, old, adv, mask, clip_c=3.0)[0])(logp)


@PROPERTY
@given(logps, logps, row_advantages, masks, garbage, garbage)
def test_padding_never_changes_the_loss(logp, old, adv, mask, pad_logp, pad_old):
    loss, grad = _loss_and_grad(logp, old, adv, mask)
    padded = functools.partial(np.concatenate, axis=1)
    loss_p, grad_p = _loss_and_grad(
        padded([logp, pad_logp]), padded([old, pad_old]), adv, padded([mask, np.zeros((PB, PAD), bool)])
    )
    np.testing.assert_allclose(loss_p, loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad_p[:, :PT], grad, rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(grad_p[:, PT:]) == 0.0) and np.isfinite(loss_p)


@PROPERTY
@given(logps, logps, row_advantages, masks, st.integers(0, PB - 1))
def test_zero_advantage_rows_get_zero_gradient(logp, old, adv, mask, row):
    adv[row] = 0.0
    _, grad = _loss_and_grad(logp, old, adv, mask)
    assert np.all(np.asarray(grad[row]) == 0.0)


@PROPERTY
@given(logps, hnp.arrays(np.float32, (PB, PT), elements=st.floats(-3.0, 3.0, width=32)), masks)
def test_on_policy_loss_is_minus_mean_advantage(logp, adv, mask):
    # rho = 1 is inside the clip range, so l_t = -A_t and the loss is -mean_{mask} A.
    loss, _ = _loss_and_grad(logp, logp, adv, mask)
    expected = -adv[mask].sum() / max(mask.sum(), 1)
    np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-6)
