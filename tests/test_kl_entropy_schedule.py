"""GRPO's usual knobs, off by default: the KL penalty to a frozen reference (``loss.kl_*``), the entropy bonus
(``loss.entropy_coef``) and the learning-rate decay after the warm-up (``optim.schedule``, ``scaffold.sft.schedule``),
each against numbers worked out here or an estimate drawn here, and once in a short run."""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import run_steps, train_records

from lspo_jax.job.config import load_config
from lspo_jax.models import sharding
from lspo_jax.rl import learner, logprobs, losses, optim, train
from lspo_jax.rl.packing import Rows
from lspo_jax.train_config import ConfigError

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------- KL estimators
def test_kl_estimators_by_hand():
    # log r = ref - logp = [log 0.25 - log 0.5, log 0.5 - log 0.25] = [-ln 2, ln 2]; r = [0.5, 2].
    # k1 = -log r = [ln 2, -ln 2]                          mean 0
    # k2 = (log r)^2 / 2 = [ln2^2 / 2, ln2^2 / 2]          mean ln2^2 / 2 = 0.240227
    # k3 = r - 1 - log r = [0.5 - 1 + ln 2, 2 - 1 - ln 2] = [0.193147, 0.306853], mean 0.5 / 2 = 0.25
    logp, ref = jnp.log(jnp.array([[0.5, 0.25]])), jnp.log(jnp.array([[0.25, 0.5]]))
    mask = jnp.ones((1, 2))
    means = {name: float(losses.kl_penalty(logp, ref, mask, name)) for name in ("k1", "k2", "k3")}
    assert means == pytest.approx({"k1": 0.0, "k2": LN2**2 / 2, "k3": 0.25}, abs=1e-6)
    # The first token alone: k3 = ln 2 - 0.5 = 0.193147; over num_tokens = 4 instead, a quarter of its sum.
    first = jnp.array([[1, 0]])
    assert float(losses.kl_penalty(logp, ref, first, "k3")) == pytest.approx(LN2 - 0.5, rel=1e-6)
    assert float(losses.kl_penalty(logp, ref, mask, "k3", num_tokens=4)) == pytest.approx(0.5 / 4, rel=1e-6)
    # Per row, summed and detached, as the reward takes it: k1 of the row = ln 2 - ln 2 = 0; of token 1 alone ln 2.
    np.testing.assert_allclose(losses.sequence_kl(logp, ref, first), [LN2], rtol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_their_definitions_by_monte_carlo(estimator):
    """Tokens drawn from p, q the reference: k1 and k3 average to KL(p || q) = sum p log(p / q), k2 to
    E_p[(log q/p)^2] / 2. The tolerance is 5 standard errors of the mean, sqrt(Var_p[k] / n) with the variance
    computed exactly over the 3 categories: a correct estimator misses it with probability below 1e-6 (the draw is
    seeded anyway), and a wrong formula (k3 without its -1, k2 without the half) misses it by 20 or more."""
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])
    n = 200_000
    y = np.random.default_rng(0).choice(3, size=n, p=p)
    log_r = np.log(q) - np.log(p)  # per category
    per_category = {"k1": -log_r, "k2": log_r**2 / 2, "k3": np.exp(log_r) - 1 - log_r}[estimator]
    expected = {"k1": np.sum(p * np.log(p / q)), "k2": np.sum(p * log_r**2) / 2, "k3": np.sum(p * np.log(p / q))}
    variance = np.sum(p * per_category**2) - np.sum(p * per_category) ** 2
    mean = float(losses.kl_penalty(jnp.log(p[y])[None], jnp.log(q[y])[None], jnp.ones((1, n)), estimator))
    assert abs(mean - expected[estimator]) < 5 * math.sqrt(variance / n), (mean, expected[estimator])


