"""The training loop end to end on a tiny random policy: the scaffold's mechanics, exact resume, base-only
checkpoints and export, bad data rows and non-finite updates.

Every run here has the same shapes (2 prompts x 2 rollouts, 12 new tokens, 16 prompt slots), and the jitted
steps take only the config sections they read as static arguments, so the sampler, log-prob and update
programs compile once for the whole module. A fake verifier decides which rollouts pass, so each test
places the cliffs where it needs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lspo_jax import cli, compiles, evaluation, logprobs, losses, model, optim, packing, toy, toy_model, train
from lspo_jax import run as run_module
from lspo_jax.checkpoint import Checkpointer, checkpoint_state
from lspo_jax.cli import format_summary
from lspo_jax.export import export_checkpoint
from lspo_jax.learner import Generator, Learner, TrainState
from lspo_jax.metrics_log import read_metrics
from lspo_jax.run import Run, RunStopped
from lspo_jax.train_config import ConfigError, load_config

K = 2  # rollouts per prompt in every run of this module
LONG_PROBLEM = "+".join("123456789") + "="  # 18 characters and BOS: over this module's 16 prompt slots
# What a user passes to lspo-train for a new run: the paper's recipe, its paths overridden.
# The paper's lengths (1024 + 8192 tokens) are beyond the test models' 256 positions, and refused as such first.
WITHIN_256 = ("rollout.max_new_tokens=64", "eval.max_new_tokens=64", "reward.overlong_buffer=16")
PAPER_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "lspo_deepmath_r1_distill_qwen_1p5b.yaml")


def copy_tree(tree):
    """Host copies of a pytree's arrays; the update steps donate their inputs, so references would die."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, copy_tree(a), copy_tree(b))


def trees_differ(a, b) -> bool:
    return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


class FakeVerifier:
    """``rule(response, gold, slot)`` -> pass, where ``slot`` is the row's index in its group of K.

    ``reroll_rule`` scores instead while ``adapter_on`` is set (see ``flag_adapter``).
    """

    def __init__(self, rule, reroll_rule=None):
        self.rule, self.reroll_rule = rule, reroll_rule
        self.adapter_on, self.closed = False, False

    def score(self, responses, golds):
        rule = self.reroll_rule if self.adapter_on and self.reroll_rule else self.rule
        return np.array([rule(r, g, i % K) for i, (r, g) in enumerate(zip(responses, golds, strict=True))], np.float32)

    def close(self):
        self.closed = True


def wrap(obj, name, before=None, after=None, log=None):
    """Replace ``obj.name``, a method of this one object (a learner, a prompt source), by one that calls
    ``before(*args, **kwargs)`` first and ``after(result)`` then, appending their merged dicts to ``log``."""
    real = getattr(obj, name)

    def wrapped(*args, **kwargs):
        record = before(*args, **kwargs) if before else None
        result = real(*args, **kwargs)
        record = {**(record or {}), **((after(result) if after else None) or {})}
        if log is not None:
            log.append(record)
        return result

    setattr(obj, name, wrapped)


def flag_adapter(job, verifier):
    """Tell ``verifier`` whether the rollouts it scores next were sampled with the adapter on: every sampling
    call of the run (rollouts, re-rolls, validation) goes through its learner's generator."""

    def flag(*args, lora_scale=0.0, **kwargs):
        verifier.adapter_on = lora_scale > 0

    wrap(job.learner.generator, "generate", before=flag)


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return toy_model.ensure_model(str(tmp_path_factory.mktemp("policy") / "toy"), steps=0)


@pytest.fixture(scope="module")
def train_rows():
    rows = toy.addition_rows(8, (2, 2), seed=0)
    assert len({row["answer"] for row in rows}) == len(rows)  # the fake verifiers tell prompts apart by gold
    return rows


@pytest.fixture(scope="module")
def train_file(tmp_path_factory, train_rows) -> str:
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", train_rows)


@pytest.fixture(scope="module")
def easy_answers(train_rows):
    return {train_rows[i]["answer"] for i in (1, 2, 5, 6)}


@pytest.fixture(scope="module")
def easy_rule(easy_answers):
    """Batches are rows (0, 1), (2, 3), ... (no shuffling). Rows 1, 2, 5, 6 pass in slot 0, the others never,
    so every step has one cliff and one mixed group, the cliff first in odd steps and second in even ones."""
    return lambda response, gold, slot: gold in easy_answers and slot == 0


def hash_rule(response, gold, slot):
    return zlib.crc32(response.encode()) % 2 == 0


@pytest.fixture(scope="module")
def make_config(model_dir, train_file):
    """A run config with this module's shapes; keyword arguments are overrides, ``__`` for ``.``."""

    def make(**overrides):
        values = {
            "model.path": model_dir, "model.lora": {"rank": 4, "alpha": 16.0}, "data.train": train_file,
            "data.instruction_position": "none",  # column sums: the character vocabulary has no capitals
            "data.max_prompt_tokens": 16, "data.max_solution_tokens": 48, "data.shuffle": False,
            "rollout.prompts_per_step": 2, "rollout.group_size": K, "rollout.max_new_tokens": 12,
            "reward.overlong_buffer": 4, "reward.workers": 0, "optim.lr": 1e-3, "scaffold.sft_steps": 2,
            "scaffold.sft.lr": 1e-2, "eval.every": 0, "eval.n": K, "eval.ks": [1, 2], "eval.max_new_tokens": 12,
            "eval.limit": 2, "checkpoint.every": 2, "checkpoint.keep": 5, "steps": 2,
        }  # fmt: skip
        values.update({k.replace("__", "."): v for k, v in overrides.items()})
        return load_config(None, [f"{k}={json.dumps(v)}" for k, v in values.items()])

    return make


