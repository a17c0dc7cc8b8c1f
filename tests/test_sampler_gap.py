"""The sampler is provably the policy: each step records ``rollout/logprob_gap`` (the sampler's log-probs of its own
tokens against the trainer's forward of the same weights), near 0 while they agree; an engine left with the weights
of step 0 (a sync that never lands) moves it past ``rollout.max_logprob_gap`` and the run stops within
``rollout.max_logprob_gap_steps`` steps, in one line, a checkpoint written. vLLM's weight pushes are recorded as
``rollout/sync_s`` and ``rollout/sync_host_bytes`` (tests/test_vllm.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import run_steps, train_records

from lspo_jax.job import errors
from lspo_jax.job.config_io import load_config
from lspo_jax.job.run import SamplerGapError
from lspo_jax.options import RolloutError
from lspo_jax.rl import scaffold, step_record
from lspo_jax.train_config import ConfigError


def test_every_step_records_a_gap_near_zero_when_the_sampler_holds_the_trained_weights(trained_run):
    gaps = [r[step_record.GAP_KEY] for r in train_records(trained_run["dir"])]
    # float32 on both sides: one rounding of log-probs near 0 (1e-7 measured), four decades under the bound.
    assert len(gaps) == 4 and all(0 <= gap < 1e-5 for gap in gaps), gaps


def test_the_gap_leaves_out_spliced_rows_and_rows_sampled_ahead():
    mask = np.array([[0, 1, 1], [0, 1, 0]], np.float32)
    rows = {"mask": mask, "sampler_logp": np.array([[0.0, -1.0, -2.0], [0.0, -5.0, 0.0]], np.float32)}
    base = np.array([[9.0, -1.5, -2.5], [0.0, 0.0, 7.0]], np.float32)  # prompt slots and padding: never read
    # Row 0's tokens differ by 0.5 and 0.5; row 1 (spliced: the adapter sampled it) by 5, left out.
    assert step_record.sampler_gap(rows, base, np.array([False, True]), on_policy=True) == {step_record.GAP_KEY: 0.5}
    # Both rows: (0.5 + 0.5 + 5) / 3 = 2.
    assert step_record.sampler_gap(rows, base, np.array([False, False]), on_policy=True) == {step_record.GAP_KEY: 2.0}
    assert step_record.sampler_gap(rows, base, np.array([False, False]), on_policy=False) == {step_record.GAP_KEY: None}
    assert step_record.sampler_gap(rows, base, np.array([True, True]), on_policy=True) == {step_record.GAP_KEY: 0.0}


def test_the_bound_comes_from_the_engine_and_dtype_unless_given():
    run = load_config(None, [])
    assert run.rollout.logprob_gap_bound("float32") == 1e-3 < run.rollout.logprob_gap_bound("bfloat16")
    vllm = load_config(None, ["rollout.engine=vllm"]).rollout
    assert (
        vllm.logprob_gap_bound("bfloat16")
        > vllm.logprob_gap_bound("float32")
        > run.rollout.logprob_gap_bound("float32")
    )
    assert load_config(None, ["rollout.max_logprob_gap=0.3"]).rollout.logprob_gap_bound("float32") == 0.3
    assert load_config(None, ["rollout.max_logprob_gap_steps=0"]).rollout.logprob_gap_bound("float32") is None
    for bad in ("rollout.max_logprob_gap=0", "rollout.max_logprob_gap_steps=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config(None, [bad])


def test_a_sampler_left_with_step_0s_weights_stops_the_run_within_two_steps(tmp_path, make_config, easy_rule):
    held = {}

    def never_synced(job):
        learner, real = job.learner, job.learner.sample
        held["params"] = jax.tree.map(jnp.copy, learner.state.params)  # the updates donate the live ones

        def sample(prompts, key, *, lora_scale, **kwargs):
            if not lora_scale:  # the step's rollouts: the engine never got the new weights
                return learner.sample_from(held["params"], learner.generator, prompts, key, lora_scale=0.0, **kwargs)
            return real(prompts, key, lora_scale=lora_scale, **kwargs)

        learner.sample = sample

    config = make_config(steps=6, checkpoint__every=10)
    with pytest.raises(SamplerGapError) as err:
        run_steps(config, str(tmp_path), easy_rule, prepare=never_synced)
    # Step 1 samples with the weights it trains (0 updates yet); steps 2 and 3 with step 0's: two in a row, stop.
    assert "above rollout.max_logprob_gap 0.001 (jax, float32) for 2 steps in a row" in str(err.value)
    assert "checkpoint written at step 3" in str(err.value)
    gaps = [r[step_record.GAP_KEY] for r in train_records(str(tmp_path))]
    assert len(gaps) == 3 and gaps[0] < 1e-5 and min(gaps[1:]) > 1e-3, gaps
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [3]


@pytest.mark.parametrize("error", [
    SamplerGapError("the jax sampler's log-probs ... checkpoint written at step 3"),
    scaffold.AdapterNotOnError("rollout.engine vllm sampled the re-rolls of step 2 from the base, not the adapter"),
])  # fmt: skip
def test_a_rollout_error_is_one_line_with_its_own_status(capsys, error):
    def body(args):
        raise error

    assert isinstance(error, RolloutError) and not isinstance(error, ConfigError)
    assert errors.run_command("lspo-train", body, None, "interrupted") == errors.EXIT_ROLLOUT == 4
    err = capsys.readouterr().err
    assert err == f"lspo-train: rollout error: {error}\n"
