"""The corrections of spliced rows against hand-computed per-token weights and gradients, and what a step records
of the rows it spliced. Each case is one token of a two-entry vocabulary, so its log-prob is
``log_softmax(z)[0]`` and the gradient of its loss on its own logit is ``-(A / N) * weight * (1 - p)``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lspo_jax.job.config_io import apply_overrides, from_dict, to_dict
from lspo_jax.rl import corrections, losses, step_record, train
from lspo_jax.train_config import TrainConfig


def run_config(*overrides: str) -> TrainConfig:
    return from_dict(TrainConfig, apply_overrides(to_dict(TrainConfig()), list(overrides)))


def logit_gradient(correction: str, p: float, q: float, advantage: float = 1.0, **options) -> float:
    """d loss / d z_y for one spliced token of base probability ``p`` and adapter-on probability ``q``, through the
    update's own path: ``corrections.importance_weights``, ``losses.weighted_advantages``, ``losses.policy_loss``."""
    run = run_config(f"scaffold.correction={correction}", *(f"scaffold.{k}={v}" for k, v in options.items()))
    base_logp, behaviour = np.array([[math.log(p)]], np.float32), np.array([[math.log(q)]], np.float32)
    rows = {"mask": np.ones((1, 1), np.float32)}
    old, weights = corrections.importance_weights(run, rows, base_logp, behaviour, np.array([True]))
    adv = jnp.array([advantage])
    if weights is not None:
        adv = losses.weighted_advantages(adv, weights, (1, 1))

    def loss(z):
        logp = jax.nn.log_softmax(z)[0]
        return losses.policy_loss(logp[None, None], jnp.asarray(old), adv, jnp.ones((1, 1)))[0]

    z = jnp.log(jnp.array([p, 1.0 - p]))  # softmax(z) = [p, 1 - p]: the base as it sampled
    return float(jax.grad(loss)(z)[0])


# float32 logits of order 1: the gradients below are products of a few numbers in [0, 1], exact to ~1e-7
# relative; rtol 1e-5 leaves room for the log/exp round trips on any x86 build.
RTOL = 1e-5


def test_token_correction_scales_by_the_base_over_the_adapter():
    # p = 0.01, q = 0.5: rho = 0.02, gradient -(1)(0.02)(0.99) = -0.0198: the vanishing push the floor lifts.
    assert logit_gradient("token", 0.01, 0.5) == pytest.approx(-0.0198, rel=RTOL)


@pytest.mark.parametrize(("p", "q", "want"), [
    (0.01, 0.5, -0.2 * 0.99),   # rho = max(0.02, 0.2) = 0.2: the floor binds
    (0.6, 0.5, -1.2 * 0.4),     # rho = max(1.2, 0.2) = 1.2 < 1 + eps_high: the paper's ratio, unclipped
    (0.3, 0.4, -0.75 * 0.7),    # rho = 0.75 above the floor
])  # fmt: skip
def test_floor_clips_the_ratio_from_below(p, q, want):
    assert logit_gradient("floor", p, q, ratio_floor=0.2) == pytest.approx(want, rel=RTOL)


def test_floor_leaves_base_rows_as_they_were():
    base = jnp.log(jnp.array([[0.2, 0.9, 0.01]]))
    np.testing.assert_allclose(corrections.floored_old_logp(base, base, 0.2), base, rtol=1e-7)
    np.testing.assert_allclose(corrections.floored_old_logp(base, base, 1.0), base, rtol=1e-7)


@pytest.mark.parametrize(("p", "want"), [
    (0.01, -(0.1 * 0.01 / 0.11**2) * 0.99),  # w = 0.001 / 0.0121 = 0.082645; gradient -0.081818
    (0.1, -(0.1 * 0.1 / 0.2**2) * 0.9),      # w = 0.25 (its maximum, at p = gamma); gradient -0.225
    (0.9, -(0.1 * 0.9 / 1.0**2) * 0.1),      # w = 0.09: a token the base already writes gets little
])  # fmt: skip
def test_shaped_gives_luffys_gradient(p, want):
    # q is irrelevant to shaping: the weight comes from the base's probability alone.
    got = logit_gradient("shaped", p, 0.5, shaping_gamma=0.1)
    assert got == pytest.approx(want, rel=RTOL)

    # The same as differentiating LUFFY's objective -A * pi / (pi + gamma) directly.
    def luffy(z):
        pi = jax.nn.softmax(z)[0]
        return -pi / (pi + 0.1)

    assert got == pytest.approx(float(jax.grad(luffy)(jnp.log(jnp.array([p, 1 - p])))[0]), rel=RTOL)


def test_shaping_weights_by_hand_and_one_off_the_mask():
    logp = jnp.log(jnp.array([[0.01, 0.1, 0.5]]))
    # gamma 0.1: 0.001 / 0.0121 = 0.0826446; 0.01 / 0.04 = 0.25; the third token masked -> 1.
    want = [[0.001 / 0.0121, 0.25, 1.0]]
    np.testing.assert_allclose(corrections.shaping_weights(logp, jnp.array([[1, 1, 0]]), 0.1), want, rtol=RTOL)


def test_shaped_weights_only_the_spliced_rows():
    run = run_config("scaffold.correction=shaped")
    base = np.log(np.full((2, 2), 0.5, np.float32))
    old, weights = corrections.importance_weights(
        run, {"mask": np.ones((2, 2))}, base, base - 1, np.array([False, True])
    )
    np.testing.assert_allclose(old, base)  # the base's own denominator on both rows
    # Row 1 spliced: 0.1 * 0.5 / 0.6^2 = 0.138889 on both tokens; row 0 untouched.
    np.testing.assert_allclose(weights, [[1.0, 1.0], [0.05 / 0.36] * 2], rtol=RTOL)