def run_steps(config, out, rule, *, resume=False, prepare=None, reroll_rule=hash_rule):
    """Train ``config`` into ``out`` (re-rolls scored by ``reroll_rule``); return the closed ``Run``.

    ``prepare(job)`` runs before training, e.g. to ``wrap`` the learner's verbs."""
    verifier = FakeVerifier(rule, reroll_rule)
    job = Run(config, out, resume=resume, verifier=verifier)
    flag_adapter(job, verifier)
    if prepare is not None:
        prepare(job)
    try:
        job.summary = job.train()
    finally:
        job.close()
    return job


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, make_config, train_file, easy_rule):
    """4 uninterrupted steps, checkpoints at 2 and 4, validation on two training prompts before and after."""
    out = str(tmp_path_factory.mktemp("trained"))
    job = run_steps(make_config(steps=4, eval__benchmarks=[train_file]), out, easy_rule)
    return {"dir": out, "job": job, "state": copy_tree(checkpoint_state(job.state.params, job.state.opt_state))}


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


# ------------------------------------------------------------------------------------ scaffold options
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


# ------------------------------------------------------------------------ resume, checkpoints, export
def test_resume_is_exact(tmp_path, make_config, train_file, easy_rule, trained_run):
    out = str(tmp_path)
    run_steps(make_config(steps=2, eval__benchmarks=[train_file]), out, easy_rule)
    config = make_config(steps=4, eval__benchmarks=[train_file])
    verifier = FakeVerifier(easy_rule, hash_rule)
    resumed = Run(config, out, resume=True, verifier=verifier)
    flag_adapter(resumed, verifier)
    assert resumed.state.step == 2 and resumed.prompts.order.state() == {"epoch": 0, "position": 4}
    resumed.train()
    resumed.close()
    assert_trees_equal(checkpoint_state(resumed.state.params, resumed.state.opt_state), trained_run["state"])

    def train_records(path):
        records = read_metrics(os.path.join(path, "metrics.jsonl"))
        return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in compiles.KEYS}
                for r in records if r["kind"] == "train"]  # fmt: skip

    records = train_records(out)
    assert records == train_records(trained_run["dir"])
    evals = [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "eval"]
    assert evals == [0, 2, 4]  # the resumed run did not validate step 2 again
    # Re-rolls scored by content: the resumed steps really sampled, scaffolded and spliced the same rows.
    assert [r["step"] for r in records] == [1, 2, 3, 4] and sum(r["spliced_rows"] for r in records[2:]) > 0


def test_validation_before_and_after(trained_run):
    evals = [r for r in read_metrics(os.path.join(trained_run["dir"], "metrics.jsonl")) if r["kind"] == "eval"]
    # One record per benchmark and validation; the benchmark is named after its file (train.jsonl).
    assert [(r["step"], r["benchmark"]) for r in evals] == [(0, "train"), (4, "train")]
    summary = trained_run["job"].summary
    assert set(summary["held_out_before"]) == set(summary["held_out_after"]) == {"train"}
    assert summary["held_out_after"]["train"] == {
        k: v for k, v in evals[1].items() if k not in ("kind", "step", "benchmark")
    }
    before = summary["held_out_before"]["train"]
    assert {"pass@1", "pass@2", "pass@1_unbiased", "pass@2_unbiased", "accuracy", "problems", "gold_logprob",
            "gold_logprob_seq", "gold_solutions", "gold_tokens", "answer_entropy"} == set(before)  # fmt: skip
    assert before["gold_solutions"] == 2 and before["gold_logprob"] < 0
    # eval.limit = 2: prompt 0 is a cliff (never passes) and prompt 1 passes in one of its two samples.
    assert before["problems"] == 2 and before["pass@2"] == 0.5 and before["accuracy"] == 0.25
    assert summary["held_out_data"]["train"]["rows"] == summary["held_out_data"]["train"]["kept"] == 2  # eval.limit
    assert "held-out train (2 problems): accuracy before 25.0%" in format_summary(summary)
    assert f"gold nats/token before {before['gold_logprob']:.3f}, after " in format_summary(summary)


def test_the_per_step_surpass_rate_distribution_by_hand():
    # Steps 1 and 4 attempted no cliff and are left out; of the 4 that did, one at 0.0 and two at 1.0.
    pairs = [(0, None), (2, 0.0), (1, 1.0), (0, None), (4, 0.5), (3, 1.0)]
    train_records = [{"scaffold_attempted": n, "surpass_rate": rate} for n, rate in pairs]
    spread = run_module.surpass_distribution(train_records)
    assert spread == {"steps": 4, "at_0": 0.25, "at_1": 0.5}
    assert run_module.surpass_distribution(train_records[:1]) is None
    summary = {"steps": 6, "seconds": 1.0, "stopped_early": False, "cliff_groups": 10, "scaffold_attempted": 10,
               "scaffold_no_solution": 0, "surpassed_groups": 5, "surpass_rate": 0.5, "rescue_pass_rate": 0.1,
               "rerolls_passed": 8, "rerolls": 80, "surpass_rate_per_step": spread}  # fmt: skip
    assert "per-step surpass rate over 4 cliff-bearing steps: 25.0% of them at 0, 50.0% at 1" in format_summary(summary)


def test_checkpoints_hold_no_adapter(trained_run):
    directory = os.path.join(trained_run["dir"], "checkpoints")
    assert sorted(int(name) for name in os.listdir(directory) if name.isdigit()) == [2, 4]
    for step in ("2", "4"):
        # Not even a name: the RL state is stored as its leaves, so no adapter placeholder is listed either.
        with open(os.path.join(directory, step, "state", "_METADATA")) as f:
            tree = json.load(f)["tree_metadata"]
        assert any("'embed'" in key for key in tree)
        stored = [key for key, entry in tree.items() if entry["value_metadata"]["value_type"] != "None"]
        assert len(stored) == len(jax.tree.leaves(trained_run["state"]))  # nothing beside base and RL state
        assert not any("lora" in key for key in tree)
        for root, _, files in os.walk(os.path.join(directory, step)):
            for name in files:
                assert "lora" not in os.path.join(root, name)
                if name != "_METADATA":
                    with open(os.path.join(root, name), "rb") as f:
                        assert b"lora" not in f.read()
    checkpointer = Checkpointer(directory)
    target = jax.tree.map(jnp.asarray, trained_run["state"])
    restored, meta = checkpointer.restore(None, target)
    assert set(restored) == {"base", "rl_opt"} and meta["step"] == 4
    assert not any("lora" in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(restored))
    assert_trees_equal(restored, target)
    with pytest.raises(ValueError, match="adapter"):
        checkpointer.save(5, {"base": restored["base"], "lora": {}}, {"step": 5})
    checkpointer.close()


