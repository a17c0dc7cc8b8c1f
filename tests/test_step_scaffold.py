"""One training step and the scaffold's options, end to end on a tiny random policy: what a step samples, fits,
re-rolls and splices, and what its RL update receives (corrections, splices, re-roll settings, the persistent adapter,
mini-batches and micro-batches, direct supervision of the base, dynamic sampling).

The shared setup (one set of shapes, so each program compiles once per process; a fake verifier that places the
cliffs) is described in ``run_fixtures``.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from run_fixtures import (
    FakeVerifier,
    K,
    assert_trees_equal,
    copy_tree,
    flag_adapter,
    run_steps,
    train_records,
    trees_differ,
    wrap,
)

from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run import Run
from lspo_jax.rl import logprobs, optim, packing
from lspo_jax.rl.checkpoint import checkpoint_state
from lspo_jax.rl.learner import Learner, TrainState

pytestmark = pytest.mark.slow  # whole training runs


# ------------------------------------------------------------------------------------ loop mechanics
def test_scaffold_mechanics(tmp_path, make_config, easy_rule, easy_answers):
    # One cliff per step; its re-rolls pass in slot 1 only, so re-roll 1 replaces the cliff's slot 0.
    verifier = FakeVerifier(easy_rule, lambda response, gold, slot: slot == 1)
    log = {"batch": [], "sample": [], "reset": [], "sft": [], "rl": []}
    out = str(tmp_path)
    # No overlong shaping: rewards are the accuracies, so the advantages below are exact.
    job = Run(make_config(scaffold__sft_steps=3, reward__overlong_factor=0.0), out, verifier=verifier)
    learner = job.learner
    flag_adapter(job, verifier)
    params = lambda: copy_tree(learner.state.params)
    base_out = lambda _: {"base_out": copy_tree(learner.state.params["base"])}
    sampled = lambda prompts, key, *, lora_scale, **_: {"lora_scale": lora_scale, "prompts": list(prompts),
                                                        "params": params()}  # fmt: skip
    wrap(job.prompts, "next_batch", after=lambda draw: {"ex": draw.examples}, log=log["batch"])
    wrap(learner, "sample", before=sampled, after=lambda rows: {"rows": rows}, log=log["sample"])
    state = lambda: learner.state
    fresh = lambda _: copy_tree({"lora": state().params["lora"], "sft_opt": state().opt_state.inner_states["lora"]})
    wrap(learner, "reset_adapter", after=fresh, log=log["reset"])
    sft_in = lambda batch: {"base": params()["base"], "batch": copy_tree(batch)}
    wrap(learner, "sft_step", before=sft_in, after=base_out, log=log["sft"])
    wrap(learner, "rl_step", before=lambda batch: {"params": params(), "batch": copy_tree(batch)}, after=base_out,
         log=log["rl"])  # fmt: skip
    summary = job.train()
    job.close()
    assert verifier.closed

    steps = [m for m in read_metrics(os.path.join(out, "metrics.jsonl")) if m["kind"] == "train"]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert (m["cliff_groups"], m["surpassed_groups"], m["spliced_rows"]) == (1, 1, 1)
        assert m["rescue_pass_rate"] == 0.5 and m["scaffold_no_solution"] == 0 and not m["update_skipped"]
    assert [summary[k] for k in ("cliff_groups", "surpassed_groups", "rerolls", "rerolls_passed")] == [2, 2, 4, 2]
    assert len(log["sft"]) == 2 * 3 and len(log["rl"]) == 2

    for step in range(2):
        batch = log["batch"][step]["ex"]
        (group,) = [g for g, ex in enumerate(batch) if ex.answer not in easy_answers]
        assert group == step % 2
        cliff = batch[group]
        base_sample, reroll = log["sample"][2 * step : 2 * step + 2]
        # Sampled from the base, then the cliff prompt alone re-rolled with the adapter on.
        assert base_sample["lora_scale"] == 0.0 and base_sample["prompts"] == [ex.prompt_ids for ex in batch]
        assert reroll["lora_scale"] == 1.0 and reroll["prompts"] == [cliff.prompt_ids]
        # The adapter is fitted on the cliff prompt's worked solution only: one row, the loss on the solution.
        sft_batch = log["sft"][3 * step]["batch"]
        row = sft_batch["tokens"][0]
        assert row[sft_batch["attention_mask"][0] > 0].tolist() == [*cliff.prompt_ids, *cliff.solution_ids]
        assert row[sft_batch["mask"][0] > 0].tolist() == list(cliff.solution_ids)
        assert not sft_batch["attention_mask"][1:].any()  # any further rows only pad the bucket
        # Fresh adapter: B = 0, a new A every step, an all-zero SFT optimizer state; fitted before the re-roll.
        fresh = log["reset"][step]
        assert all(not leaf["b"].any() for leaf in fresh["lora"].values())
        assert all(not x.any() for x in jax.tree.leaves(fresh["sft_opt"]))
        assert any(reroll["params"]["lora"][name]["b"].any() for name in fresh["lora"])
        if step:
            assert trees_differ(log["reset"][0]["lora"], fresh["lora"])
        # The base moves only in the RL update: unchanged through SFT and the re-roll.
        start_base = base_sample["params"]["base"]
        for sft in log["sft"][3 * step : 3 * step + 3]:
            assert_trees_equal(sft["base"], start_base)
            assert_trees_equal(sft["base_out"], start_base)
        rl = log["rl"][step]
        assert_trees_equal(reroll["params"]["base"], start_base)
        assert_trees_equal(rl["params"]["base"], start_base)
        assert trees_differ(rl["base_out"], start_base)
        check_spliced_batch(job.policy.config, rl, base_sample["rows"], reroll["rows"], spliced=group * K)


def teacher_forced(config, params, rows, lora_scale: float) -> np.ndarray:
    """The plain (one pass, whole head) log-probs of ``rows``, zero off the response mask."""
    logp, _ = logprobs.sequence_logprobs(config, params, rows["tokens"], rows["attention_mask"], lora_scale=lora_scale)
    return np.where(rows["mask"] > 0, np.asarray(logp), 0.0)


def check_spliced_batch(config, rl, base_rows, reroll_rows, spliced):
    """Row ``spliced`` (the cliff's slot 0) holds the passing re-roll (its slot 1) with adapter-on log-probs;
    every other row is the base rollout with base log-probs."""
    batch, params = rl["batch"], rl["params"]
    others = np.arange(len(batch["tokens"])) != spliced
    np.testing.assert_array_equal(batch["tokens"][spliced], reroll_rows["tokens"][1])
    np.testing.assert_array_equal(batch["tokens"][others], base_rows["tokens"][others])
    rows = {k: batch[k] for k in ("tokens", "attention_mask", "mask")}
    on, off = teacher_forced(config, params, rows, 1.0), teacher_forced(config, params, rows, 0.0)
    mask = batch["mask"][spliced] > 0
    assert np.abs(on[spliced] - off[spliced])[mask].max() > 1e-3  # the fitted adapter changes the policy
    np.testing.assert_allclose(batch["old_logp"][spliced], on[spliced], atol=1e-5)
    np.testing.assert_allclose(batch["old_logp"][others], off[others], atol=1e-5)
    # ... and they are the log-probs of the sampler that drew the re-roll.
    np.testing.assert_allclose(batch["old_logp"][spliced][mask], reroll_rows["sampler_logp"][1][mask], atol=1e-4)
    # Both groups now hold a pass then a failure: A = +-(1 - 0.5) / (std([1, 0], ddof=1) + eps) = +-0.7071.
    a = 0.5 / (np.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(batch["advantages"], [a, -a, a, -a], rtol=1e-6)


# ---------------------------------------------------------------------------------- scaffold options
def one_scaffold_step(tmp_path, make_config, easy_rule, **overrides):
    """One step (group 0 the cliff, group 1 passing in slot 0 only; re-rolls pass in slot 1), no overlong shaping:
    the sampling calls' options and rows, and the RL update's params and batch."""
    verifier = FakeVerifier(easy_rule, lambda response, gold, slot: slot == 1)
    job = Run(make_config(steps=1, reward__overlong_factor=0.0, **overrides), str(tmp_path), verifier=verifier)
    learner, samples, updates = job.learner, [], []
    flag_adapter(job, verifier)
    wrap(learner, "sample", before=lambda prompts, key, **kw: {**kw, "prompts": len(prompts)},
         after=lambda rows: {"rows": rows}, log=samples)  # fmt: skip
    before_update = lambda batch: {"params": copy_tree(learner.state.params), "batch": copy_tree(batch)}
    wrap(learner, "rl_step", before=before_update, log=updates)
    try:
        job.train()
    finally:
        job.close()
    return job.policy.config, samples, updates[0]


A = 0.5 / (np.sqrt(0.5) + 1e-6)  # a group of [pass, fail]: +-(1 - 0.5) / (std([1, 0], ddof=1) + eps)


@pytest.mark.parametrize("correction", ["none", "sequence"])
def test_corrections_of_spliced_rows(tmp_path, make_config, easy_rule, correction):
    """Re-roll 1 replaces the cliff's slot 0 (row 0), as in the default run (``check_spliced_batch``). The
    ``none`` run also sets ``loss.tis_cap: 0.5``: the JAX sampler's log-probs are the trainer's to float32
    rounding, so every token's ratio is about 1 and capped at 0.5, halving every advantage."""
    tis = {"loss__tis_cap": 0.5} if correction == "none" else {}
    config, (base, reroll), rl = one_scaffold_step(
        tmp_path, make_config, easy_rule, scaffold__correction=correction, scaffold__is_cap=1e3, **tis
    )
    batch = rl["batch"]
    np.testing.assert_array_equal(batch["tokens"][0], reroll["rows"]["tokens"][1])
    rows = {k: batch[k] for k in ("tokens", "attention_mask", "mask")}
    on, off = teacher_forced(config, rl["params"], rows, 1.0), teacher_forced(config, rl["params"], rows, 0.0)
    # Both corrections keep the base's own log-probs as every row's old_logp, the spliced row's included.
    np.testing.assert_allclose(batch["old_logp"], off, atol=1e-5)
    mask = batch["mask"] > 0
    if correction == "none":  # no row weight: the spliced row's advantage is A, as on-policy rows' are
        half = np.broadcast_to(0.5 * np.array([A, -A, A, -A])[:, None], mask.shape)
        np.testing.assert_allclose(batch["advantages"][mask], half[mask], rtol=1e-6)
        return
    # sequence: row 0's tokens carry A times w = min(prod_t pi_base / pi_adapter, 1e3), the others A alone.
    w = np.exp(np.sum((off[0] - on[0])[mask[0]]))
    assert abs(np.log(w)) > 1e-3  # the fitted adapter moved this row's probability
    adv = batch["advantages"]
    assert adv.shape == batch["tokens"].shape
    # log w sums ~12 per-token differences, each within ~1e-6 of the trainer's: 1e-4 relative on w.
    np.testing.assert_allclose(adv[0][mask[0]], A * w, rtol=1e-4)
    for row, a in zip((1, 2, 3), (-A, A, -A), strict=True):
        np.testing.assert_allclose(adv[row][mask[row]], a, rtol=1e-6)


def test_floor_correction_and_the_spliced_gradient_share(tmp_path, make_config, easy_rule):
    """``floor``: the spliced row's old_logp is min(log pi_mu, log pi_base - log f), every other row the base's;
    ``grad_share`` records the norm of the spliced row's part of the update's gradient and its share."""
    config, _, rl = one_scaffold_step(
        tmp_path, make_config, easy_rule, scaffold__correction="floor", scaffold__ratio_floor=0.5,
        scaffold__grad_share=True,
    )  # fmt: skip
    batch = rl["batch"]
    rows = {k: batch[k] for k in ("tokens", "attention_mask", "mask")}
    on, off = teacher_forced(config, rl["params"], rows, 1.0), teacher_forced(config, rl["params"], rows, 0.0)
    mask = batch["mask"] > 0
    floored = np.minimum(on[0], off[0] - np.log(0.5))
    assert np.any((on[0] > floored + 1e-3) & mask[0])  # the floor binds on some token of the spliced row
    np.testing.assert_allclose(batch["old_logp"][0][mask[0]], floored[mask[0]], atol=1e-5)
    np.testing.assert_allclose(batch["old_logp"][1:][mask[1:]], off[1:][mask[1:]], atol=1e-5)
    (record,) = [r for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if r["kind"] == "train"]
    # One of four rows: a part of the gradient, neither none of it nor (with A of both signs elsewhere) all.
    assert 0 < record["spliced_grad_share"] < 1
    assert record["spliced_grad_share"] == pytest.approx(record["spliced_grad_norm"] / record["grad_norm"])
    # By hand: the gradient of the update's loss with every row but the spliced one at A = 0, the token-mean over
    # all four rows' tokens; and the whole batch's, which the update reported. Norms of float32 gradients summed
    # over a few hundred terms of order 1e-2: 1e-4 relative holds on any x86 build.
    base = rl["params"]["base"]
    adv = np.asarray(batch["advantages"])
    only = {**batch, "advantages": np.where((np.arange(4) == 0).reshape(-1, *[1] * (adv.ndim - 1)), adv, 0.0)}
    norm = lambda b: float(optax.tree.norm(optim.rl_gradients(config, base, jax.tree.map(jnp.asarray, b))[1]))
    assert record["spliced_grad_norm"] == pytest.approx(norm(only), rel=1e-4)
    assert record["grad_norm"] == pytest.approx(norm(batch), rel=1e-4)
    assert record["spliced_token_share"] == pytest.approx(mask[0].sum() / mask.sum())
    assert record["spliced_log_ratio_q10"] <= record["spliced_log_ratio_q50"] <= record["spliced_log_ratio_q90"]


def test_reroll_scale_zero_is_the_base_rerolling_its_cliffs(tmp_path, make_config, easy_rule):
    """The compute-matched control: no adapter is fitted and each cliff's K re-rolls come from the base."""
    job = Run(make_config(steps=1, scaffold__reroll_scale=0.0), str(tmp_path), verifier=FakeVerifier(easy_rule))
    samples, sft_calls = [], []
    wrap(job.learner, "sample", before=lambda prompts, key, **kw: {"lora_scale": kw["lora_scale"]}, log=samples)
    wrap(job.learner, "sft_step", log=sft_calls)
    try:
        job.train()
    finally:
        job.close()
    (record,) = [r for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if r["kind"] == "train"]
    assert sft_calls == [] and record["sft_loss"] is None and record["time_sft"] < 0.05
    assert record["scaffold_attempted"] == 1 and record["rerolls"] == K  # one cliff (easy_rule), K base re-rolls
    assert [s["lora_scale"] for s in samples[:2]] == [0.0, 0.0]  # the rollouts, then the re-rolls


def test_group_splice_and_reroll_settings(tmp_path, make_config, easy_rule):
    """``splice: group`` with 3 re-rolls at temperature 0.7 and adapter scale 0.5: the cliff's two slots take
    re-rolls 0 and 1 in order (a failure, then the pass), whose old_logp is the adapter at 0.5 and 0.7."""
    overrides = dict(scaffold__splice="group", scaffold__reroll_n=3, scaffold__reroll_temperature=0.7,
                     scaffold__reroll_scale=0.5)  # fmt: skip
    config, (base, reroll), rl = one_scaffold_step(tmp_path, make_config, easy_rule, **overrides)
    assert (reroll["n"], reroll["temperature"], reroll["lora_scale"], reroll["prompts"]) == (3, 0.7, 0.5, 1)
    assert "temperature" not in base and base["lora_scale"] == 0.0  # the rollouts sample as before
    batch, rerolls = rl["batch"], reroll["rows"]
    assert len(rerolls["tokens"]) == 3
    np.testing.assert_array_equal(batch["tokens"][:2], rerolls["tokens"][:2])
    np.testing.assert_array_equal(batch["tokens"][2:], base["rows"]["tokens"][2:])
    rows = {k: batch[k] for k in ("tokens", "attention_mask", "mask")}
    logp, _ = logprobs.sequence_logprobs(config, rl["params"], rows["tokens"], rows["attention_mask"],
                                         lora_scale=0.5, temperature=0.7)  # fmt: skip
    mask = batch["mask"][:2] > 0
    np.testing.assert_allclose(batch["old_logp"][:2][mask], np.asarray(logp)[:2][mask], atol=1e-5)
    # ... the log-probs of the sampler that drew them, at its temperature and scale.
    np.testing.assert_allclose(batch["old_logp"][:2][mask], rerolls["sampler_logp"][:2][mask], atol=1e-4)
    np.testing.assert_allclose(batch["advantages"], [-A, A, A, -A], rtol=1e-6)  # group 0 is now [fail, pass]


def test_keep_failed_splice_with_leave_one_out_advantages(tmp_path, make_config, easy_rule):
    """``splice: keep_failed``: the cliff's failed slots 0 and 1 take its passing re-roll 1, then its failed re-roll
    0, both with adapter-on old log-probs. ``loss.advantage: loo`` with K = 2: r_i minus the other row's reward,
    so each [pass, fail] group gets [+1, -1] (std would give +-0.7071)."""
    config, (base, reroll), rl = one_scaffold_step(
        tmp_path, make_config, easy_rule, scaffold__splice="keep_failed", loss__advantage="loo"
    )
    batch, rerolls = rl["batch"], reroll["rows"]
    np.testing.assert_array_equal(batch["tokens"][:2], rerolls["tokens"][[1, 0]])
    np.testing.assert_array_equal(batch["tokens"][2:], base["rows"]["tokens"][2:])
    rows = {k: batch[k] for k in ("tokens", "attention_mask", "mask")}
    on, off = teacher_forced(config, rl["params"], rows, 1.0), teacher_forced(config, rl["params"], rows, 0.0)
    np.testing.assert_allclose(batch["old_logp"][:2], on[:2], atol=1e-5)
    np.testing.assert_allclose(batch["old_logp"][2:], off[2:], atol=1e-5)
    np.testing.assert_allclose(batch["advantages"], [1.0, -1.0, 1.0, -1.0], rtol=1e-6)


def test_cliffs_with_a_success_keep_it(tmp_path, make_config, easy_rule):
    """``cliff_max_successes: 1`` with K = 2: the passing-in-slot-0 group is a cliff too; both are re-rolled, and
    the first failed slot of each (group 0's slot 0, group 1's slot 1) takes its re-roll 1, the one that passes."""
    config, (base, reroll), rl = one_scaffold_step(tmp_path, make_config, easy_rule, scaffold__cliff_max_successes=1)
    batch, rerolls = rl["batch"], reroll["rows"]
    assert reroll["prompts"] == 2
    np.testing.assert_array_equal(batch["tokens"][[0, 3]], rerolls["tokens"][[1, 3]])
    np.testing.assert_array_equal(batch["tokens"][[1, 2]], base["rows"]["tokens"][[1, 2]])
    # Group 0 is now [pass, fail]; group 1 passes in both slots, which leaves it no signal.
    np.testing.assert_allclose(batch["advantages"], [A, -A, 0.0, 0.0], rtol=1e-6)


def test_cliff_bucket_pads_the_reroll_and_drops_the_padding(tmp_path, make_config, easy_rule):
    # min_cliff_bucket 2 with one cliff: the re-roll samples the cliff prompt twice (a fixed shape) and the
    # copy is dropped before scoring, so exactly K re-rollouts are scored and one of them (slot 1) splices.
    verifier = FakeVerifier(easy_rule, lambda response, gold, slot: slot == 1)
    scored, prompts_seen = [], []
    config = make_config(steps=1, scaffold__min_cliff_bucket=2, reward__overlong_factor=0.0)
    job = Run(config, str(tmp_path), verifier=verifier)
    flag_adapter(job, verifier)
    wrap(verifier, "score", before=lambda responses, golds: scored.append(len(responses)))
    wrap(job.learner, "sample", before=lambda prompts, key, **kwargs: prompts_seen.append(list(prompts)))
    summary = job.train()
    job.close()
    (record,) = [m for m in read_metrics(os.path.join(str(tmp_path), "metrics.jsonl")) if m["kind"] == "train"]
    assert len(prompts_seen) == 2 and len(prompts_seen[1]) == 2 and prompts_seen[1][0] == prompts_seen[1][1]
    assert scored == [2 * K, K]  # base rollouts, then the cliff's K re-rollouts without the padding copy
    assert (record["cliff_groups"], record["surpassed_groups"], record["spliced_rows"]) == (1, 1, 1)
    assert record["rescue_pass_rate"] == 0.5 and summary["rerolls"] == K


def test_a_persistent_adapter_is_kept_reset_every_n_steps_and_resumed(tmp_path, make_config, easy_rule):
    """``scaffold.adapter: persistent`` with ``reset_every: 2`` over 3 steps: reset at steps 1 and 3 only, and step 2's
    SFT starts from the adapter and SFT state step 1 left. A run stopped at step 2 and resumed ends as this one."""
    config = lambda steps: make_config(steps=steps, scaffold__adapter="persistent", scaffold__reset_every=2)
    resets, fits = [], []
    adapter = lambda learner: copy_tree({"lora": learner.state.params["lora"],
                                         "sft": learner.state.opt_state.inner_states["lora"]})  # fmt: skip

    def spy(job):
        learner = job.learner
        wrap(learner, "reset_adapter", before=lambda key: resets.append(learner.state.step))
        before, after = (lambda batch: {"in": adapter(learner)}), (lambda _: {"out": adapter(learner)})
        wrap(learner, "sft_step", before=before, after=after, log=fits)

    whole = run_steps(config(3), str(tmp_path / "whole"), easy_rule, prepare=spy)
    assert resets == [0, 2]  # state.step counts the updates done: steps 1 and 3
    sft_steps = whole.run.scaffold.sft_steps
    assert_trees_equal(fits[sft_steps]["in"], fits[sft_steps - 1]["out"])  # step 2 goes on from step 1's adapter
    assert trees_differ(fits[2 * sft_steps]["in"]["lora"], fits[2 * sft_steps - 1]["out"]["lora"])  # step 3: reset
    part = str(tmp_path / "part")
    run_steps(config(2), part, easy_rule)
    resumed = run_steps(config(3), part, easy_rule, resume=True)
    want = checkpoint_state(whole.state.params, whole.state.opt_state, adapter=True)
    assert_trees_equal(checkpoint_state(resumed.state.params, resumed.state.opt_state, adapter=True), want)
    assert resumed.state.adapter_reset_step == whole.state.adapter_reset_step == 2


# -------------------------------------------------------------------- mini-batches and micro-batches
def test_mini_batches_and_epochs(tmp_path, make_config, easy_rule):
    """``optim.mini_batches: 2, epochs: 2`` on the DAPO arm (every row on-policy): 4 updates of 2 rows, each epoch's
    two a partition of the step's 4 rows, the old log-probs those of the sampling policy every time, one step."""
    verifier = FakeVerifier(easy_rule)
    config = make_config(steps=1, reward__overlong_factor=0.0, scaffold__enabled=False, optim__mini_batches=2,
                         optim__epochs=2, seed=43)  # fmt: skip
    job = Run(config, str(tmp_path), verifier=verifier)
    updates = []
    wrap(job.learner, "rl_step", before=lambda batch, **kw: {"batch": copy_tree(batch), **kw},
         after=lambda metrics: {"metrics": metrics}, log=updates)  # fmt: skip
    try:
        summary = job.train()
    finally:
        job.close()
    assert len(updates) == 4 and [u["ends_step"] for u in updates] == [False, False, False, True]
    assert job.state.step == 1 and job.state.updates == 4 and summary["steps"] == 1
    row_of = lambda batch: [tuple(t) for t in batch["tokens"]]
    whole = sorted(row_of(updates[0]["batch"]) + row_of(updates[1]["batch"]))
    assert whole == sorted(row_of(updates[2]["batch"]) + row_of(updates[3]["batch"])) and len(whole) == 4
    for u in updates[2:]:  # the second epoch's old log-probs are the first's: the sampling policy's
        first = {r: i for i, r in enumerate(row_of(updates[0]["batch"]) + row_of(updates[1]["batch"]))}
        olds = np.concatenate([updates[0]["batch"]["old_logp"], updates[1]["batch"]["old_logp"]])
        for row, old in zip(row_of(u["batch"]), u["batch"]["old_logp"], strict=True):
            np.testing.assert_array_equal(old, olds[first[row]])
    # The first update starts at the sampling policy (ratio 1 up to rounding), so its loss is minus the token-mean
    # of the advantages over its own mini-batch's tokens (verl's convention), not over the step's.
    batch = updates[0]["batch"]
    mask = batch["mask"] > 0
    adv = np.broadcast_to(np.asarray(batch["advantages"])[:, None], mask.shape)
    np.testing.assert_allclose(updates[0]["metrics"]["loss"], -adv[mask].mean(), atol=1e-5)
    assert abs(adv[mask].mean()) > 0.3  # seed 43 shuffles one row of each group into it: +-A / 2, where the step's is 0


def test_more_micro_batches_than_rows_pads_with_masked_rows(trained_run, make_config):
    # 3 padded rows in 8 micro-batches: 5 masked rows are added, and the update equals the one of a single batch.
    # (Packed, the micro-batches are sized by tokens: 3 short rows are one micro-batch whatever loss.micro_batches.)
    job, rng = trained_run["job"], np.random.default_rng(0)
    tokens = rng.integers(4, 40, size=(3, 20)).astype(np.int32)
    mask = np.zeros_like(tokens)
    mask[:, 8:] = 1
    old_logp, advantages = np.full(tokens.shape, -3.0, np.float32), np.array([1.0, -0.5, 0.25], np.float32)
    batch = {"tokens": tokens, "attention_mask": np.ones_like(tokens), "mask": mask, "old_logp": old_logp,
             "advantages": advantages}  # fmt: skip
    results = []
    for micro_batches in (1, 8):
        config = make_config(loss__micro_batches=micro_batches, loss__packing=False)
        learner = Learner(config, job.policy, {"base": job.state.params["base"]})
        params, opt_state = learner.place(copy_tree(job.state.params), copy_tree(job.state.opt_state))
        learner.state = TrainState(step=0, params=params, opt_state=opt_state)
        metrics = learner.rl_step(dict(batch))
        results.append((learner.state.params["base"], float(metrics["loss"])))
    (one, loss_one), (eight, loss_eight) = results
    # The loss is a mean of O(0.3) terms that cancel to -0.012: rounding is relative to the terms (2e-8 measured),
    # not to the mean, and a mis-weighted micro-batch moves it by a share of the loss itself (>= 1e-3).
    assert loss_eight == pytest.approx(loss_one, abs=1e-6)
    pairs = zip(jax.tree.leaves(one), jax.tree.leaves(eight), strict=True)
    # Adam normalises each element, so where a gradient nearly cancels, float32 rounding becomes a visible share
    # of its lr-sized step (lr 1e-3; 1.8e-7 measured): 1e-5 is 1% of a step, far below a wrong update's change.
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs) < 1e-5