def test_the_k3_term_pulls_each_token_by_one_minus_r_over_n():
    # d/dlogp (r - 1 - log r) with log r = ref - logp: -r + 1. Over N = 2 counted tokens: (1 - r) / 2, so with
    # r = [0.5, 2] the gradient is [0.25, -0.5]; the third token is masked (its reference -1e30 would overflow exp)
    # and gets exactly 0.
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.1]]))
    ref = jnp.array([[math.log(0.25), math.log(0.5), -1e30]])
    grad = jax.grad(lambda lp: losses.kl_penalty(lp, ref, jnp.array([[1, 1, 0]]), "k3"))(logp)
    np.testing.assert_allclose(grad, [[0.25, -0.5, 0.0]], rtol=1e-6)


# --------------------------------------------------------------------------------------------- the update
@pytest.fixture(scope="module")
def rl_batch(left_padded_batch, tiny_config, tiny_params):
    """An update's batch of the tiny policy (its last 5 slots the response) and its own log-probs of it."""
    tokens, attention_mask = left_padded_batch
    logp = logprobs.sequence_logprobs(tiny_config, tiny_params, tokens, attention_mask)[0]
    rng = np.random.default_rng(0)
    batch = {
        "tokens": tokens, "attention_mask": attention_mask, "mask": attention_mask * (np.arange(10) >= 5),
        "old_logp": np.asarray(logp) + rng.uniform(-0.2, 0.2, logp.shape).astype(np.float32),
        "advantages": np.array([1.0, -0.5, 0.5], np.float32),
    }  # fmt: skip
    ref_logp = (np.asarray(logp) + rng.uniform(-0.3, 0.3, logp.shape)).astype(np.float32)
    return batch, ref_logp, logp


@functools.cache
def _rl_gradients(config, spec):
    return jax.jit(functools.partial(optim.rl_gradients, config, spec=spec))


def test_kl_coef_zero_leaves_the_update_as_it_was_and_a_coef_adds_its_term(rl_batch, tiny_config, tiny_params):
    batch, ref_logp, logp = rl_batch
    base = tiny_params["base"]
    loss0, grads0, _ = _rl_gradients(tiny_config, losses.LossSpec())(base, batch)
    # Coefficient 0 with another estimator and a ref_logp in the batch: nothing of it is read, bit for bit.
    off = losses.LossSpec(kl_coef=0.0, kl_estimator=losses.kl_k1, entropy_coef=0.0)
    loss_off, grads_off, metrics_off = _rl_gradients(tiny_config, off)(base, {**batch, "ref_logp": ref_logp})
    assert np.array_equal(loss_off, loss0) and "kl_ref" not in metrics_off
    jax.tree.map(np.testing.assert_array_equal, grads_off, grads0)
    on = losses.LossSpec(kl_coef=0.1)
    loss_on, _, metrics = _rl_gradients(tiny_config, on)(base, {**batch, "ref_logp": ref_logp})
    kl = float(losses.kl_penalty(logp, ref_logp, batch["mask"], "k3"))
    assert kl > 0 and float(metrics["kl_ref"]) == pytest.approx(kl, rel=1e-5)
    assert float(loss_on) == pytest.approx(float(loss0) + 0.1 * kl, rel=1e-5)


def test_the_entropy_bonus_reaches_the_updates_gradient(rl_batch, tiny_config, tiny_params):
    """Through the model and the chunked LM head (the run in this file takes the unchunked one): the loss is the
    policy loss minus coef times the recorded token-mean entropy, and the gradient moves with it."""
    batch, base = rl_batch[0], tiny_params["base"]
    loss0, grads0, _ = _rl_gradients(tiny_config, losses.LossSpec(chunk_size=4))(base, batch)
    loss, grads, metrics = _rl_gradients(tiny_config, losses.LossSpec(chunk_size=4, entropy_coef=0.5))(base, batch)
    assert float(loss) == pytest.approx(float(loss0) - 0.5 * float(metrics["entropy"]), rel=1e-5)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0), strict=True))