def test_export_loads_in_transformers(trained_run, model_dir, tmp_path, monkeypatch, capsys):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    out = export_checkpoint(trained_run["dir"], str(tmp_path / "latest"))
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert weights and not any("lora" in name for name in weights)
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    text = toy.char_tokenizer().encode("12+34=46;7+5=12", add_special_tokens=False)
    tokens = np.array([[toy.BOS_ID, *text], [toy.BOS_ID, *text[::-1]]], np.int32)
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    policy = trained_run["job"].policy
    ours = np.asarray(model.forward(policy.config, {"base": trained_run["state"]["base"]}, jnp.asarray(tokens)))
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
    # The export is the trained base of step 4, not the initial model and not the step-2 checkpoint.
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    monkeypatch.chdir(tmp_path)  # the command line prints the absolute path of a relative OUT
    assert cli.export_main([trained_run["dir"], "step2", "--step", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"exported": str(tmp_path / "step2")}
    step2 = load_file(str(tmp_path / "step2" / "model.safetensors"))
    for other in (initial, step2):
        assert other.keys() == weights.keys()
        assert any(not np.array_equal(weights[name], other[name]) for name in weights)


# -------------------------------------------------------------------------------- bad input, non-finite
@pytest.mark.parametrize("policy", ["skip", "truncate"])
def test_bad_rows_are_counted_not_fatal(tmp_path, make_config, train_rows, policy):
    rows = [
        {"id": "long", "problem": LONG_PROBLEM, "answer": "45", "solution": "\\boxed{45}"},
        {"id": "no-solution", "problem": train_rows[0]["problem"], "answer": train_rows[0]["answer"]},
        *train_rows[1:4],
    ]
    config = make_config(data__train=write_jsonl(tmp_path / "rows.jsonl", rows), data__prompt_policy=policy, steps=1)
    # Every group a cliff; re-roll 1 of each passes, whatever was sampled.
    job = run_steps(config, str(tmp_path / "run"), lambda *_: False, reroll_rule=lambda response, gold, slot: slot == 1)
    report = job.summary["data"]
    assert (report["rows"], report["solution_missing"]) == (5, 1)
    if policy == "skip":
        assert (report["kept"], report["prompt_skipped"], report["prompt_truncated"]) == (4, 1, 0)
        assert [ex.id for ex in job.examples[:2]] == ["no-solution", "add-0-1"]
    else:
        assert (report["kept"], report["prompt_skipped"], report["prompt_truncated"]) == (5, 0, 1)
        long = job.examples[0]
        assert len(long.prompt_ids) == 16 and job.policy.tokenizer.decode(long.prompt_ids).endswith("8+9=")
    (step,) = [r for r in read_metrics(os.path.join(job.out_dir, "metrics.jsonl")) if r["kind"] == "train"]
    # Both prompts of step 1 are cliffs; the one without a worked solution is left out of the scaffold.
    assert (step["cliff_groups"], step["scaffold_no_solution"], step["rescue_pass_rate"] is not None) == (2, 1, True)
    assert job.summary["rerolls"] == K
    # The surpass rate is over the cliffs the scaffold attempted (1 of the 2, surpassed: 1 / 1, where over all
    # cliff groups it would read 1 / 2), in the step and the summary alike.
    summary = job.summary
    assert (summary["cliff_groups"], summary["scaffold_attempted"], summary["scaffold_no_solution"]) == (2, 1, 1)
    assert summary["surpass_rate"] == step["surpass_rate"] == summary["surpassed_groups"] / 1 == 1.0


def test_nonfinite_updates_are_skipped_then_stop_the_run(tmp_path, make_config, easy_rule):
    updates = []

    def spy(job):
        state = lambda: copy_tree((job.learner.state.params, job.learner.state.opt_state))

        def poison(batch):  # NaN advantages on steps 1, 3, 4; finite on step 2
            if len(updates) != 1:
                batch["advantages"] = np.full_like(batch["advantages"], np.nan)
            return {"before": state()}

        wrap(job.learner, "rl_step", before=poison, after=lambda _: {"after": state()}, log=updates)

    config = make_config(steps=6, max_nonfinite_in_row=2, checkpoint__every=10)
    out = str(tmp_path)
    with pytest.raises(RunStopped, match="2 non-finite updates in a row at step 4"):
        run_steps(config, out, easy_rule, prepare=spy)
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "train"]
    assert [(r["update_skipped"], r["nonfinite_total"], r["loss"] is None) for r in records] == [
        (True, 1, True), (False, 1, False), (True, 2, True), (True, 3, True),
    ]  # fmt: skip
    for step, update in enumerate(updates, 1):
        before, after = update["before"], update["after"]
        if step == 2:
            assert trees_differ(before[0]["base"], after[0]["base"])
        else:  # params and both optimizer states exactly as they came in
            assert_trees_equal(before, after)
    # The stop wrote a checkpoint of step 4 holding the base of step 2's update; resuming keeps the counts.
    resumed = Run(config, out, resume=True, verifier=FakeVerifier(easy_rule))
    try:
        assert (resumed.state.step, resumed.state.nonfinite_in_row, resumed.state.nonfinite_total) == (4, 2, 3)
        assert_trees_equal(resumed.state.params["base"], updates[1]["after"][0]["base"])
    finally:
        resumed.close()


