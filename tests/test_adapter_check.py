"""The scaffold's adapter check and the adapter reliance.

On a step whose re-rolls an external engine sampled, the engine's log-probs of the spliced tokens must be the
adapter's, not the base's (``scaffold.adapter_check``): an engine that held the base where the merged adapter was
meant stops the run in one line. Every scaffolded step records ``scaffold/adapter_reliance``, the spliced tokens'
mean log-likelihood gain under the adapter. The arithmetic on hand-computed arrays; then one run whose "external"
engine is the JAX sampler, honest for a step, then ignoring the adapter. vLLM's own case is in ``test_vllm.py``.
"""

from __future__ import annotations

import collections
import math
import os

import numpy as np
import pytest
from run_fixtures import FakeVerifier, flag_adapter

from lspo_jax.job import errors
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run import Run
from lspo_jax.rl import scaffold, step_record
from lspo_jax.rollout import sampler

# Four rows of three tokens; rows 1 and 2 spliced, row 1's last token masked out.
BASE = np.array([[-1, -1, -1], [-3, -1, -0.5], [-2, -2, -2], [-1, -1, -1]], np.float32)
ADAPTER = np.array([[-1, -1, -1], [-1, -1.5, -9], [-1.5, -2, -2], [-1, -1, -1]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
SPLICED = np.array([False, True, True, False])
# Spliced tokens' gains log p_adapter - log p_base: row 1 [2.0, -0.5], row 2 [0.5, 0.0, 0.0] (row 1's -8.5 is
# masked out). Reliance: (2 - 0.5 + 0.5 + 0 + 0) / 5 = 0.4. Separation mean |adapter - base|: (2 + 0.5 + 0.5) / 5 = 0.6.
RELIANCE, SEPARATION = 0.4, 0.6


def check(engine, noise):
    return scaffold.adapter_check(engine, ADAPTER, BASE, MASK, SPLICED, noise, step=7)


# ------------------------------------------------------------------------------------------ arithmetic
def test_adapter_reliance_by_hand():
    # behaviour_logp is the adapter's on spliced rows, the base's elsewhere (as the step builds it).
    behaviour = np.where(SPLICED[:, None], ADAPTER, BASE)
    got = step_record.adapter_reliance(BASE, behaviour, MASK, SPLICED)
    assert got == {"scaffold/adapter_reliance": pytest.approx(RELIANCE, rel=1e-6)}
    # The log ratio spliced_diagnostics reads is its negative on the same tokens: q50 of [-2, 0.5, -0.5, 0, 0] is 0.
    diagnostics = step_record.spliced_diagnostics(BASE, behaviour, MASK, SPLICED)
    assert diagnostics["spliced_log_ratio_q50"] == 0.0 and diagnostics["spliced_token_share"] == pytest.approx(5 / 11)
    assert step_record.adapter_reliance(BASE, behaviour, MASK, np.zeros(4, bool)) == {"scaffold/adapter_reliance": None}


def test_an_engine_with_the_adapters_logprobs_passes():
    # d_adapter = 0, d_base = the separation 0.6; noise 0.01: 0.6 >= 4 * 0.01, the adapter tells apart from the base.
    got = check(ADAPTER + 0.0, noise=0.01)
    assert got["scaffold/adapter_check"] == 1
    assert got["scaffold/engine_adapter_diff"] == 0.0
    assert got["scaffold/engine_base_diff"] == pytest.approx(SEPARATION, rel=1e-6)


def test_an_engine_with_the_bases_logprobs_stops_the_run_in_one_line():
    # d_base = 0 < d_adapter = 0.6, with the adapter distinguishable (0.6 >= 4 * 0.01).
    with pytest.raises(scaffold.AdapterNotOnError) as err:
        check(BASE + 0.0, noise=0.01)
    assert str(err.value).startswith(
        "rollout.engine vllm sampled the re-rolls of step 7 from the base, not the adapter: its log-probs are 0 "
        "nats/token from the base's and 0.6 from the adapter's"
    )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("adapter_shift", "noise"),
    [
        (0.0, 0.2),  # separation 0.6 < 4 * 0.2: the engine's noise is too large to tell adapter from base
        (0.002, 0.0),  # separation 0.002 < 4 * 1e-3, the noise floor: a barely fitted adapter, no base rows
    ],
)
def test_an_indistinguishable_adapter_is_recorded_not_stopped(adapter_shift, noise):
    adapter = np.where(SPLICED[:, None], BASE + adapter_shift, ADAPTER) if adapter_shift else ADAPTER
    got = scaffold.adapter_check(BASE + 0.0, adapter, BASE, MASK, SPLICED, noise, step=7)  # the engine: the base
    assert got["scaffold/adapter_check"] == 0
    assert got["scaffold/engine_base_diff"] == 0.0 and got["scaffold/engine_adapter_diff"] > 0


def test_no_spliced_tokens_no_check():
    got = scaffold.adapter_check(BASE, ADAPTER, BASE, MASK, np.zeros(4, bool), 0.01, step=7)
    assert got == dict.fromkeys(scaffold.ADAPTER_CHECK)


def test_lspo_train_ends_on_it_in_one_line_as_a_rollout_error(capsys):
    def body(args):
        check(BASE + 0.0, noise=0.01)

    # The samples, not the config, are at fault: exit 4 (EXIT_ROLLOUT), said as a rollout error.
    assert errors.run_command("lspo-train", body, None, "interrupted") == errors.EXIT_ROLLOUT == 4
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("lspo-train: rollout error: rollout.engine vllm sampled the re-rolls of step 7 from the base")


# ------------------------------------------------------------------------------------------ in the loop
def test_every_scaffolded_record_holds_the_reliance(trained_run):
    records = [r for r in read_metrics(os.path.join(trained_run["dir"], "metrics.jsonl")) if r["kind"] == "train"]
    spliced = [r for r in records if r["spliced_rows"]]
    assert spliced, "the trained run should splice re-rolls on some step"
    for record in records:
        reliance = record["scaffold/adapter_reliance"]
        assert record["scaffold/adapter_check"] is None  # the JAX sampler: the trainer's own forward re-rolled
        if not record["spliced_rows"]:
            assert reliance is None
            continue
        # Jensen: mean exp(-gain) >= exp(-mean gain), the ratio mean against the reliance of the same tokens.
        assert math.isfinite(reliance) and record["spliced_ratio_mean"] >= math.exp(-reliance) * (1 - 1e-6)


class JaxEngine:
    """An external engine's stand-in: the JAX sampler, which samples the re-rolls with the adapter on, or with
    ``ignore_adapter`` from the base whatever it is asked (what an engine whose merged-adapter sync fails does)."""

    def __init__(self, config):
        self.config, self.ignore_adapter = config, False
        self.stats, self.max_model_len = collections.defaultdict(float), 10**6  # the engine's counters: all 0

    def generate_arrays(self, params, prompts, *, lora_scale=0.0, **options):
        scale = 0.0 if self.ignore_adapter else lora_scale
        return sampler.generate_arrays(self.config, params, prompts, lora_scale=scale, **options)

    def close(self):
        pass


def test_an_engine_ignoring_the_adapter_stops_the_step(tmp_path, make_config, easy_rule):
    # One cliff per step (easy_rule); its re-rolls pass in slot 1, so every step splices one row.
    verifier = FakeVerifier(easy_rule, lambda response, gold, slot: slot == 1)
    job = Run(make_config(steps=2), str(tmp_path), verifier=verifier)
    flag_adapter(job, verifier)
    engine = JaxEngine(job.policy.config)
    job.learner.generator.vllm = engine
    try:
        first = job.one_step()
        assert first["spliced_rows"] == 1 and first["scaffold/adapter_check"] == 1
        assert first["scaffold/engine_adapter_diff"] < first["scaffold/engine_base_diff"]
        engine.ignore_adapter = True
        with pytest.raises(scaffold.AdapterNotOnError, match="re-rolls of step 2 from the base, not the adapter"):
            job.one_step()
    finally:
        job.close()
    assert job.state.step == 1  # the stopped step did not update the base