def test_the_run_puts_its_kl_in_the_loss_or_in_the_reward():
    spec = losses.LossSpec.of(load_config(None, ["loss.kl_coef=0.05", "loss.kl_estimator=k2"]))
    assert (spec.kl_coef, spec.kl_estimator, spec.regularized) == (0.05, losses.kl_k2, True)
    run = load_config(None, ["loss.kl_coef=0.05", "loss.kl_in=reward"])
    assert losses.LossSpec.of(run) == losses.LossSpec()  # the update is DAPO's: the penalty is in the rewards
    # Rewards [1, 0]; k1 per token = logp - ref: row 0 [ln 2 - 0, masked] -> ln 2, row 1 [0.5, -0.25] -> 0.25.
    # reward - 0.05 * row sum = [1 - 0.034657, -0.0125]; kl_ref = (ln 2 + 0.25) / 3 tokens = 0.314382.
    rows = Rows(reward=np.array([1.0, 0.0], np.float32), mask=np.array([[1, 0], [1, 1]]))
    logp, ref = np.array([[0.0, 5.0], [-0.5, -1.0]]), np.array([[-LN2, 0.0], [-1.0, -0.75]])
    rows, record = train.kl_to_reference(types.SimpleNamespace(run=run), rows, logp, ref)
    np.testing.assert_allclose(rows["reward"], [1 - 0.05 * LN2, -0.05 * 0.25], rtol=1e-6)
    assert record == {"kl_ref": pytest.approx((LN2 + 0.25) / 3, rel=1e-6)} and "ref_logp" not in rows


# ------------------------------------------------------------------------------------------------- reference
def test_the_reference_is_a_copy_of_the_base_in_its_dtype_or_bfloat16(tiny_config, tiny_params):
    shardings = sharding.param_shardings(tiny_config, sharding.local_mesh())["base"]
    base = tiny_params["base"]
    assert learner.reference_params(load_config(None, []), tiny_config, base, shardings) is None  # no penalty
    run = load_config(None, ["loss.kl_coef=0.1"])
    reference = learner.reference_params(run, tiny_config, base, shardings)
    for ref, leaf in zip(jax.tree.leaves(reference), jax.tree.leaves(base), strict=True):
        assert ref.dtype == leaf.dtype and np.array_equal(ref, leaf)
        assert ref.unsafe_buffer_pointer() != jnp.asarray(leaf).unsafe_buffer_pointer()  # never donated with it
    bf16_config = dataclasses.replace(tiny_config, compute_dtype="bfloat16")
    bf16 = learner.reference_params(run, bf16_config, base, shardings)
    assert {leaf.dtype for leaf in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}


def test_a_reference_directory_must_hold_the_policys_architecture(hf_untied_dir, hf_tied_dir):
    from lspo_jax.models import hf

    config, params = hf.load_pretrained(hf_untied_dir)
    shardings = sharding.param_shardings(config, sharding.local_mesh())["base"]
    same = load_config(None, ["loss.kl_coef=0.1", f"loss.kl_reference={hf_untied_dir}"])
    reference = learner.reference_params(same, config, params["base"], shardings)
    jax.tree.map(np.testing.assert_array_equal, reference, params["base"])
    for path, words in ((hf_tied_dir, "is not of the policy's architecture"), ("/no/such/dir", "no such directory")):
        run = load_config(None, ["loss.kl_coef=0.1", f"loss.kl_reference={path}"])
        with pytest.raises(ConfigError, match=f"^loss.kl_reference: .*{words}"):
            learner.reference_params(run, config, params["base"], shardings)