def test_sigterm_checkpoints_and_exits_with_the_resumable_status(tmp_path, make_config, easy_rule, monkeypatch,
                                                                  capsys):  # fmt: skip
    real_step = train.train_step

    def step_then_sigterm(*args, **kwargs):  # a scheduler's SIGTERM arriving during step 1
        metrics = real_step(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    monkeypatch.setattr(run_module, "train_step", step_then_sigterm)
    config = write_config(tmp_path / "c.yaml", make_config(steps=5, checkpoint__every=10))
    with cli_verifier(monkeypatch, easy_rule):
        assert cli.train_main(["--config", config, "--out", str(tmp_path / "r")]) == cli.EXIT_STOPPED == 75
    assert "stopped at step 1 with a checkpoint; --resume continues it" in capsys.readouterr().err
    with open(tmp_path / "r" / "summary.json") as f:
        summary = json.load(f)
    assert summary["stopped_early"] and summary["steps"] == 1
    checkpointer = Checkpointer(str(tmp_path / "r" / "checkpoints"))
    assert checkpointer.latest_step() == 1  # written although checkpoint.every is 10
    checkpointer.close()


def test_sigterm_mid_step_abandons_it_and_resumes_where_it_left(tmp_path, make_config, easy_rule):
    steps, scored, finished = [], [], []

    def sigterm_at_step_2s_rerolls(_):
        scored.append(len(steps))
        if scored.count(2) == 2:  # step 2's re-rolls: its adapter SFT has run, donating the params
            os.kill(os.getpid(), signal.SIGTERM)

    def prepare(job):
        learner = job.learner
        wrap(job.prompts, "next_batch", before=lambda *args: steps.append(learner.state.step))
        wrap(learner, "score", after=sigterm_at_step_2s_rerolls)
        after = lambda _: finished.append(copy_tree(checkpoint_state(learner.state.params, learner.state.opt_state)))
        wrap(learner, "rl_step", after=after)

    config = make_config(steps=5, checkpoint__every=10)
    job = run_steps(config, str(tmp_path), easy_rule, prepare=prepare)
    assert job.summary["stopped_early"] and job.summary["steps"] == 1 and len(finished) == 1
    assert job.checkpointer.latest_step() == 1
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if r["kind"] == "train"] == [1]
    resumed = Run(config, str(tmp_path), resume=True, verifier=FakeVerifier(easy_rule))
    try:  # step 1's base and RL state, and the order after its 2 prompts: step 2 draws the same prompts again
        assert resumed.state.step == 1 and resumed.prompts.order.state() == {"epoch": 0, "position": 2}
        assert_trees_equal(checkpoint_state(resumed.state.params, resumed.state.opt_state), finished[0])
    finally:
        resumed.close()


def test_a_verifier_of_several_processes_gives_process_0s_scores(monkeypatch):
    sent = []

    def broadcast(x):  # the collective: every process gets process 0's array
        sent.append(np.asarray(x).tolist())
        return np.array([1.0, 0.0, 1.0], np.float32)

    monkeypatch.setattr(run_module.multihost_utils, "broadcast_one_to_all", broadcast)
    local = FakeVerifier(lambda response, gold, slot: False)
    agreed = run_module.AgreedVerifier(local)
    assert agreed.score(["a", "b", "c"], ["1", "2", "3"]).tolist() == [1.0, 0.0, 1.0]
    assert sent == [[0.0, 0.0, 0.0]] and agreed.score([], []).tolist() == [] and len(sent) == 1
    agreed.close()  # the rest of the verifier's interface is the wrapped one's
    assert local.closed


@pytest.mark.parametrize("flags, expected", [([0, 0], False), ([0, 1], True)])
def test_a_stop_is_agreed_by_every_process(monkeypatch, flags, expected):
    gathered = []

    def allgather(x):  # this process (not asked to stop) and one other, as the collective returns them
        gathered.append(int(x))
        return np.asarray(flags, np.int32)

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(train.multihost_utils, "process_allgather", allgather)
    assert train.StopFlag().agreed() is expected and gathered == [0]


def test_train_records_hold_the_documented_keys(trained_run):
    keys = {"step", "accuracy_mean", "reward_mean", "cliff_groups", "surpassed_groups", "spliced_rows",
            "rescue_pass_rate", "spliced_ratio_mean", "spliced_log_ratio_q50", "spliced_token_share",
            "clip_frac_low", "clip_frac_high", "entropy",
            "response_len_mean", "overlong_frac", "time_sample", "time_reward", "time_sft", "time_reroll",
            "time_logprob", "time_update", "lr", "loss", "grad_norm", "rerolls", "rerolls_passed",
            "scaffold_attempted"}  # fmt: skip
    records = read_metrics(os.path.join(trained_run["dir"], "metrics.jsonl"))
    train_records = [r for r in records if r["kind"] == "train"]
    assert len(train_records) == 4
    for record in train_records:
        assert keys <= set(record), keys - set(record)
        assert all(record[f"time_{p}"] >= 0 for p in ("sample", "reward", "sft", "reroll", "logprob", "update"))
        assert record["lr"] == pytest.approx(1e-3, rel=1e-6)  # make_config's optim.lr, no warm-up
        # One cliff a step with a worked solution, re-rolled K times (see easy_rule).
        assert record["scaffold_attempted"] == 1 and record["rerolls"] == K


def test_a_finished_run_is_not_overwritten_without_resume(trained_run, make_config, easy_rule):
    with pytest.raises(FileExistsError, match="already holds a run .* pass --resume"):
        Run(make_config(steps=4), trained_run["dir"], verifier=FakeVerifier(easy_rule))


def test_refusals_leave_the_runs_config_as_it_was(trained_run, make_config, easy_rule):
    path = os.path.join(trained_run["dir"], "config.yaml")
    with open(path) as f:
        before = f.read()
    with pytest.raises(FileExistsError):
        Run(make_config(steps=4, seed=7), trained_run["dir"], verifier=FakeVerifier(easy_rule))
    # Another model would not fit the checkpoint: refused with the key named, before anything is loaded.
    with pytest.raises(ConfigError, match=r"model\.path '/no/such/model' is not the run's"):
        Run(make_config(model__path="/no/such/model"), trained_run["dir"], resume=True, verifier=None)
    with open(path) as f:
        assert f.read() == before