@pytest.mark.parametrize("packed", [True, False])
def test_the_sft_step_runs_in_micro_batches_of_the_rl_steps_size(trained_run, make_config, packed):
    # K = 2 rollouts of 8 prompts in 16 micro-batches: one RL row of 16 + 12 slots a micro-batch, so an SFT row of 64
    # slots is a micro-batch of its own. In one RL micro-batch (16 rows, 448 slots) the SFT rows fit one micro-batch
    # too, and give the same loss and gradient: the SFT token-mean is over the whole batch, as the RL step's.
    job = trained_run["job"]
    examples = [ex for ex in job.examples if ex.solution_ids is not None][:4]
    prompts, solutions = [ex.prompt_ids for ex in examples], [ex.solution_ids for ex in examples]
    batch = packing.pack_sft(prompts, solutions, *packing.sft_slots(prompts, solutions, 16, 48))
    results = {}
    for micro_batches in (1, 16):
        config = make_config(loss__micro_batches=micro_batches, loss__packing=packed, rollout__prompts_per_step=8)
        learner = Learner(config, job.policy, {"base": job.state.params["base"]})
        params, opt_state = learner.place(copy_tree(job.state.params), copy_tree(job.state.opt_state))
        learner.state = TrainState(step=0, params=params, opt_state=opt_state)
        results[micro_batches] = jax.device_get(learner.sft_step(dict(batch)))
    assert results[1]["sft_micro_batches"] == 1 and results[16]["sft_micro_batches"] > 1
    # A cross-entropy of about 4 over some 100 tokens, and its gradient norm: float32 rounding of sums in another
    # grouping (<= 1e-6 of them measured); a micro-batch weighted by its own token count would move them by >= 1%.
    for name in ("sft_loss", "sft_grad_norm", "num_tokens"):
        assert float(results[16][name]) == pytest.approx(float(results[1][name]), rel=1e-5), name