# ---------------------------------------------------------------------------------------------- entropy bonus
def test_the_entropy_bonus_by_hand_and_its_gradient():
    # Two tokens over 3 words at temperature 2: z = logits / 2 = [0, 0, 0] (p uniform, H = ln 3 = 1.098612) and
    # [ln 2, 0, 0] (p = [1/2, 1/4, 1/4], H = ln2 / 2 + 2 ln4 / 4 = 1.5 ln 2 = 1.039721); mean H = 1.069167.
    # Ratio 1 and A = 1 on both tokens: the policy loss is -1, so with coef 0.01 the loss is -1 - 0.0106917.
    # dH/dz_v = -p_v (log p_v + H): 0 at the uniform token; at the second [-ln2 / 4, ln2 / 8, ln2 / 8]. The term
    # -coef * mean H adds -0.01 * (1/2) * dH/dz * (1/2) (dz/dlogits = 1/T) to the logits' gradient.
    logits = jnp.array([[[0.0, 0.0, 0.0], [2 * LN2, 0.0, 0.0]]])
    targets, mask, advantages = jnp.array([[0, 0]]), jnp.ones((1, 2)), jnp.ones((1,))

    def loss(logits, coef, entropy_grad):
        logp, entropy = logprobs.chunked_token_logprobs(
            logits, lambda h: h, targets, chunk_size=2, temperature=2.0, with_entropy=True, entropy_grad=entropy_grad
        )
        policy, _ = losses.policy_loss(logp, jax.lax.stop_gradient(logp), advantages, mask)
        term, _ = losses.policy_regularizers(logp, mask, entropy=entropy, entropy_coef=coef)
        return policy + term

    mean_entropy = (math.log(3.0) + 1.5 * LN2) / 2
    assert float(loss(logits, 0.0, True)) == pytest.approx(-1.0, rel=1e-6)
    assert float(loss(logits, 0.01, True)) == pytest.approx(-1.0 - 0.01 * mean_entropy, rel=1e-6)
    bonus = jax.grad(loss)(logits, 0.01, True) - jax.grad(loss)(logits, 0.0, True)
    expected = -0.01 * 0.5 * np.array([[[0.0, 0.0, 0.0], [-LN2 / 4, LN2 / 8, LN2 / 8]]]) * 0.5
    np.testing.assert_allclose(bonus, expected, atol=1e-8)
    # The metric's path (entropy_grad False, the default) stops it: the same coefficient moves nothing.
    assert np.array_equal(jax.grad(loss)(logits, 0.01, False), jax.grad(loss)(logits, 0.0, False))