def test_resume_without_config_takes_the_runs_own(trained_run, monkeypatch):
    seen = []
    record = lambda config, out, resume, **_: seen.append((config, resume)) or {}  # noqa: E731
    monkeypatch.setattr(run_module, "train_run", record)
    monkeypatch.setattr(cli, "format_summary", lambda summary: "")
    monkeypatch.setattr(cli, "_plot", lambda out: None)
    assert cli.train_main(["--out", trained_run["dir"], "--resume", "steps=6"]) == 0
    ((config, resume),) = seen
    saved = load_config(os.path.join(trained_run["dir"], "config.yaml"))
    assert resume and config == dataclasses.replace(saved, steps=6) and saved.steps == 4


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


def test_an_unusable_data_file_is_one_line_and_leaves_no_run(model_dir, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "problem": "1+1="}, {"id": "b", "problem": "2+2="}])
    out = tmp_path / "run"
    argv = ["--config", PAPER_CONFIG, "--out", str(out), f"model.path={model_dir}", f"data.train={bad}",
            "data.max_prompt_tokens=64", *WITHIN_256]  # fmt: skip
    assert cli.train_main(argv) == 2
    err = capsys.readouterr().err
    assert "none of its 2 rows is usable" in err and "line 1 (id a): missing answer" in err and "Traceback" not in err
    assert not (out / "config.yaml").exists()


def test_an_l2rr_target_without_a_usable_example_is_one_line(model_dir, train_file, tmp_path, capsys):
    row = {"id": "t", "problem": LONG_PROBLEM, "answer": "45", "solution": "\\boxed{45}"}
    target = write_jsonl(tmp_path / "target.jsonl", [row, {**row, "id": "u"}])
    argv = ["--config", PAPER_CONFIG, "--out", str(tmp_path / "run"), f"model.path={model_dir}",
            f"data.train={train_file}", "eval.benchmarks=[]",
            "data.instruction_position=none", "data.max_prompt_tokens=16", "l2rr.enabled=true",
            f"l2rr.target={target}", *WITHIN_256]  # fmt: skip
    assert cli.train_main(argv) == 2  # the paper's 32 prompts a step from a file of 8
    assert f"prompts a step, but data.train {train_file} has 8 usable ones" in capsys.readouterr().err
    assert cli.train_main([*argv, "rollout.prompts_per_step=2"]) == 2
    err = capsys.readouterr().err
    assert f"l2rr.target {target}: no example with a worked solution; 0 of 2 rows kept" in err
    assert "'prompt_skipped': 2" in err and "Traceback" not in err


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


# ------------------------------------------------------------------------------------ first-mistake option
def run_capturing_advantages(job):
    """Train ``job`` and return the advantages each RL update received."""
    seen = []
    wrap(job.learner, "rl_step", before=lambda batch: seen.append(np.asarray(batch["advantages"])))
    try:
        job.train()
    finally:
        job.close()
    return seen


def test_first_mistake_run_with_a_scripted_judge(tmp_path, make_config, monkeypatch):
    """Slot 1 of each group passes, slot 0 fails; the scripted teacher names sentence 2 of each failed rollout.

    The warm-started toy model writes its ``;``-chained column sums, so sentence 1 is its first step. With
    two rollouts the outcome advantages are A = +-(1 - 0.5) / (std([0, 1]) + eps) = +-0.70711; the failed row
    gets lam * |A| = 0 on its first step's tokens and A from sentence 2 on; then the group is recentred on
    its response tokens, so the group's token advantages sum to 0 and the failed row's suffix sits exactly
    A = -0.70711 below its prefix.
    """
    from lspo_jax.teacher import Judge

    config = make_config(
        model__path=toy_model.model_dir(str(tmp_path / "cache")), reward__overlong_factor=0.0, scaffold__enabled=False,
        rollout__max_new_tokens=32,  # room for a whole worked answer: a truncated rollout is not judged
        first_mistake={"enabled": True, "reference": "ground_truth", "sentence_breaks": ";"},
    )  # fmt: skip
    prompts = []

    def judge(texts):
        prompts.extend(texts)
        return [toy.first_mistake_judge(t) if "[2] " not in t else "Step 2 is wrong. \\boxed{2}" for t in texts]

    job = Run(config, str(tmp_path / "run"), verifier=FakeVerifier(lambda r, g, slot: slot == 1), judge=Judge(judge))
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
    from lspo_jax import sampler

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


# ------------------------------------------------------------------------------------------ L2RR option
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


# ------------------------------------------------------------------------------------ direct supervision
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

    from lspo_jax import hf

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


# ------------------------------------------------------------------------------------ dynamic sampling
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

        def scored(params, batch, target_params=None, base=base, calls=calls):
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


# ------------------------------------------------------------ failure paths through the console entry points
def one_line(capsys, prog: str) -> str:
    """stderr of a refused command: no traceback, and the refusal on a line of its own naming the command."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and any(line.startswith(f"{prog}: ") for line in err.splitlines()), err
    return err


def too_long_rows(n: int) -> list[dict]:
    """``n`` benchmark rows ``p0, p1, ...`` whose prompt is over this module's prompt slots."""
    return [{"id": f"p{i}", "problem": LONG_PROBLEM, "answer": "45", "solution": "\\boxed{45}"} for i in range(n)]


def copy_run(run_dir: str, dest) -> str:
    return str(shutil.copytree(run_dir, dest))


