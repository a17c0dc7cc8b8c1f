"""Rollouts one update old (``rollout.max_staleness: 1``, ``rl.staleness``): what the step's records say, what the
update's rows were sampled from and weighed with, the config's refusals, and a resume that continues the run as if
it never stopped; and the same with the sampling on devices of its own (``rollout.placement: split``, on 4 CPU
devices in a process of its own: ``split_checks.py``). The runs share ``run_fixtures``' shapes, so they reuse the
programs other tests compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from run_fixtures import copy_tree, run_steps, train_records, wrap

from lspo_jax.job.config import load_config
from lspo_jax.rl import staleness
from lspo_jax.train_config import ConfigError

STALE = {"rollout__max_staleness": 1, "loss__tis_cap": 2.0}
TIMINGS = ("rollout/overlap_s", "rollout/overlap_share", "rollout/prefetch_s", "rollout/push_s")  # seconds: vary


def values(records):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory, make_config, easy_rule):
    """4 steps at max_staleness 1, checkpoints at 2 and 4: steps 2 and 4 take rows sampled during 1 and 3. Logs the
    base each prefetch started from (a host copy) and the rows each step took from a prefetch."""
    out, starts, taken, real = str(tmp_path_factory.mktemp("stale")), [], [], staleness.Prefetch.rows

    def rows(self):
        taken.append(real(self))
        return taken[-1]

    def prepare(job):
        base = lambda: {"base": copy_tree(job.learner.base_params()), "updated_steps": job.state.step}
        wrap(job.prefetcher, "sample_ahead", before=base, log=starts)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(staleness.Prefetch, "rows", rows)
        job = run_steps(make_config(steps=4, **STALE), out, easy_rule, prepare=prepare)
    return {"dir": out, "job": job, "starts": starts, "taken": taken}


def test_stale_steps_record_their_staleness_and_overlap(stale_run):
    records = train_records(stale_run["dir"])
    assert [r["rollout/staleness"] for r in records] == [0, 1, 0, 1]  # on-policy after each checkpoint
    for r in records:
        assert set(staleness.RECORD_KEYS) <= r.keys()
        if r["rollout/staleness"]:
            assert r["rollout/prefetch_s"] > 0 and 0 <= r["rollout/overlap_s"] <= r["rollout/prefetch_s"]
        else:
            assert r["rollout/overlap_s"] == 0.0 and r["rollout/prefetch_s"] is None
    # The truncated weight min(pi_proximal / pi_behaviour, 2): about 1 on on-policy rows (float32 rounding), away
    # from 1 on rows sampled before the last update, which moved the base.
    for r in records:
        assert (abs(r["is_weight_mean"] - 1) > 1e-4) == bool(r["rollout/staleness"]), r


def test_stale_rows_are_the_earlier_base_sampled_with_the_on_policy_key(stale_run):
    """The rows step t + 1 trained on are what its prompts sample, with the key an on-policy run gives them, from
    the base before step t's update: sampled again here from the host copy taken when the prefetch started."""
    job, starts, taken = stale_run["job"], stale_run["starts"], stale_run["taken"]
    assert [start["updated_steps"] for start in starts] == [0, 2]  # started before the updates of steps 1 and 3
    assert len(taken) == 2
    prompts = job.examples  # no shuffling, 2 prompts a step: step t + 1 (1-based) takes rows 2t and 2t + 1
    for (start, rows), step in zip(zip(starts, taken, strict=True), (1, 3), strict=True):
        key = jax.random.split(jax.random.fold_in(jax.random.key(job.run.seed), step))[0]
        base = jax.device_put(start["base"], jax.tree.map(lambda x: x.sharding, job.learner.base_params()))
        step_prompts = [ex.prompt_ids for ex in prompts[2 * step : 2 * step + 2]]
        again = job.learner.sample_from(base, job.learner.generator, step_prompts, key, lora_scale=0.0)
        for name in ("tokens", "mask", "sampler_logp"):
            np.testing.assert_array_equal(rows[name], again[name])


def test_a_stale_run_resumed_continues_as_if_never_stopped(stale_run, make_config, easy_rule, tmp_path):
    out = str(tmp_path)
    run_steps(make_config(steps=2, **STALE), out, easy_rule)
    run_steps(make_config(steps=4, **STALE), out, easy_rule, resume=True)
    assert values(train_records(out)) == values(train_records(stale_run["dir"]))