# -------------------------------------------------------------------------------- direct supervision
def test_direct_supervision_moves_the_base_by_the_sft_gradient_and_leaves_the_rl_update_as_it_was(
    tmp_path, make_config, easy_rule, model_dir
):
    """``scaffold.supervise: base``, one step, one SFT update. Checked by hand against transformers: a fresh AdamW's
    first update is ``-lr * g / (|g| + eps)`` (its bias-corrected moments are g and g^2), here with eps 1 so it is
    about -lr * g, no clipping and no weight decay, where g is the gradient of the solution tokens' mean negative
    log-likelihood under the Hugging Face model, by torch's autograd. Then the RL update gets the sampled rows
    unchanged (the same tokens, masks and advantages as a run without the scaffold), nothing spliced."""
    import torch
    from transformers import AutoModelForCausalLM

    from lspo_jax.models import hf

    # lr 0.1: the update (about lr * g, g ~ 4e-3) must stand well above the float32 rounding of the weights it is
    # read from (after - before: an ulp of a 0.03 weight is 2e-9, 5e-6 of the update here, 1e-3 at lr 1e-3).
    optim_settings = dict(optim__lr=0.1, optim__eps=1.0, optim__weight_decay=0.0, optim__max_grad_norm=None)
    seen = {}

    def capture(job):
        learner = job.learner
        before_sft = lambda batch, steps: seen.update(sft_batch=batch, before=copy_tree(learner.state.params))  # noqa: E731
        wrap(learner, "base_sft_steps", before=before_sft)
        wrap(learner, "rl_step", before=lambda batch, **kw: seen.setdefault("rl", []).append(
            (dict(batch), copy_tree(learner.state.params))))  # fmt: skip

    job = run_steps(make_config(steps=1, scaffold__supervise="base", scaffold__sft_steps=1, **optim_settings),
                    str(tmp_path / "direct"), easy_rule, prepare=capture)  # fmt: skip
    (record,) = train_records(str(tmp_path / "direct"))
    assert record["cliff_groups"] == 1 and record["spliced_rows"] == 0 and record["rerolls"] == 0
    assert record["supervised_groups"] == 1 and record["scaffold_attempted"] == 0  # no surpass rate to report
    config = job.policy.config
    # The reference gradient, from transformers on the SFT rows (padding rows left out: nothing to attend to).
    batch = {k: np.asarray(v) for k, v in seen["sft_batch"].items()}
    live = batch["attention_mask"].sum(axis=1) > 0
    tokens, attention, mask = (torch.tensor(batch[k][live]).long() for k in ("tokens", "attention_mask", "mask"))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = reference(input_ids=tokens, attention_mask=attention, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in reference.named_parameters() if p.grad is not None}
    lr = job.run.optim.lr
    before = dict(hf.to_hf_state_dict(config, seen["before"]))
    after = dict(hf.to_hf_state_dict(config, seen["rl"][0][1]))  # the base the RL update started from
    assert set(grads) <= set(after) and len(grads) > 10
    for name, g in grads.items():  # every weight of the model
        expected = -lr * g / (np.abs(g) + 1.0)
        # The float32 weights round the update to their own ulp (half of one on writing after, as much on reading
        # the difference); the two gradients differ by kernel rounding, <= 1.2e-6 of a tensor's largest entry.
        bound = 2 * np.spacing(np.maximum(np.abs(before[name]), np.abs(after[name]))) + 1e-4 * np.abs(expected).max()
        assert (np.abs(after[name] - before[name] - expected) <= bound).all(), name
    # The RL update: the rows a run without the scaffold updates on, at the supervised base.
    plain = {}
    run_steps(make_config(steps=1, scaffold__enabled=False, **optim_settings), str(tmp_path / "plain"), easy_rule,
              prepare=lambda job: wrap(job.learner, "rl_step", before=lambda batch, **kw: plain.setdefault(
                  "batch", dict(batch))))  # fmt: skip
    rl_batch = seen["rl"][0][0]
    for key in ("tokens", "mask", "advantages"):
        np.testing.assert_array_equal(np.asarray(rl_batch[key]), np.asarray(plain["batch"][key]), err_msg=key)
    # The ratio's denominator is the base that sampled the rows (the SFT runs after their log-probs), as in the
    # scaffold-off run: the same program on the same params and rows.
    np.testing.assert_array_equal(np.asarray(rl_batch["old_logp"]), np.asarray(plain["batch"]["old_logp"]))