def damage_newest_checkpoint(run_dir: str) -> int:
    """Cut the largest file of the newest checkpoint to 100 bytes (a disk error, a copy cut short)."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    newest = max(int(name) for name in os.listdir(checkpoints) if name.isdigit())
    files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(checkpoints, str(newest))) for f in names]
    os.truncate(max(files, key=os.path.getsize), 100)
    return newest


def write_config(path, config) -> str:
    import yaml

    from lspo_jax.train_config import to_dict

    with open(path, "w") as f:
        yaml.safe_dump(to_dict(config), f)
    return str(path)


@contextlib.contextmanager
def cli_verifier(monkeypatch, rule):
    """lspo-train's verifier replaced by this module's fake one (re-rolls scored by ``hash_rule``); the run is
    built inside the command, so its generators are told the adapter's state through their class."""
    verifier, real = FakeVerifier(rule, hash_rule), Generator.generate

    def generate(self, *args, lora_scale=0.0, **kwargs):
        verifier.adapter_on = lora_scale == 1.0
        return real(self, *args, lora_scale=lora_scale, **kwargs)

    monkeypatch.setattr(Generator, "generate", generate)
    monkeypatch.setattr(run_module, "make_verifier", lambda run: verifier)
    yield verifier


def train_records(path):
    records = read_metrics(os.path.join(path, "metrics.jsonl"))
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in compiles.KEYS}
            for r in records if r["kind"] == "train"]  # fmt: skip


def eval_steps(path):
    return [r["step"] for r in read_metrics(os.path.join(path, "metrics.jsonl")) if r["kind"] == "eval"]


def test_a_new_run_needs_a_config_and_a_resume_needs_a_run(tmp_path, capsys):
    # The built-in defaults are the paper's shape (32 x 16 x 8192 tokens): refused rather than run out of memory.
    assert cli.train_main(["--out", str(tmp_path / "new"), "steps=1"]) == 2
    assert "--config: a new run needs a config file" in one_line(capsys, "lspo-train")
    assert cli.train_main(["--out", str(tmp_path / "none"), "--resume"]) == 2
    assert f"nothing to resume in {tmp_path / 'none'}" in one_line(capsys, "lspo-train")
    assert cli.train_main(["--config", PAPER_CONFIG, "--out", str(tmp_path), "--resume"]) == 2
    assert "nothing to resume" in one_line(capsys, "lspo-train")
    assert not os.listdir(tmp_path)  # nothing written by any of them