def test_a_checkpoint_with_rollouts_in_flight_keeps_the_order_before_their_draw(make_config, easy_rule, tmp_path):
    """A stop after step 1 (its prefetch of step 2 running) checkpoints the prompt order after step 1's prompts:
    the resumed run draws step 2's again and samples them on-policy."""
    seen = []

    def prepare(job):
        wrap(job, "one_step", after=lambda _: seen.append((job.source_state(), job.prompts.state_dict())))

    run_steps(make_config(steps=3, checkpoint__every=4, **STALE), str(tmp_path), easy_rule, prepare=prepare)
    assert seen[0] == ({"epoch": 0, "position": 2}, {"epoch": 0, "position": 4})
    assert seen[-1][0] == seen[-1][1]  # the last step prefetches nothing


def test_rollouts_dropped_are_cut_short_and_never_used(make_config, tmp_path):
    """A stop or a failed step drops the rollouts sampling ahead (``Prefetch.drop``): the thread's sampling is asked
    to end at its next decode segment, so the stop waits for a few tokens, not a sampling phase; the rows refuse to
    be used. A learner whose sampling would never end on its own shows it."""
    from types import SimpleNamespace

    seen = []

    class Endless:
        state = SimpleNamespace(step=3)

        def sample_from(self, params, generator, prompts, key, *, lora_scale, cancel):
            seen.append(prompts)
            while not cancel():
                time.sleep(0.005)

    sampling = SimpleNamespace(generator=None, push=lambda learner: ({}, 0.0))
    draw = SimpleNamespace(examples=[SimpleNamespace(prompt_ids=[1, 2])], key=jax.random.key(0))
    ahead = staleness.Prefetch(Endless(), draw, {}, sampling)
    start = time.perf_counter()
    ahead.drop()
    assert time.perf_counter() - start < 5 and seen == [[[1, 2]]] and not ahead._thread.is_alive()
    with pytest.raises(RuntimeError, match="dropped"):
        ahead.rows()


def test_the_push_is_in_the_samplers_compute_dtype(stale_run):
    """A bfloat16 sampler gets the base cast to bfloat16 (half the bytes of the fp32 master copy), the same values
    as its own cast; a float32 one the master copy's values, as a copy the learner's update cannot donate."""
    import dataclasses
    from types import SimpleNamespace

    learner = stale_run["job"].learner
    for dtype in ("bfloat16", "float32"):
        config = dataclasses.replace(learner.policy.config, compute_dtype=dtype)
        fake = SimpleNamespace(policy=SimpleNamespace(config=config), base_params=learner.base_params)
        copy, seconds = staleness.Sampling(learner).push(fake)
        for got, master in zip(jax.tree.leaves(copy), jax.tree.leaves(learner.base_params()), strict=True):
            assert got.dtype == dtype and got is not master and seconds >= 0
            np.testing.assert_array_equal(np.asarray(got), np.asarray(master.astype(dtype)))


def test_the_learner_hands_cancel_to_the_sampler(stale_run):
    """``Learner.sample_from(cancel=...)`` reaches the JAX sampler: segments of 4 tokens, cancelled from the first, give
    rows of at most 4 response tokens, where the same call uncancelled runs past them."""
    from lspo_jax.rollout.generator import Generator

    learner = stale_run["job"].learner
    generator = Generator(learner.policy, learner.mesh, compact_every=4)
    prompts = [ex.prompt_ids for ex in stale_run["job"].examples[:2]]
    call = lambda cancel: learner.sample_from(learner.state.params, generator, prompts, jax.random.key(1),
                                              lora_scale=0.0, cancel=cancel)  # fmt: skip
    response = lambda rows: rows["mask"][:, learner.run.data.max_prompt_tokens :].sum(axis=1)
    assert response(call(lambda: True)).max() <= 4 < response(call(lambda: False)).max()