def test_shaped_weights_times_the_engines_truncated_weights():
    # loss.tis_cap 2: token weights min(exp(behaviour - sampler), 2) = [e^0.5, 2] on row 0 (its sampler_logp is
    # 0.5 and 1.0 below the behaviour's), 1 on row 1; the spliced row 1's shaping weights 0.05 / 0.36 multiply in.
    run = run_config("scaffold.correction=shaped", "loss.tis_cap=2.0")
    base = np.log(np.full((2, 2), 0.5, np.float32))
    rows = {"mask": np.ones((2, 2)), "sampler_logp": base - np.array([[0.5, 1.0], [0.0, 0.0]], np.float32)}
    _, weights = corrections.importance_weights(run, rows, base, base, np.array([False, True]))
    np.testing.assert_allclose(weights, [[math.exp(0.5), 2.0], [0.05 / 0.36] * 2], rtol=RTOL)


@pytest.mark.parametrize(("key", "value"), [("ratio_floor", 0), ("ratio_floor", 1.5), ("shaping_gamma", 0)])
def test_bad_correction_settings_name_their_key(key, value):
    with pytest.raises(ValueError, match=f"scaffold.{key}"):
        run_config(f"scaffold.{key}={value}")


def test_spliced_diagnostics_of_a_constructed_batch():
    # Rows 1 and 2 spliced. Their unmasked log ratios (base - adapter-on):
    # row 1: [-2.0, 0.0, -0.5], row 2: [-1.0] (its other tokens masked). Sorted: [-2, -1, -0.5, 0].
    # numpy's linear quantiles: q10 at position 0.3 -> -2 + 0.3 * 1 = -1.7; q50 at 1.5 -> -0.75; q90 at 2.7 ->
    # -0.5 + 0.7 * 0.5 = -0.15. Ratio mean: (e^-2 + e^0 + e^-0.5 + e^-1) / 4. Tokens: 4 of 3 + 3 + 1 + 3 = 10.
    base = np.array([[-1, -1, -1], [-3, -1, -1.5], [-2, 0, 0], [-1, -1, -1]], np.float32)
    old = np.array([[-1, -1, -1], [-1, -1, -1], [-1, 5, 5], [-1, -1, -1]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    got = step_record.spliced_diagnostics(base, old, mask, np.array([False, True, True, False]))
    want = {
        "spliced_log_ratio_q10": -1.7,
        "spliced_log_ratio_q50": -0.75,
        "spliced_log_ratio_q90": -0.15,
        "spliced_token_share": 0.4,
        "spliced_ratio_mean": (math.exp(-2) + 1 + math.exp(-0.5) + math.exp(-1)) / 4,
    }
    assert got == pytest.approx(want, rel=RTOL)
    # A step without spliced rows records the same keys, empty.
    empty = step_record.spliced_diagnostics(base, old, mask, np.zeros(4, bool))
    assert empty == dict.fromkeys(want)


def test_the_spliced_gradient_norm_keeps_only_the_spliced_rows_advantages():
    class Learner:
        def rl_grad_norm(self, batch):
            self.batch = batch
            return 1.5

    learner = Learner()
    batch = {"tokens": np.zeros((3, 2)), "advantages": np.array([[1.0, 2.0], [3.0, 4.0], [-1.0, -1.0]])}
    assert train.spliced_grad_norm(learner, batch, np.array([False, True, False])) == 1.5
    np.testing.assert_array_equal(learner.batch["advantages"], [[0, 0], [3, 4], [0, 0]])
    np.testing.assert_array_equal(batch["advantages"][0], [1, 2])  # the update's own batch is not touched


def test_guide_weights_by_hand_and_only_on_spliced_tokens():
    # Row 1 spliced, rho = pi_theta_old / pi_mu = [0.5, 1, 2, 4] on its tokens (base - behaviour = log rho).
    # gamma = the 0.9 quantile of [0.5, 1, 2, 4] by linear interpolation: position 0.9 * 3 = 2.7, 2 + 0.7 * 2 = 3.4.
    # w = gamma rho / (rho + gamma)^2: 1.7 / 3.9^2 = 0.111769, 3.4 / 4.4^2 = 0.175620, 6.8 / 5.4^2 = 0.233196,
    # 13.6 / 7.4^2 = 0.248356. Row 0 (not spliced) keeps weight 1.
    run = run_config("scaffold.correction=guide")
    base = np.log(np.full((2, 4), 0.5, np.float32))
    behaviour = base - np.log(np.array([[1, 1, 1, 1], [0.5, 1, 2, 4]], np.float32))
    old, weights = corrections.importance_weights(
        run, {"mask": np.ones((2, 4))}, base, behaviour, np.array([False, True])
    )
    np.testing.assert_allclose(old, base)  # the base's own denominator: the surrogate's ratio starts at 1
    want = [[1.0] * 4, [1.7 / 3.9**2, 3.4 / 4.4**2, 6.8 / 5.4**2, 13.6 / 7.4**2]]
    np.testing.assert_allclose(weights, want, rtol=RTOL)


def test_guide_gives_the_gradient_of_its_reshaped_ratio():
    # d/dz of rho / (rho + gamma), rho = pi(z) / mu, at fixed gamma, equals the weight times d log pi / dz.
    gamma, mu = 3.4, 0.25
    logits = jnp.log(jnp.array([0.5, 0.5]))
    direct = jax.grad(lambda z: (jax.nn.softmax(z)[0] / mu) / (jax.nn.softmax(z)[0] / mu + gamma))(logits)
    rho = 0.5 / mu
    weighted = gamma * rho / (rho + gamma) ** 2 * jax.grad(lambda z: jax.nn.log_softmax(z)[0])(logits)
    np.testing.assert_allclose(direct, weighted, rtol=RTOL)
