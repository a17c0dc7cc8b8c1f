"""Tests of the math-verify reward, gold parsing, the verifier pool's timeouts and the overlong penalty."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from math_verify.errors import TimeoutException

from lspo_jax.tasks import benchmarks, rewards
from lspo_jax.tasks.rewards import (
    GoldReport,
    math_reward,
    overlong_penalty,
    parse_gold,
    parse_golds,
    shaped_rewards,
)
from lspo_jax.tasks.verify_pool import VerifierPool

POOL_TIMEOUT = 3.0
# Comparing this tower with a number makes sympy evaluate it: still running after 70 s without a timeout.
PATHOLOGICAL = r"The answer is \boxed{9^{9^{9^{9}}}}"


def read_jsonl(name: str, limit: int | None = None) -> list[dict]:
    """A packaged benchmark's rows (``tasks.benchmarks``: they ship with the package, so this never skips)."""
    with benchmarks.packaged_file(name).open() as f:
        rows = [json.loads(line) for line in f]
    return rows[:limit]


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, timeout=POOL_TIMEOUT) as p:
        p.wait_ready()
        yield p


# -------------------------------------------------------------------------------------------- math_reward
@pytest.mark.parametrize(
    "response, gold",
    [
        (r"so \boxed{\frac{2}{4}}", "1/2"),
        (r"so \boxed{0.5}", "1/2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{2}{4}"),
        (r"\boxed{1/2}", "0.5"),
        (r"The answer is $\frac{\sqrt{8}}{2}$.", r"\sqrt{2}"),
        (r"\boxed{42}", "42"),
        (r"\boxed{\$36}", r"\$36"),
    ],
)
def test_equivalent_forms_score_one(response, gold):
    assert math_reward(response, gold) == 1.0


@pytest.mark.parametrize("response, gold", [(r"\boxed{\frac{1}{3}}", "1/2"), (r"\boxed{41}", "42"), ("", "42")])
def test_wrong_answer_scores_zero(response, gold):
    assert math_reward(response, gold) == 0.0


def test_prefers_last_boxed():
    response = r"first \boxed{3} ... final \boxed{4}"
    assert math_reward(response, "4") == 1.0
    assert math_reward(response, "3") == 0.0
    # math-verify alone would merge nearby boxes into the set {3, 4}; the last box is the answer.
    assert math_reward(r"\boxed{3}. So \boxed{4}", "4") == 1.0
    # A box cut open by truncation is no answer: the last complete one counts.
    assert math_reward(r"\boxed{4} hmm, actually \boxed{\frac{5}{", "4") == 1.0


def test_last_boxed():
    assert rewards.last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\frac{1}{2}"
    assert rewards.last_boxed(r"\fbox{7} and \boxed {x^{2}}") == "x^{2}"
    assert rewards.last_boxed(r"\boxed{3} then \boxed{4") == "3"
    assert rewards.last_boxed("no box") is None


def test_require_think_close():
    cut = "<think>\nLet me see, 2+2=4, so the answer is 4, hmm"
    assert math_reward(cut, "4") == 1.0  # the pitfall: a bare number inside the reasoning is found
    assert math_reward(cut, "4", require_think_close=True) == 0.0
    done = cut + r"</think> The answer is \boxed{4}."
    assert math_reward(done, "4", require_think_close=True) == 1.0
    # Only the text after the LAST </think> counts.
    assert math_reward(r"\boxed{4}</think> oops </think> \boxed{5}", "4", require_think_close=True) == 0.0


def _patch_verify(monkeypatch, fn) -> None:
    """Replace math-verify's ``verify`` as this module sees it (math-verify is imported at first use)."""
    loaded = rewards._math_verify()
    monkeypatch.setattr(rewards, "_math_verify", lambda: loaded._replace(verify=fn))


def test_math_reward_swallows_base_exceptions(monkeypatch):
    def boom(*args, **kwargs):
        raise TimeoutException("from math-verify")

    _patch_verify(monkeypatch, boom)
    assert math_reward(r"\boxed{1}", "1") == 0.0