# ---------------------------------------------------------------------------------- dynamic sampling
def sampler_counts(records) -> list[tuple]:
    keys = ("sampler/drawn", "sampler/dropped", "sampler/kept", "sampler/filled", "sampler/draw_rounds")
    return [tuple(r[key] for key in keys) for r in records]


def test_dynamic_sampling_drops_groups_without_a_signal_refills_counts_and_resumes(tmp_path, make_config, easy_rule):
    """No shuffling and no scaffold (a cliff is dropped); ``easy_rule`` passes prompts 1, 2, 5, 6 in slot 0, never
    the others. Step 1 draws 0 and 1, drops 0's cliff, then draws 2: batch (1, 2). Step 2 draws 3 and 4 (both
    dropped), then 5 and 6. Step 3 draws 7 and 0 (dropped), then 1 and 2. A run stopped after step 1 and resumed
    draws the same."""
    config = make_config(steps=3, scaffold__enabled=False, rollout__dynamic_sampling=True)
    whole = str(tmp_path / "whole")
    run_steps(config, whole, easy_rule)
    records = train_records(whole)
    assert sampler_counts(records) == [(3, 1, 2, 0, 2), (4, 2, 2, 0, 2), (4, 2, 2, 0, 2)]  # drawn, dropped, kept, ...
    assert [r["sampler/rollouts_step"] for r in records] == [3 * K, 4 * K, 4 * K]
    assert all(r["cliff_groups"] == 0 for r in records)  # no group without a signal reached an update
    part = str(tmp_path / "part")
    run_steps(dataclasses.replace(config, steps=1), part, easy_rule)
    run_steps(config, part, easy_rule, resume=True)
    assert train_records(part) == records
    # At its bound the batch is filled with a dropped group, and the record says so.
    bounded = str(tmp_path / "bounded")
    run_steps(make_config(steps=1, scaffold__enabled=False, rollout__dynamic_sampling=True,
                          rollout__max_draw_rounds=1), bounded, easy_rule)  # fmt: skip
    (record,) = train_records(bounded)
    assert sampler_counts([record]) == [(2, 1, 1, 1, 1)] and record["cliff_groups"] == 1


def test_dynamic_sampling_is_the_plain_step_when_every_group_has_a_signal(tmp_path, make_config):
    """Slot 0 of every group passes: nothing is dropped, and the first round is the plain step's own sampling (its
    key, its prompts), so the two runs' records agree on every shared key."""
    rule = lambda response, gold, slot: slot == 0  # noqa: E731
    runs = {}
    for dynamic in (False, True):
        run_steps(make_config(steps=1, rollout__dynamic_sampling=dynamic), str(tmp_path / str(dynamic)), rule)
        (runs[dynamic],) = train_records(str(tmp_path / str(dynamic)))
    assert sampler_counts([runs[True]]) == [(2, 0, 2, 0, 1)]
    assert {k: v for k, v in runs[True].items() if not k.startswith("sampler/")} == runs[False]
