"""Whole runs of the method options on a tiny random policy: the first-mistake option with a scripted judge and
with a real tiny one, and L2RR's unequal groups and resume, its look-ahead scoring, and a SIGTERM during its draw.

The shared setup (one set of shapes, so each program compiles once per process; a fake verifier that places the
cliffs) is described in ``run_fixtures``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal

import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import (
    FakeVerifier,
    K,
    assert_trees_equal,
    copy_tree,
    trees_differ,
    wrap,
    write_jsonl,
)

from lspo_jax.job import toy_model
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run import Run
from lspo_jax.rl import losses
from lspo_jax.rl.checkpoint import Checkpointer, checkpoint_state
from lspo_jax.tasks import toy

pytestmark = pytest.mark.slow  # whole training runs


def run_capturing_advantages(job):
    """Train ``job`` and return the advantages each RL update received."""
    seen = []
    wrap(job.learner, "rl_step", before=lambda batch: seen.append(np.asarray(batch["advantages"])))
    try:
        job.train()
    finally:
        job.close()
    return seen


# ------------------------------------------------------------------------------ first-mistake option
def test_first_mistake_run_with_a_scripted_judge(tmp_path, make_config, monkeypatch):
    """Slot 1 of each group passes, slot 0 fails; the scripted teacher names sentence 2 of each failed rollout.

    The warm-started toy model writes its ``;``-chained column sums, so sentence 1 is its first step. With
    two rollouts the outcome advantages are A = +-(1 - 0.5) / (std([0, 1]) + eps) = +-0.70711; the failed row
    gets lam * |A| = 0 on its first step's tokens and A from sentence 2 on; then the group is recentred on
    its response tokens, so the group's token advantages sum to 0 and the failed row's suffix sits exactly
    A = -0.70711 below its prefix.
    """
    from lspo_jax.job import build
    from lspo_jax.methods.first_mistake import strategy
    from lspo_jax.methods.first_mistake.teacher import Judge

    config = make_config(
        model__path=toy_model.model_dir(str(tmp_path / "cache")), reward__overlong_factor=0.0, scaffold__enabled=False,
        rollout__max_new_tokens=32,  # room for a whole worked answer: a truncated rollout is not judged
        first_mistake={"enabled": True, "reference": "ground_truth", "sentence_breaks": ";"},
    )  # fmt: skip
    prompts = []

    def judge(texts):
        prompts.extend(texts)
        return [toy.first_mistake_judge(t) if "[2] " not in t else "Step 2 is wrong. \\boxed{2}" for t in texts]

    # The test's judge goes in through the plug the method itself uses, the builder's table of methods.
    scripted = functools.partial(strategy.make_token_advantages, judge=Judge(judge))
    monkeypatch.setitem(build.ADVANTAGE_METHODS, "first_mistake", scripted)
    job = Run(config, str(tmp_path / "run"), verifier=FakeVerifier(lambda r, g, slot: slot == 1))
    seen = run_capturing_advantages(job)
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [a.shape for a in seen] == [(2 * K, 16 + 32)] * 2  # token level: [rows, prompt + response slots]
    assert len(prompts) == sum(r["fm_rollouts_judged"] for r in records) == 4  # one failed rollout per group
    assert all("Reference solution:" in p and "\n[2] " in p for p in prompts)  # split at ";" into numbered steps
    assert sum(r["fm_pitfalls"] for r in records) >= 1 and all(r["time_judge"] > 0 for r in records)
    reshaped = 0
    for advantages in seen:
        for group in advantages.reshape(-1, K, advantages.shape[1]):
            failed, passed = group[0], group[1]
            values = np.unique(failed[failed != 0])
            if len(values) != 2:
                continue  # pitfall at token 0 (judge said 1, or correct): plain GRPO, nothing to check here
            reshaped += 1
            np.testing.assert_allclose(group.sum(), 0.0, atol=1e-4)  # recentred over response tokens
            prefix = failed[np.flatnonzero(failed)[0]]
            suffix = [v for v in values if v != prefix][0]
            np.testing.assert_allclose(suffix - prefix, -0.70711, atol=1e-4)
            np.testing.assert_allclose(np.unique(passed[passed != 0]), 0.70711 + prefix, atol=1e-4)
    assert reshaped >= 1
    assert np.all(seen[0][:, :16] == 0)  # nothing on prompt slots


def test_first_mistake_with_a_real_tiny_judge_falls_back(tmp_path, make_config, monkeypatch):
    """An untrained toy-shaped Qwen2 with 2048 positions as the judge, loaded from its directory and sampled
    by the JAX sampler, of the warm-started policy: its replies are noise, and what is counted is the
    fall-back, with the plain GRPO advantages kept."""
    from lspo_jax.rollout import sampler

    judge_dir = toy_model.ensure_model(str(tmp_path / "judge"), steps=0, max_positions=2048)
    config = make_config(
        model__path=toy_model.model_dir(str(tmp_path / "cache")), rollout__max_new_tokens=32,
        first_mistake={"enabled": True, "judge_path": judge_dir, "reference": "ground_truth", "max_new_tokens": 6},
        scaffold__enabled=False, reward__overlong_factor=0.0,
    )  # fmt: skip
    sampled_prompts = []
    real_generate = sampler.generate_arrays

    def generate_arrays(config, params, prompts, **kwargs):
        if config.max_position_embeddings == 2048:  # the judge's calls
            sampled_prompts.extend(len(p) for p in prompts)
        return real_generate(config, params, prompts, **kwargs)

    monkeypatch.setattr(sampler, "generate_arrays", generate_arrays)
    job = Run(config, str(tmp_path / "run"), verifier=FakeVerifier(lambda r, g, slot: slot == 1))
    seen = run_capturing_advantages(job)
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert len(sampled_prompts) == 4 and min(sampled_prompts) > 500  # every judge prompt was really sampled
    for record, advantages in zip(records, seen, strict=True):
        fallbacks = record["fm_fallback_unparseable"] + record["fm_fallback_out_of_range"]
        assert record["fm_rollouts_judged"] == 2 and fallbacks + record["fm_judge_said_correct"] == 2
        assert record["fm_pitfalls"] == 0
        outcome = np.asarray(losses.group_advantages(jnp.asarray([0.0, 1.0] * 2), K))
        mask = advantages[:, 16:] != 0
        assert mask.any(axis=1).all()
        np.testing.assert_allclose(advantages[:, 16:], np.where(mask, outcome[:, None], 0.0), atol=1e-6)


# --------------------------------------------------------------------------------------- L2RR option
class BlockVerifier:
    """Passes the first rollout of each easy prompt; rollouts of one prompt are consecutive (a block)."""

    def __init__(self, easy):
        self.easy = easy

    def score(self, responses, golds):
        first = [i == 0 or golds[i - 1] != g for i, g in enumerate(golds)]
        return np.array([g in self.easy and f for g, f in zip(golds, first, strict=True)], np.float32)

    def close(self):
        pass


def l2rr_config(make_config, tmp_path):
    """3 steps of L2RR over the first 2 training prompts, 4 slots each, against 4 toy target examples."""
    target = write_jsonl(tmp_path / "target.jsonl", toy.target_rows(4))
    return make_config(
        rollout__group_size=4, steps=3, scaffold__sft_steps=1, data__limit=2, reward__overlong_factor=0.0,
        l2rr={"enabled": True, "target": target, "g_min": 2, "rho_min": 0.25, "p_e": 0.5, "a": 2.0},
    )  # fmt: skip


def test_l2rr_run_draws_unequal_groups_and_resumes(tmp_path, make_config, train_rows, monkeypatch):
    """Two source prompts, both drawn every step into 4 slots each: prompt 0 passes once per group, prompt 1
    never (a cliff with a worked solution, which the scaffold keeps). The budget is round(B * K * clip(mean_i
    p_e ** z_i, rho_min, 1)) with prompt 1's zero streak z = 0, 1, 2 over the steps:
    8 * mean(1, 1) = 8, then 8 * mean(1, 0.5) = 6, then 8 * mean(1, 0.25) = 5 rollouts, each prompt in [2, 4]."""
    verifier = BlockVerifier({train_rows[0]["answer"]})
    config = l2rr_config(make_config, tmp_path)
    job = Run(config, str(tmp_path / "run"), verifier=verifier)
    seen = run_capturing_advantages(job)
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["rollouts"] for r in records] == [8, 6, 5]
    assert [r["sampler/rollouts_step"] for r in records] == [8, 6, 5]
    assert records[-1]["sampler/rollouts_total"] == 19 and records[-1]["sampler/prompts_on_zero_streak"] == 1
    assert all(r["sampler/draw_rounds"] == 1 for r in records)
    for advantages, record in zip(seen, records, strict=True):
        assert advantages.shape == (2 * 4,)
        assert 0 < np.count_nonzero(advantages) <= record["rollouts"] - 2  # the cliff's rows carry nothing
    state = checkpoint_state(job.state.params, job.state.opt_state)
    meta = Checkpointer(str(tmp_path / "run" / "checkpoints")).restore(None, state)[1]
    assert meta["sampler"]["kind"] == "l2rr" and meta["sampler"]["updates"] == 3
    resumed = Run(dataclasses.replace(config, steps=4), str(tmp_path / "run"), resume=True, verifier=verifier)
    assert resumed.prompts.sampler.state_dict() == meta["sampler"]
    resumed.close()


def test_l2rr_look_ahead_scores_after_the_update(tmp_path, make_config, train_rows):
    """One L2RR step: with ``lookahead`` the prompts are scored after the update, their gradients at the base that
    sampled (a copy) and the target's at the updated one; without, both before it. The update is the same."""
    bases = {}
    for lookahead in (True, False):
        config = dataclasses.replace(l2rr_config(make_config, tmp_path), steps=1)
        config = dataclasses.replace(config, l2rr=dataclasses.replace(config.l2rr, lookahead=lookahead))
        job = Run(config, str(tmp_path / f"run_{lookahead}"), verifier=BlockVerifier({train_rows[0]["answer"]}))
        learner, calls = job.learner, []
        base = lambda learner=learner: copy_tree(learner.state.params["base"])
        wrap(learner, "rl_step", before=lambda batch, base=base, calls=calls, **kw: calls.append(("update", base())))

        def scored(params, batch, target_params=None, check=None, base=base, calls=calls):
            at = lambda p: None if p is None else copy_tree(p["base"])
            calls.append(("score", base(), at(params), at(target_params)))

        wrap(job.prompts.scorer, "scores", before=scored)
        try:
            job.train()
        finally:
            job.close()
        names = [c[0] for c in calls]
        assert names == (["update", "score"] if lookahead else ["score", "update"])
        sampled = calls[names.index("update")][1]
        _, now, params, target_params = calls[names.index("score")]
        if lookahead:
            assert_trees_equal(params, sampled)  # the prompts' gradients at the base that sampled
            assert_trees_equal(target_params, now)  # the target's at the updated base, the learner's now
            assert trees_differ(now, sampled)
        else:
            assert target_params is None  # the target's gradient at the same base
            assert_trees_equal(params, now)  # the learner's base, as it sampled: before the update
            assert_trees_equal(now, sampled)
        bases[lookahead] = copy_tree(learner.state.params["base"])
    assert_trees_equal(bases[True], bases[False])  # the scores feed the next draw only


def test_sigterm_during_an_l2rr_draw_restores_the_sampler(tmp_path, make_config, train_rows, monkeypatch):
    config = l2rr_config(make_config, tmp_path)
    saved = []

    def sigterm_in_step_2(_):  # step 2's first draw round
        if len(saved) == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    job = Run(config, str(tmp_path / "run"), verifier=BlockVerifier({train_rows[0]["answer"]}))
    wrap(job.prompts, "observe", after=lambda _: saved.append(job.prompts.sampler.state_dict()))
    wrap(job.learner, "score", after=sigterm_in_step_2)
    try:
        summary = job.train()
    finally:
        job.close()
    assert summary["stopped_early"] and summary["steps"] == 1 and len(saved) == 1
    monkeypatch.undo()
    resumed = Run(config, str(tmp_path / "run"), resume=True, verifier=BlockVerifier(set()))
    try:  # the draw's bookkeeping as step 1 left it, not as step 2's abandoned round changed it
        assert resumed.state.step == 1 and resumed.prompts.sampler.state_dict() == saved[0]
    finally:
        resumed.close()