def test_missing_math_verify_is_an_error_not_a_zero(monkeypatch):
    # The module imports without math-verify (the trainer needs only its length shaping); scoring then says why.
    monkeypatch.setitem(sys.modules, "math_verify", None)  # None in sys.modules makes the import fail
    rewards._math_verify.cache_clear()
    try:
        with pytest.raises(ImportError, match="needs math-verify"):
            math_reward(r"\boxed{1}", "1")
        with pytest.raises(ImportError, match="needs math-verify"):  # not a pool whose every score is an error
            VerifierPool(workers=0)
    finally:
        rewards._math_verify.cache_clear()


# ------------------------------------------------------------------------------------------------- golds
def test_plain_golds_parse():
    for gold in ["1/2", r"\frac{2}{4}", "0.5", "42", r"\sqrt{2}", r"\$32,\!348", r"\text{(C)}", "$x^2+1$"]:
        assert parse_gold(gold) is not None, gold


def test_unparseable_golds_reported():
    report = parse_golds({"a": "1/2", "empty": "", "garbage": "\\frac{", "b": r"\sqrt{2}", "blank": "   "})
    assert isinstance(report, GoldReport)
    assert report.n_bad == 3
    assert sorted(report.bad_ids) == ["blank", "empty", "garbage"]
    assert sorted(report.ok_ids) == ["a", "b"] and report.total == 5
    assert "3 unparseable" in report.summary() and "garbage" in report.summary()
    # Pairs work as well as a mapping.
    assert parse_golds([(0, "7"), (1, "")]).bad_ids == [1]


def test_math500_golds_parse():
    rows = read_jsonl("math500")
    report = parse_golds((r["id"], r["answer"]) for r in rows)
    print(report.summary())
    assert report.total == 500
    assert report.n_bad <= 5, report.summary()


# -------------------------------------------------------------------------------------------------- pool
def test_pool_agrees_with_math_reward(pool):
    responses = [r"\boxed{\frac{2}{4}}", r"\boxed{0.5}", r"\boxed{0.4}", r"first \boxed{3} final \boxed{4}", ""]
    golds = ["1/2", "1/2", "1/2", "4", "4"]
    acc = pool.score(responses, golds)
    assert acc.dtype == np.float32 and acc.shape == (5,)
    np.testing.assert_array_equal(acc, [math_reward(r, g) for r, g in zip(responses, golds, strict=True)])
    np.testing.assert_array_equal(acc, [1, 1, 0, 1, 0])
    assert pool.last_stats.scored == 5 and pool.last_stats.timeouts == 0 and pool.last_stats.errors == 0


def test_pool_require_think_close(pool):
    cut = "<think>2+2=4, hmm"
    acc = pool.score([cut, cut + r"</think>\boxed{4}"], ["4", "4"], require_think_close=True)
    np.testing.assert_array_equal(acc, [0, 1])


def test_pathological_answer_times_out_alone(pool):
    responses = [r"\boxed{7}", PATHOLOGICAL, r"\boxed{\frac{2}{4}}", r"\boxed{3}", r"\boxed{10}"]
    golds = ["7", "42", "1/2", "4", "10"]
    restarts_before = pool.stats.restarts
    start = time.monotonic()
    acc = pool.score(responses, golds)
    elapsed = time.monotonic() - start
    print(f"batch with a pathological item: {elapsed:.2f} s (timeout {POOL_TIMEOUT} s)")
    np.testing.assert_array_equal(acc, [1, 0, 1, 0, 1])
    assert pool.last_stats.timeouts == 1 and pool.last_stats.scored == 5
    assert pool.stats.restarts == restarts_before + 1
    assert POOL_TIMEOUT <= elapsed < POOL_TIMEOUT + 3.0
    # The replacement worker serves the next batch.
    np.testing.assert_array_equal(pool.score([r"\boxed{1}"] * 4, ["1"] * 4), [1, 1, 1, 1])
    assert pool.last_stats.timeouts == 0


