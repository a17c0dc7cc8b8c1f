"""The arms that supervise the base with the worked solutions, nothing re-rolled: the mixed objective
(``scaffold.supervise: mixed``, CHORD's ``L_RL + mu * L_SFT``) on hand-computed numbers and in a step, and the SFT
warm-up (``scaffold.supervise: sft_warmup``) spending its budget, then DAPO's steps, resumed to the same records.

The training runs share ``run_fixtures``' shapes, so they reuse the programs the other loop tests compile.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import copy_tree, run_steps, train_records, trees_differ, wrap

from lspo_jax import options
from lspo_jax.job.compiles import KEYS as COMPILE_KEYS
from lspo_jax.job.config_io import load_config
from lspo_jax.job.metrics_log import read_metrics, rewrite
from lspo_jax.job.signals import StopFlag
from lspo_jax.rl import losses
from lspo_jax.rl.checkpoint import TrainState
from lspo_jax.rl.learner import SFTTerm
from lspo_jax.train_config import ConfigError

LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------- the mixed loss
def test_mixed_loss_by_hand():
    # RL: one row, A = 2, rho = [0.75 / 0.5, 0.4 / 0.5] = [1.5, 0.8] (a third token masked, garbage):
    #   token 1: min(1.5 * 2, clip(1.5, 0.8, 1.28) * 2) = min(3.0, 2.56) = 2.56; token 2: min(1.6, 1.6) = 1.6
    #   L_RL = -(2.56 + 1.6) / 2 = -2.08
    # SFT: p = [1/2, 1/4] (a third token masked, NaN): L_SFT = (ln 2 + ln 4) / 2 = 1.5 ln 2 = 1.03972
    # mu = 0.1: L = -2.08 + 0.1 * 1.03972 = -1.976028
    logp, old_logp = jnp.log(jnp.array([[0.75, 0.4, 3.0]])), jnp.log(jnp.full((1, 3), 0.5))
    mask, sft_mask = jnp.array([[1, 1, 0]]), jnp.array([[1, 1, 0]])
    sft_logp = jnp.array([[-LN2, -2 * LN2, jnp.nan]])
    loss, metrics = losses.mixed_loss(logp, old_logp, jnp.array([2.0]), mask, sft_logp, sft_mask, mu=0.1)
    assert float(loss) == pytest.approx(-2.08 + 0.1 * 1.5 * LN2, rel=1e-6)
    assert float(metrics["mix_sft_loss"]) == pytest.approx(1.5 * LN2, rel=1e-6)
    assert float(metrics["clip_frac_high"]) == pytest.approx(0.5)  # token 1's ratio is above 1.28
    # No SFT tokens: the term is 0 and the loss is the RL loss.
    empty, _ = losses.mixed_loss(logp, old_logp, jnp.array([2.0]), mask, sft_logp, jnp.zeros((1, 3)), mu=0.1)
    assert float(empty) == pytest.approx(-2.08, rel=1e-6)


@pytest.mark.parametrize("weight", ["none", "p1mp"])
def test_the_mixed_update_takes_the_gradient_of_the_mixed_loss(weight):
    """``optim.mixed_rl_step`` sums the two terms' gradients, each from its own pass (``rl_gradients``,
    ``sft_gradients``); that sum is ``jax.grad`` of ``losses.mixed_loss``, the formula, on the same rows."""
    from test_optim import CONFIG, _batch, _params

    from lspo_jax.rl import logprobs, optim

    params, mu = _params(), 0.3
    rl = {key: jnp.asarray(value) for key, value in _batch().items()}
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, size=(2, 10)).astype(np.int32)
    attention = np.arange(10)[None, :] < np.array([[10], [7]])
    sft = {"tokens": jnp.asarray(tokens), "attention_mask": jnp.asarray(attention),
           "mask": jnp.asarray(attention & (np.arange(10)[None, :] >= 3))}  # fmt: skip
    _, rl_grads, _ = optim.rl_gradients(CONFIG, params["base"], rl)
    _, sft_grads, _ = optim.sft_gradients(CONFIG, params, sft, subtree="base", token_weight=weight)
    summed = jax.tree.map(lambda g, s: g + mu * s, rl_grads, sft_grads)

    def formula(base):
        logp, _ = logprobs.sequence_logprobs(CONFIG, {"base": base}, rl["tokens"], rl["attention_mask"])
        sft_logp, _ = logprobs.sequence_logprobs(CONFIG, {"base": base}, sft["tokens"], sft["attention_mask"])
        return losses.mixed_loss(logp, rl["old_logp"], rl["advantages"], rl["mask"], sft_logp, sft["mask"], mu=mu,
                                 token_weight=weight)[0]  # fmt: skip

    want = jax.grad(formula)(params["base"])
    # The same float32 sums in another order (token-means over num_tokens against masked means): a few float32
    # roundings of each leaf's largest entry, so 1e-5 of it is a wide bound; a missing or mis-scaled term (mu, the
    # p(1-p) weight, a token count) moves the entries by orders more.
    for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(summed), jax.tree.leaves(want), strict=True):
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * scale + 1e-12, err_msg=jax.tree_util.keystr(path))


def test_p1mp_weights_the_sft_tokens_by_hand_and_detached():
    # p = [1/2, 1/4]: w = p (1 - p) = [1/4, 3/16]; L = (1/4 ln 2 + 3/16 ln 4) / 2 = ln 2 * (1/4 + 3/8) / 2 = 0.3125 ln 2
    sft_logp, sft_mask = jnp.array([[-LN2, -2 * LN2, jnp.nan]]), jnp.array([[1, 1, 0]])
    weighted = lambda x: losses.weighted_sft_loss(x, sft_mask, token_weight="p1mp")  # noqa: E731
    assert float(weighted(sft_logp)) == pytest.approx(0.3125 * LN2, rel=1e-6)
    # The weight is a constant of the gradient: dL/dlogp_t = -w_t / N = [-1/8, -3/32], 0 on the masked token.
    grad = np.asarray(jax.grad(weighted)(sft_logp))
    np.testing.assert_allclose(grad, [[-0.125, -0.09375, 0.0]], rtol=1e-6)
    # "none" is the plain token-mean NLL.
    plain = losses.weighted_sft_loss(sft_logp, sft_mask, token_weight="none")
    assert float(plain) == float(losses.sft_loss(sft_logp, sft_mask))


def test_mix_schedules_by_hand():
    cosine, constant = losses.MIX_SCHEDULES["cosine"], losses.MIX_SCHEDULES["constant"]
    # mu_t = 0.1 * (1 + cos(pi t / 4)) / 2: t = 0: 0.1; t = 1: 0.05 * (1 + sqrt(2)/2) = 0.0853553; t = 2: 0.05;
    # t = 3: 0.05 * (1 - sqrt(2)/2) = 0.0146447; t = 4 (after the last step): 0.
    expected = [0.1, 0.0853553, 0.05, 0.0146447, 0.0]
    assert [cosine(0.1, t, 4) for t in range(5)] == pytest.approx(expected, abs=1e-7)
    assert [constant(0.1, t, 4) for t in range(5)] == [0.1] * 5
    for registry in (losses.MIX_SCHEDULES, losses.SFT_TOKEN_WEIGHTS):  # one strategy per value, in order
        assert tuple(registry) == options.choices(registry.option)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["scaffold.supervise=sft_warmup"], "scaffold.warmup_tokens"),  # its budget must be given
        (["scaffold.warmup_tokens=0"], "scaffold.warmup_tokens"),
        (["scaffold.mix_mu=-0.5"], "scaffold.mix_mu"),
        (["scaffold.mix_schedule=linear"], "scaffold.mix_schedule"),
        (["scaffold.mix_token_weight=p"], "scaffold.mix_token_weight"),
        (["scaffold.supervise=mixed", "optim.epochs=2"], "scaffold.supervise"),  # its term joins the one update
        (["scaffold.supervise=mixed", "scaffold.adapter=persistent"], "scaffold.supervise"),
    ],
)
def test_bad_supervision_settings_are_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value)
    # With the scaffold off a warm-up would not run: refused (test_refusals.py), as a budget no arm reads is.
    with pytest.raises(ConfigError, match=r"^scaffold\.supervise: sft_warmup runs with the scaffold on"):
        load_config(None, ["scaffold.supervise=sft_warmup", "scaffold.warmup_tokens=9", "scaffold.enabled=false"])


# ------------------------------------------------------------------------------------- the mixed arm
def test_a_mixed_step_adds_mu_times_the_sft_loss_to_the_rl_update(tmp_path, make_config, train_rows, easy_answers):
    """Two steps: the first's batch (rows 0, 1) has one cliff, row 0; the second's (rows 2, 3) none, row 3 passing
    too. The first update is replayed from its params and batch: at mu = 0 it is the plain RL update, at the run's
    mu the SFT term moves the base."""
    passing = easy_answers | {train_rows[3]["answer"]}
    rule = lambda response, gold, slot: gold in passing and slot == 0  # noqa: E731
    seen = []

    def capture(job):
        state = lambda: job.learner.state  # noqa: E731
        wrap(job.learner, "mixed_rl_step", before=lambda batch, term: seen.append(
            (copy_tree(state().params), copy_tree(state().opt_state), dict(batch), term)))  # fmt: skip

    out = str(tmp_path / "mixed")
    job = run_steps(make_config(scaffold__supervise="mixed"), out, rule, prepare=capture)
    first, second = train_records(out)
    # Cosine over 2 steps: mu_0 = 0.1 * (1 + cos 0) / 2 = 0.1, mu_1 = 0.1 * (1 + cos(pi / 2)) / 2 = 0.05.
    assert first["scaffold/mix_mu"] == 0.1 and second["scaffold/mix_mu"] == pytest.approx(0.05)
    ((params, opt_state, batch, term),) = seen  # the step without a cliff took the plain update
    assert term.mu == 0.1 and first["scaffold/mix_sft_tokens"] == len(job.examples[0].solution_ids)
    assert int(np.sum(term.batch["mask"])) == first["scaffold/mix_sft_tokens"]
    assert (second["scaffold/mix_sft_tokens"], second["scaffold/mix_sft_loss"]) == (0, None)
    assert first["supervised_groups"] == 1 and first["spliced_rows"] == first["rerolls"] == 0
    assert "sft_loss" not in first  # no adapter, no SFT step of its own

    learner = job.learner

    def replay(update):
        placed = learner.place(copy_tree(params), copy_tree(opt_state))
        learner.state = TrainState(step=0, params=placed[0], opt_state=placed[1])
        metrics = update()
        return copy_tree(learner.state.params["base"]), metrics

    plain, plain_metrics = replay(lambda: learner.rl_step(dict(batch)))
    zero, _ = replay(lambda: learner.mixed_rl_step(dict(batch), SFTTerm(term.batch, 0.0)))
    mixed, mixed_metrics = replay(lambda: learner.mixed_rl_step(dict(batch), term))
    # mu = 0 adds 0 * grad L_SFT: the RL update, up to the rounding of another program, which AdamW's first update
    # -lr * g / (|g| + 1e-8) magnifies on the weights whose gradient is near 1e-8 (a few, by 1e-6 of lr = 1e-3).
    for a, b in zip(_leaves(plain), _leaves(zero), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    moved = max(np.abs(a - b).max() for a, b in zip(_leaves(plain), _leaves(mixed), strict=True))
    assert moved > 1e-4  # AdamW's first update is about lr = 1e-3 a weight: the term flips some of their signs
    # The update reports the RL loss as the plain one does, and L_SFT beside it, as the step's record has it.
    assert float(mixed_metrics["loss"]) == pytest.approx(float(plain_metrics["loss"]), rel=1e-5, abs=1e-7)
    assert float(mixed_metrics["mix_sft_loss"]) == pytest.approx(first["scaffold/mix_sft_loss"], rel=1e-6)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------------------------------------- the SFT warm-up
def _same(path):
    """The run's records without their times and compile counts."""
    records = read_metrics(os.path.join(path, "metrics.jsonl"))
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in COMPILE_KEYS} for r in records]