# --------------------------------------------------------------------------------------------------- schedules
def test_learning_rates_after_the_warm_up_by_hand():
    # cosine, lr 1e-3, m = 0.1, D = 10, no warm-up: 1e-3 * (0.1 + 0.9 (1 + cos(pi p)) / 2) with p = t / 10:
    # t = 0 -> 1e-3, t = 5 (midway) -> 1e-3 * (0.1 + 0.45) = 5.5e-4, t = 10 -> 1e-4, held after.
    cosine = optim.AdamWConfig(lr=1e-3, schedule="cosine", min_lr_ratio=0.1, decay_steps=10)
    assert [optim.learning_rate(cosine, t) for t in (0, 5, 10, 30)] == pytest.approx([1e-3, 5.5e-4, 1e-4, 1e-4])
    # linear, lr 1e-3, m = 0.2, warm-up 2, D = 12: t = 0 -> 1e-3 * 1/2; t = 1, 2 -> 1e-3 (p = 0 at t = W);
    # t = 7 -> p = 5 / 10, 1e-3 * (1 - 0.8 * 0.5) = 6e-4; t = 12 -> lr * m = 2e-4, held after.
    linear = optim.AdamWConfig(lr=1e-3, warmup_steps=2, schedule="linear", min_lr_ratio=0.2, decay_steps=12)
    rates = [optim.learning_rate(linear, t) for t in (0, 1, 2, 7, 12, 40)]
    assert rates == pytest.approx([5e-4, 1e-3, 1e-3, 6e-4, 2e-4, 2e-4], rel=1e-6)
    with pytest.raises(ValueError, match="a cosine schedule needs decay_steps"):
        optim.learning_rate(optim.AdamWConfig(schedule="cosine"), 0)
    # A null horizon is the optimizer's lifetime, which a run's config fills in: its updates (steps x mini-batches x
    # epochs = 10 x 2 x 3), the adapter's SFT steps; a constant schedule reads none and keeps its null.
    run = load_config(None, ["steps=10", "optim.mini_batches=2", "optim.epochs=3", "optim.schedule=linear",
                             "scaffold.sft.schedule=cosine", "scaffold.sft_steps=5"])  # fmt: skip
    assert (run.optim.decay_steps, run.scaffold.sft.decay_steps) == (60, 5)
    assert load_config(None, ["optim.decay_steps=7", "optim.schedule=linear"]).optim.decay_steps == 7
    assert load_config(None, []).optim.decay_steps is None


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_optimizers_steps_are_the_recorded_learning_rate(schedule):
    # b1 = b2 = 0: m_hat = g and v_hat = g^2 exactly (no bias correction), so the update of g = 1 is
    # -lr_t / (1 + eps), eps 1e-12: the optimizer's own rate at every count, warm-up and floor included.
    config = optim.AdamWConfig(lr=1e-3, warmup_steps=3, schedule=schedule, min_lr_ratio=0.25, decay_steps=11, b1=0.0,
                               b2=0.0, eps=1e-12, weight_decay=0.0, max_grad_norm=None)  # fmt: skip
    tx = optim.adamw_transform(config)
    params = jnp.zeros(1)
    state = tx.init(params)
    for t in range(15):
        updates, state = tx.update(jnp.ones(1), state, params)
        assert -float(updates[0]) == pytest.approx(optim.learning_rate(config, t), rel=1e-6), t


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("loss.kl_estimator=k4", "loss.kl_estimator: must be one of ('k3', 'k1', 'k2'), got 'k4'"),
        ("loss.kl_in=advantage", "loss.kl_in: must be one of ('loss', 'reward'), got 'advantage'"),
        ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio: must be in [0, 1], got 1.5"),
        ("scaffold.sft.min_lr_ratio=-0.5", "scaffold.sft.min_lr_ratio: must be in [0, 1], got -0.5"),
        ("optim.schedule=step", "optim.schedule: must be one of ('constant', 'cosine', 'linear'), got 'step'"),
        ("optim.decay_steps=0", "optim.decay_steps: must be a positive int or null (the optimizer's lifetime), got 0"),
        ("loss.kl_coef=-0.1", "loss.kl_coef: must be >= 0 (0: no KL penalty), got -0.1"),
        ("loss.kl_reference=/ref", "loss.kl_reference: names the KL penalty's reference, which is off"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------------- a run
def test_a_run_with_kl_entropy_and_cosine_decay(tmp_path, make_config, easy_rule):
    """Two steps: the reference is the initial base, so the first update's KL to it is 0 (on-policy, the same
    weights) and the second's is not; the recorded rate follows the cosine over the run's 2 updates."""
    config = make_config(loss__kl_coef=0.1, loss__entropy_coef=0.01, optim__schedule="cosine")
    run_steps(config, str(tmp_path), easy_rule)
    # The null horizon is the run's 2 updates, fixed in its config.yaml; the adapter's constant rate keeps its null.
    assert (config.optim.decay_steps, config.scaffold.sft.decay_steps) == (2, None)
    assert load_config(str(tmp_path / "config.yaml")).optim.decay_steps == 2
    records = train_records(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2]
    assert abs(records[0]["kl_ref"]) < 1e-6 < records[1]["kl_ref"]
    # t = 0: lr; t = 1: p = 1 / 2, lr * (1 + cos(pi / 2)) / 2 = lr / 2.
    assert [r["lr"] for r in records] == pytest.approx([1e-3, 5e-4], rel=1e-6)
    assert all(np.isfinite(r["loss"]) and r["entropy"] > 0 and not r["update_skipped"] for r in records)


def test_a_run_with_the_kl_in_the_reward(tmp_path, make_config, easy_rule):
    """The base's and the reference's log-probs come from one pass: equal weights at step 1 give exactly 0, so the
    rewards are the verifier's; at step 2 the base has moved. The update's program is DAPO's."""
    job = run_steps(make_config(loss__kl_coef=0.1, loss__kl_in="reward"), str(tmp_path), easy_rule)
    assert job.learner.loss_keys == ("mask", "old_logp", "advantages")
    first, second = train_records(str(tmp_path))
    assert first["kl_ref"] == 0.0 and second["kl_ref"] != 0.0 and np.isfinite(second["loss"])