def test_print_config_shows_what_would_run(trained_run, capsys):
    import yaml

    assert cli.train_main(["--out", trained_run["dir"], "--resume", "--print-config", "steps=9"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    saved = load_config(os.path.join(trained_run["dir"], "config.yaml"))
    assert printed["steps"] == 9 and printed["model"]["path"] == saved.model.path
    assert cli.train_main(["--config", PAPER_CONFIG, "--out", "unused", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["rollout"]["group_size"] == 16 and printed["log"]["wandb"] is False  # with the defaults
    assert not os.path.exists("unused")
    # A new run's config prints without --out; training or resuming without one is refused in one line.
    assert cli.train_main(["--config", PAPER_CONFIG, "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == printed
    for argv in (["--config", PAPER_CONFIG], ["--resume", "--print-config"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.train_main(argv)
        assert exit_info.value.code == 2 and "--out is required" in capsys.readouterr().err


def test_a_damaged_checkpoint_is_named_and_resume_falls_back(trained_run, tmp_path, capsys, monkeypatch, easy_rule):
    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    assert damage_newest_checkpoint(run_dir) == 4
    assert cli.export_main([run_dir, str(tmp_path / "hf")]) == 2
    err = one_line(capsys, "lspo-export")
    assert "checkpoint step 4 in" in err and "is unreadable" in err and "readable steps: 2 (pass --step)" in err
    assert cli.eval_main(["--model", run_dir, "--limit", "1"]) == 2
    assert "readable steps: 2" in one_line(capsys, "lspo-eval")
    # --resume takes step 2, says so, sets step 4 aside and trains steps 3 and 4 again.
    with cli_verifier(monkeypatch, easy_rule):
        assert cli.train_main(["--out", run_dir, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint step 4" in err and "resuming from step 2, the newest readable checkpoint" in err
    assert os.listdir(os.path.join(run_dir, "checkpoints.unreadable")) == ["4"]
    assert train_records(run_dir) == train_records(trained_run["dir"])  # as if it had never stopped
    assert eval_steps(run_dir) == [0, 4]


def test_export_refuses_bad_paths_in_one_line(trained_run, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    cases = {
        (trained_run["dir"], str(tmp_path / "file")): ("exists and is not a directory",),
        (str(tmp_path), str(tmp_path / "out")): ("is not a training run",),
        (trained_run["dir"], str(tmp_path / "out"), "--step", "99"): ("no checkpoint at step 99 in", "its steps: 2, 4"),
    }
    for argv, messages in cases.items():
        assert cli.export_main(list(argv)) == 2
        err = one_line(capsys, "lspo-export")
        assert all(message in err for message in messages), err
    assert not (tmp_path / "out").exists()


def test_eval_refuses_an_unwritable_out_and_an_empty_benchmark_before_any_work(trained_run, tmp_path, capsys,
                                                                               monkeypatch):  # fmt: skip
    def no_sampling(*args, **kwargs):
        raise AssertionError("evaluation started")

    monkeypatch.setattr(evaluation, "graded_samples", no_sampling)
    base = ["--model", trained_run["dir"], "--limit", "1"]
    assert cli.eval_main([*base, "--out", str(tmp_path)]) == 2
    assert "is a directory" in one_line(capsys, "lspo-eval")
    assert cli.eval_main([*base, "--out", str(tmp_path / "no" / "such" / "r.json")]) == 2
    assert "no directory" in one_line(capsys, "lspo-eval")
    too_long = write_jsonl(tmp_path / "long.jsonl", too_long_rows(2))
    assert cli.eval_main([*base, "--benchmarks", too_long]) == 2
    assert "long: no problem is left to evaluate (rows read: 1)" in one_line(capsys, "lspo-eval")  # --limit 1
    assert cli.eval_main([*base, "--ks", "1,a"]) == 2
    assert "config error: --ks 1,a: not a comma-separated list of integers" in one_line(capsys, "lspo-eval")


def test_training_refuses_a_benchmark_that_keeps_no_problem(make_config, tmp_path, capsys, monkeypatch, easy_rule):
    config = make_config(eval__benchmarks=[write_jsonl(tmp_path / "long.jsonl", too_long_rows(2))])
    with cli_verifier(monkeypatch, easy_rule):
        assert (
            cli.train_main(["--config", write_config(tmp_path / "c.yaml", config), "--out", str(tmp_path / "r")]) == 2
        )
    assert "eval.benchmarks: long keeps no problem to validate on (2 rows" in one_line(capsys, "lspo-train")


def test_ctrl_c_during_start_up_is_one_line(trained_run, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    from lspo_jax import export
    from lspo_jax.job import build

    for module in (run_module, build, export):  # the run's start, lspo-eval's and lspo-export's
        monkeypatch.setattr(module, "load_policy", interrupted)
    assert cli.train_main(["--config", PAPER_CONFIG, "--out", str(tmp_path / "r")]) == 130
    assert "interrupted during start-up" in one_line(capsys, "lspo-train")
    assert cli.eval_main(["--model", trained_run["dir"]]) == 130
    assert "interrupted" in one_line(capsys, "lspo-eval")
    assert cli.export_main([trained_run["dir"], str(tmp_path / "hf")]) == 130
    assert "interrupted" in one_line(capsys, "lspo-export")
    # SIGTERM (a scheduler's stop) during start-up is the same stop, not a silent exit 143.
    for module in (run_module, build, export):
        monkeypatch.setattr(module, "load_policy", lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    assert cli.train_main(["--config", PAPER_CONFIG, "--out", str(tmp_path / "r2")]) == 130
    assert "interrupted during start-up" in one_line(capsys, "lspo-train")
    assert cli.eval_main(["--model", trained_run["dir"]]) == 130
    assert "interrupted" in one_line(capsys, "lspo-eval")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler was the command's alone


def test_a_sigterm_after_training_lets_the_run_finish_and_a_second_ends_it(capsys):
    """Once training has ended the run closes and plots: a SIGTERM then is neither a stop during start-up (the
    interrupted line, 130) nor a reason to leave the engine and verifier processes behind."""
    before = signal.getsignal(signal.SIGTERM)
    with cli._terminate_as_interrupt():
        with pytest.raises(KeyboardInterrupt):  # during start-up
            os.kill(os.getpid(), signal.SIGTERM)
        cli._finish_on_terminate()  # what train_run calls once training has ended
        os.kill(os.getpid(), signal.SIGTERM)  # let finish, said
        assert "finishing the run" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second one ends the process
    assert signal.getsignal(signal.SIGTERM) is before


def test_describe_says_what_failed_without_calling_a_read_a_write():
    import errno

    from lspo_jax.checkpoint import CheckpointError
    from lspo_jax.data import DataError

    denied = PermissionError(errno.EACCES, "Permission denied", "/data/x.jsonl")
    assert cli.describe(denied) == "cannot use /data/x.jsonl: Permission denied; check its permissions"
    try:  # a data file that cannot be read: its own line, not advice about writing
        raise DataError("/data/x.jsonl: cannot be opened (PermissionError: Permission denied)") from denied
    except DataError as err:
        assert cli.describe(err) == "/data/x.jsonl: cannot be opened (PermissionError: Permission denied)"
    try:  # space is only ever a write's, found through the causes
        raise CheckpointError("checkpoint step 3 could not be written") from OSError(errno.ENOSPC, "No space", "/c")
    except CheckpointError as err:
        assert cli.describe(err).startswith("cannot write /c: No space; free some space")


def test_the_machine_refusing_a_write_is_one_line_and_the_traceback_is_there_when_asked(tmp_path, capsys,
                                                                                        monkeypatch):  # fmt: skip
    import errno

    from lspo_jax import run_lock

    def read_only(path, *args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(run_lock.os, "open", read_only)
    argv = ["--config", PAPER_CONFIG, "--out", str(tmp_path / "r")]
    assert cli.train_main(argv) == 2
    lock = tmp_path / "r" / run_lock.LOCK_NAME
    assert one_line(capsys, "lspo-train").strip() == (
        f"lspo-train: cannot write {lock}: Read-only file system; choose a writable --out"
    )
    monkeypatch.setenv(cli.DEBUG_VAR, "1")
    assert cli.train_main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1].startswith(f"lspo-train: cannot write {lock}")
    monkeypatch.delenv(cli.DEBUG_VAR)

    def out_of_memory(*args, **kwargs):  # what XLA raises on an accelerator for a batch it cannot allocate
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.\nmore")

    monkeypatch.setattr(run_module, "train_run", out_of_memory)
    assert cli.train_main(argv) == 2
    assert one_line(capsys, "lspo-train").startswith(
        "lspo-train: the devices ran out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        "1.00GiB.); raise loss.micro_batches"
    )


# ------------------------------------------------------------------------------------ resume bookkeeping
def test_a_run_killed_after_a_checkpoint_resumes_as_if_it_never_stopped(trained_run, tmp_path, easy_rule):
    # What a SIGKILL during step 4 leaves: the checkpoint of step 2, records of steps 1-3, no summary.
    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "4"))
    os.remove(os.path.join(run_dir, "summary.json"))
    path = os.path.join(run_dir, "metrics.jsonl")
    kept = [r for r in read_metrics(path) if r["step"] <= 3 and r["kind"] == "train" or r["step"] == 0]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    config = load_config(os.path.join(run_dir, "config.yaml"))
    job = run_steps(config, run_dir, easy_rule, resume=True)
    assert train_records(run_dir) == train_records(trained_run["dir"])  # step 3 once, not twice
    assert eval_steps(run_dir) == [0, 4]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    uninterrupted = trained_run["job"].summary
    for key in ("cliff_groups", "scaffold_attempted", "surpassed_groups", "rerolls", "rerolls_passed", "rollouts",
                "surpass_rate", "rescue_pass_rate", "held_out_before", "held_out_after"):  # fmt: skip
        assert summary[key] == uninterrupted[key], key  # the whole run, not the resumed half
    assert summary["held_out_before"] is not None and job.summary["cliff_groups"] == 4


def test_resuming_a_finished_run_adds_nothing_and_fewer_steps_are_refused(trained_run, tmp_path, capsys,
                                                                           monkeypatch, easy_rule):  # fmt: skip
    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        before = f.read()
    with cli_verifier(monkeypatch, easy_rule) as verifier:
        for _ in range(2):
            assert cli.train_main(["--out", run_dir, "--resume"]) == 0
            assert "is at step 4 of steps=4: nothing to train" in capsys.readouterr().err
        verifier.closed = False
        assert cli.train_main(["--out", run_dir, "--resume", "steps=2"]) == 2
        assert verifier.closed  # started before the learner, whose restore refused: closed, not left running
        refusal = "steps: 2 is below the run's step 4 (its checkpoint); pass steps=4 or more"
        assert refusal in one_line(capsys, "lspo-train")

        def close_fails():
            raise RuntimeError("its pool is gone")

        verifier.close = close_fails  # a close that fails too does not hide the refusal behind its own error
        assert cli.train_main(["--out", run_dir, "--resume", "steps=2"]) == 2
    err = one_line(capsys, "lspo-train")
    assert refusal in err and "closing the verifier after a failed start also failed: its pool is gone" in err
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert f.read() == before  # no second final validation
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["held_out_after"] == trained_run["job"].summary["held_out_after"]


def test_a_run_directory_has_one_writer(trained_run, tmp_path, capsys):
    """Two runs into one --out at once once both exited 0 with the second's config, records and checkpoints: the
    first was lost. Another process holding the directory (here a bare lock holder) refuses a new run and a resume."""
    import subprocess
    import sys

    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    hold = "import sys, time; from lspo_jax.run_lock import RunLock; RunLock(sys.argv[1]); print('held', flush=True); time.sleep(120)"  # noqa: E501
    holder = subprocess.Popen([sys.executable, "-c", hold, run_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        for argv in (["--out", run_dir, "--resume"], ["--config", PAPER_CONFIG, "--out", run_dir]):
            assert cli.train_main(argv) == 2
            err = one_line(capsys, "lspo-train")
            assert f"--out {run_dir} is being written by another run (pid {holder.pid} on " in err, err
    finally:
        holder.kill()
        holder.wait()
    with (
        open(os.path.join(run_dir, "metrics.jsonl")) as f,
        open(os.path.join(trained_run["dir"], "metrics.jsonl")) as g,
    ):
        assert f.read() == g.read()  # untouched by the refused commands


def test_a_resume_that_changes_the_run_says_so(trained_run, tmp_path, capsys, monkeypatch, easy_rule):
    import yaml

    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    config, records = os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, "metrics.jsonl")
    with open(config) as f:
        original = f.read()
    # An override that the checkpoints cannot hold is named as the override, not as unreadable checkpoints.
    assert cli.train_main(["--out", run_dir, "--resume", "scaffold.adapter=persistent"]) == 2
    err = one_line(capsys, "lspo-train")
    assert "--resume: scaffold.adapter 'persistent' cannot continue the run's checkpoints, written with 'fresh'" in err
    os.rename(config, config + ".away")
    assert cli.train_main(["--out", run_dir, "--resume"]) == 2
    assert f"--resume: {config} is missing (the run's own settings)" in one_line(capsys, "lspo-train")
    os.rename(config + ".away", config)
    with cli_verifier(monkeypatch, easy_rule):
        # A changed setting keeps the config the steps so far ran with, beside the new one.
        assert cli.train_main(["--out", run_dir, "--resume", "seed=7"]) == 0
        err = capsys.readouterr().err
        assert f"--resume changes seed 42 -> 7; steps 1-4 ran with {run_dir}/config.step4.yaml" in err, err
        with open(os.path.join(run_dir, "config.step4.yaml")) as f:
            assert f.read() == original
        with open(config) as f:
            assert yaml.safe_load(f)["seed"] == 7
        # The training file changed in place, and the records lost: both said, the run still resumes.
        changed = tmp_path / "train.jsonl"
        shutil.copy(load_config(config).data.train, changed)
        with open(changed, "a") as f:
            f.write(json.dumps({"id": "new", "problem": "1+1=", "answer": "2"}) + "\n")
        with open(config) as f:
            text = f.read().replace(load_config(config).data.train, str(changed))
        with open(config, "w") as f:
            f.write(text)
        os.remove(records)
        assert cli.train_main(["--out", run_dir, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"data.train {changed} is not the data the run's checkpoint was trained on (its files changed)" in err
    assert f"{records} is missing: the records of steps 1-4 are lost, and the summary counts the steps from 5" in err


def test_eval_limit_takes_the_first_rows_of_the_file_and_says_what_it_dropped(trained_run, tmp_path, capsys,
                                                                              monkeypatch):  # fmt: skip
    seen = []

    def no_sampling(run, policy, params, examples, pool, key, stop=None):
        seen.append([ex.id for ex in examples])
        return np.zeros((len(examples), run.eval.n), bool), np.zeros(len(examples))

    monkeypatch.setattr(evaluation, "graded_samples", no_sampling)
    rows = too_long_rows(1)  # dropped at load
    rows += [{"id": f"p{i}", "problem": f"{i}+{i}=", "answer": str(2 * i), "solution": "\\boxed{0}"} for i in (1, 2, 3)]
    bench = write_jsonl(tmp_path / "bench.jsonl", rows)
    argv = ["--model", trained_run["dir"], "--benchmarks", bench, "--limit", "2", "--workers", "0"]
    assert cli.eval_main(argv) == 0
    assert seen == [["p1"]]  # the first two rows of the file, of which one is too long; not p1 and p2
    assert "lspo-eval: bench: 1 of 2 rows kept; {'prompt_skipped': 1}" in capsys.readouterr().err