def test_sft_warmup_spends_its_budget_then_runs_dapo_and_resumes_to_the_same_records(tmp_path, make_config, easy_rule):
    budget = 60  # the toy solutions are 23-28 tokens: three of them, in two updates of two prompts and one
    config = make_config(scaffold__supervise="sft_warmup", scaffold__warmup_tokens=budget)
    seen = {"adapter": 0}

    def capture(job):
        learner = job.learner
        seen["start"] = copy_tree(learner.state.params["base"])
        count = lambda *args, **kwargs: seen.update(adapter=seen["adapter"] + 1)  # noqa: E731
        for verb in ("reset_adapter", "sft_step", "base_sft_steps"):
            wrap(learner, verb, before=count)
        first_rl = lambda batch, **kw: seen.setdefault("rl", copy_tree(learner.state.params["base"]))  # noqa: E731
        wrap(learner, "rl_step", before=first_rl)

    whole = str(tmp_path / "whole")
    job = run_steps(config, whole, easy_rule, prepare=capture)
    warm, *train = _same(whole)
    lengths = np.cumsum([len(ex.solution_ids) for ex in job.examples])  # data.shuffle false: the file's order
    n = int(np.argmax(lengths >= budget)) + 1
    assert warm["kind"] == "warmup" and warm["step"] == 0 and n == 3
    assert warm["scaffold/warmup_tokens"] == lengths[n - 1] >= budget > lengths[n - 2]
    assert (warm["scaffold/warmup_examples"], warm["scaffold/warmup_updates"], warm["updates_skipped"]) == (3, 2, 0)
    assert trees_differ(seen["start"], seen["rl"])  # the warm-up moved the base before the first RL update
    # Then DAPO: the cliffs counted, nothing fitted, re-rolled or spliced.
    assert [r["step"] for r in train] == [1, 2] and seen["adapter"] == 0
    for r in train:
        assert r["cliff_groups"] == 1 and r["scaffold_attempted"] == r["rerolls"] == r["spliced_rows"] == 0
        assert "sft_loss" not in r and "supervised_groups" not in r
    assert job.summary["warmup"]["scaffold/warmup_tokens"] == warm["scaffold/warmup_tokens"]

    # A stop asked for as the warm-up's checkpoint is written stops the run there, at step 0 (a stop during the
    # warm-up itself drops it: test_stops.py).
    part, stop = str(tmp_path / "part"), StopFlag()

    def stop_after_warmup(job):
        job.stop = stop
        wrap(job, "save", after=lambda _: setattr(stop, "requested", True))

    stopped = run_steps(config, part, easy_rule, prepare=stop_after_warmup)
    assert stopped.summary["stopped_early"] and stopped.state.step == 0
    # Killed between that checkpoint and the warm-up's record: the checkpoint's copy of the record is kept.
    path = os.path.join(part, "metrics.jsonl")
    rewrite(path, [r for r in read_metrics(path) if r["kind"] != "warmup"])
    resumed = run_steps(config, part, easy_rule, resume=True, prepare=lambda job: wrap(
        job.learner, "base_sft_updates", before=lambda batches: pytest.fail("warmed up twice")))  # fmt: skip
    assert resumed.state.step == 2 and _same(part) == _same(whole)


def test_sft_then_lspo_warms_up_then_scaffolds_every_step(tmp_path, make_config, easy_rule):
    """``warmup_tokens`` with the adapter (the ``sft_lspo`` arm): the same warm-up record as SFT then DAPO, then each
    step's cliff fitted an adapter and was re-rolled, as in plain LSPO."""
    config = make_config(scaffold__warmup_tokens=60)
    fits = []
    job = run_steps(
        config,
        str(tmp_path / "run"),
        easy_rule,
        prepare=lambda job: wrap(job.learner, "reset_adapter", before=lambda *a, **k: fits.append(1)),
    )
    warm, *train = _same(str(tmp_path / "run"))
    assert warm["kind"] == "warmup" and warm["scaffold/warmup_tokens"] >= 60 and warm["scaffold/warmup_updates"] == 2
    assert [r["step"] for r in train] == [1, 2] and len(fits) == 2  # a fresh adapter each step
    for r in train:
        assert r["cliff_groups"] == r["scaffold_attempted"] == 1 and r["rerolls"] > 0
    assert job.summary["warmup"]["scaffold/warmup_tokens"] == warm["scaffold/warmup_tokens"]