def test_worker_exception_is_an_error_not_a_crash(pool):
    # None has no rfind: the worker raises AttributeError, which must come back as 0 and one error.
    acc = pool.score([None, r"</think>\boxed{2}"], ["1", "2"], require_think_close=True)
    np.testing.assert_array_equal(acc, [0, 1])
    assert pool.last_stats.errors == 1 and pool.last_stats.timeouts == 0


def test_pool_survives_a_dead_worker(pool):
    pool.wait_ready()  # a worker killed while ready, not one still starting
    victim = pool._workers[0].process
    victim.kill()
    victim.join(5)
    acc = pool.score([rf"\boxed{{{i}}}" for i in range(6)], [str(i) for i in range(6)])
    np.testing.assert_array_equal(acc, np.ones(6))
    assert pool.last_stats.restarts == 1 and pool.last_stats.errors == 0


def test_pool_empty_batch(pool):
    assert pool.score([], []).shape == (0,)


def test_pool_rejects_mismatched_lengths(pool):
    with pytest.raises(ValueError):
        pool.score(["a", "b"], ["1"])


def test_in_process_mode_counts_errors(monkeypatch):
    def boom(*args, **kwargs):
        raise TimeoutException("from math-verify")

    with VerifierPool(workers=0) as p:
        np.testing.assert_array_equal(p.score([r"\boxed{2}", r"\boxed{3}"], ["2", "2"]), [1, 0])
        _patch_verify(monkeypatch, boom)
        np.testing.assert_array_equal(p.score([r"\boxed{2}"], ["2"]), [0])
        assert p.last_stats.errors == 1 and p.stats.scored == 3


def test_aime_golds_score_against_themselves(pool):
    rows = read_jsonl("aime24") + read_jsonl("aime25")
    golds = [r["answer"] for r in rows]
    acc = pool.score([f"The answer is \\boxed{{{g}}}." for g in golds], golds)
    np.testing.assert_array_equal(acc, np.ones(len(rows)))
    # Shifted by one, answers are (almost all) wrong: the verifier is not trivially saying yes.
    shifted = pool.score([f"\\boxed{{{g}}}" for g in golds[1:]], golds[:-1])
    assert shifted.sum() <= 2


# ----------------------------------------------------------------------------------------------- shaping
def test_overlong_penalty_hand_computed():
    lengths = np.array([100, 7168, 7680, 8192])
    np.testing.assert_allclose(overlong_penalty(lengths, 8192, 1024), [0.0, 0.0, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalty(lengths, 8192, 1024, factor=0.5), [0.0, 0.0, -0.25, -0.5])
    # DAPO's formula is linear, not clipped, past max_len.
    np.testing.assert_allclose(overlong_penalty(np.array([8192 + 512]), 8192, 1024), [-1.5])


def test_overlong_penalty_jax_in_jax_out():
    import jax.numpy as jnp

    out = overlong_penalty(jnp.array([7168, 7680, 8192]), 8192, 1024)
    assert type(out).__module__.startswith("jax")
    np.testing.assert_allclose(np.asarray(out), [0.0, -0.5, -1.0])


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError):
        overlong_penalty(np.array([1]), 100, 0)
    with pytest.raises(ValueError):
        overlong_penalty(np.array([1]), 100, 200)


@given(st.lists(st.integers(0, 8192), min_size=1, max_size=32))
def test_overlong_penalty_bounds(lengths):
    pen = overlong_penalty(np.array(lengths), 8192, 1024)
    assert np.all(pen <= 0) and np.all(pen >= -1)
    assert np.all(pen[np.array(lengths) <= 7168] == 0)


def test_shaped_rewards_keeps_accuracy_apart():
    out = shaped_rewards(np.array([1, 0, 1, 0]), np.array([100, 100, 7680, 8192]), max_len=8192, buffer=1024)
    np.testing.assert_array_equal(out.accuracy, [1, 0, 1, 0])
    np.testing.assert_allclose(out.reward, [1.0, 0.0, 0.5, -1.0])
    accuracy, reward = out
    assert accuracy is out.accuracy and reward is out.reward