def test_k0_records_say_nothing_of_staleness(trained_run):
    assert not any(key.startswith("rollout/staleness") for r in train_records(trained_run["dir"]) for key in r)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["rollout.max_staleness=1"], "loss.tis_cap"),
        (["rollout.max_staleness=1", "loss.tis_cap=2", "rollout.engine=vllm"], "rollout.engine"),
        (["rollout.max_staleness=1", "loss.tis_cap=2", "rollout.dynamic_sampling=true"], "rollout.dynamic_sampling"),
        (["rollout.max_staleness=1", "loss.tis_cap=2", "l2rr.enabled=true", "l2rr.target=t.jsonl"], "l2rr.enabled"),
        (["rollout.max_staleness=2", "loss.tis_cap=2"], "must be 0 or 1"),
    ],
)
def test_staleness_refusals_name_both_keys(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    line = str(err.value)
    assert "\n" not in line and line.startswith("rollout.max_staleness: ") and named in line, line


def test_no_rollouts_are_drawn_ahead_once_a_stop_was_asked_for():
    """A stop's checkpoint would drop the rollouts in flight and closing would wait for them: none start."""
    run = load_config(None, ["rollout.max_staleness=1", "loss.tis_cap=2.0", "steps=10", "checkpoint.every=5"])
    # Steps 1..10 (done: the steps before it) that sample the next one's rollouts during their update: all but the
    # one a checkpoint follows (5) and the last (10); none once a stop was asked for, nor at max_staleness 0.
    assert [s for s in range(1, 11) if staleness.samples_ahead(run, s - 1, False)] == [1, 2, 3, 4, 6, 7, 8, 9]
    assert not any(staleness.samples_ahead(run, s - 1, True) for s in range(1, 11))
    on_policy = load_config(None, ["steps=10", "checkpoint.every=5"])
    assert not any(staleness.samples_ahead(on_policy, s - 1, False) for s in range(1, 11))


# ------------------------------------------------------------------------------------------- split placement
@pytest.fixture(scope="module")
def split_run():
    """``split_checks.py`` in a process of 4 CPU devices (this one started JAX with one): its JSON."""
    script = os.path.join(os.path.dirname(__file__), "helpers", "split_checks.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(script), env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_split_learns_on_its_devices_and_samples_on_the_others(split_run):
    """2 of 4 devices learn, 2 sample: the base is pushed to the sampler's two before every step's rollouts (four
    steps, four pushes: on-policy ones after checkpoints too), and every rollout is sampled there."""
    placed = split_run["placed"]
    assert split_run["devices"] == [0, 1, 2, 3] and placed["learner"] == [0, 1]
    assert placed["pushed"] == [[2, 3]] * 4
    assert placed["sampled"] == [{"params": [2, 3], "mesh": [2, 3]}] * 4


def test_split_stale_rows_are_the_earlier_base_sampled_on_the_sampler_mesh(split_run):
    """Step 2's rows, sampled during step 1's update, are what the sampler's mesh draws from the base before that
    update with the key an on-policy run gives step 2: the same tokens, mask and sampler log-probs."""
    assert split_run["again"] == {"tokens": True, "mask": True, "sampler_logp": True}
    assert [r["rollout/staleness"] for r in split_run["whole"]["records"]] == [0, 1, 0, 1]
    for r in split_run["whole"]["records"]:  # the correction sees the staleness, as colocated
        assert (abs(r["is_weight_mean"] - 1) > 1e-4) == bool(r["rollout/staleness"]), r


def test_a_split_run_resumed_at_a_checkpoint_continues_as_if_never_stopped(split_run):
    assert split_run["resumed"]["records"] == split_run["whole"]["records"]


def test_a_split_run_stopped_by_sigterm_redraws_its_rollouts_in_flight(split_run):
    """SIGTERM during step 1, whose update sampled step 2's rows: the run checkpoints step 1 and ends; resumed, step 2
    draws the same prompts and samples them on-policy (staleness 0), the documented difference from a run never
    stopped, whose step 2 trained on rows one update old. Step 1 is the same record in both."""
    whole, stopped = split_run["whole"], split_run["stopped"]
    assert split_run["stopped_summary"] == {"steps": 1, "stopped_early": True}
    assert stopped["records"][0] == whole["records"][0]
    assert stopped["draws"] == whole["draws"][1:]
    assert [r["rollout/staleness"] for r in stopped["records"]] == [0, 0, 0, 1]


def test_a_split_the_devices_cannot_make_is_one_line():
    """This process has one device: nothing to split. Too many sampler devices, or split at k = 0, are refused
    with the key that says so."""
    from lspo_jax.job.build import split_devices

    split = ["rollout.max_staleness=1", "loss.tis_cap=2", "rollout.placement=split"]
    with pytest.raises(ConfigError, match=r"^rollout\.sampler_devices: null \(half\) of 1 devices leaves none to "):
        split_devices(load_config(None, split))
    with pytest.raises(ConfigError, match=r"^rollout\.placement: split needs a mesh .* set mesh\.enabled to null"):
        load_config(None, [*split, "mesh.enabled=false"])
    with pytest.raises(ConfigError, match=r"^rollout\.sampler_devices: gives devices to the sampler with rollout\."):
        load_config(None, ["rollout.sampler_devices=2"])  # colocated: nothing to give them to
    assert split_devices(load_config(None, split[1:2])) == (None, None)  # colocated: nothing split
    with pytest.raises(ConfigError, match=r"^rollout\.placement: split .* set rollout\.max_staleness: 1$"):
        load_config(None, ["rollout.placement=split"])
