"""Reward functions as plug-ins (``reward.functions``): the weighed reward against hand-computed sums, the
correctness signal kept apart from it, failures in the verifier's worker pool counted and scored 0, bad paths
refused in one line, and a two-step run with the shipped examples and a function that raises and hangs."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
from run_fixtures import one_line, train_records

from lspo_jax.job import cli
from lspo_jax.job.config_io import load_config
from lspo_jax.job.run import Run
from lspo_jax.options import load_function
from lspo_jax.tasks.reward_functions import RewardFunction, Rewards
from lspo_jax.tasks.verify_pool import VerifierPool
from lspo_jax.train_config import ConfigError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FORMAT = f"{EXAMPLES / 'format_reward.py'}:boxed_once"
CONCISE = f"{EXAMPLES / 'length_reward.py'}:concise_correct"


@pytest.fixture
def user_file(tmp_path) -> Path:
    """A user's reward file outside the package: ``length`` (characters / 10), ``flaky`` (raises on completions
    holding a ``3``; hangs once per process, the first time it sees no marker file, so the pool's timeout kills it)
    and ``has_problem`` (1.0 when the row's problem reached it: the fields a function receives)."""
    marker = tmp_path / "hung_once"
    path = tmp_path / "user_rewards.py"
    path.write_text(
        textwrap.dedent(f"""
        import os, time

        def length(completions, **columns):
            return [len(c) / 10 for c in completions]

        def flaky(completions, answer, **columns):
            if not os.path.exists({str(marker)!r}):
                open({str(marker)!r}, "w").close()
                time.sleep(60)
            if "3" in completions[0]:
                raise ValueError("no threes")
            return [1.0]

        def has_problem(completions, problem, answer, **columns):
            return [float(bool(p) and bool(a)) for p, a in zip(problem, answer)]

        not_a_function = 3
    """)
    )
    return path


class GoldVerifier:
    """Passes a response that equals its gold: a verifier with known answers and no worker pool."""

    def score(self, responses, golds):
        return np.array([r == g for r, g in zip(responses, golds, strict=True)], np.float32)


def test_the_reward_is_the_weighed_sum_and_correctness_stays_the_verifiers(user_file):
    texts, golds = ["12", "123", "7"], ["12", "99", "7"]
    rewards = Rewards(GoldVerifier(), [RewardFunction("math_verify", "math_verify", 1.0),
                                       RewardFunction("length", f"{user_file}:length", 0.5)])  # fmt: skip
    scored = rewards.score(texts, golds)
    # correct by the verifier: 1, 0, 1; length/10: 0.2, 0.3, 0.1; reward = 1 * correct + 0.5 * length/10
    np.testing.assert_array_equal(scored.correct, [1, 0, 1])
    np.testing.assert_allclose(scored.reward, [1.1, 0.15, 1.05], rtol=1e-6)  # float32 of sums near 1
    assert scored.record() == pytest.approx({"reward/math_verify": 2 / 3, "reward/length": 0.2,
                                             "reward/math_verify_failed": 0, "reward/length_failed": 0})  # fmt: skip
    # The shaped sum never decides success: a wrong answer with a long text has reward > 0 and correct 0.
    assert scored.reward[1] > 0 and scored.correct[1] == 0


def test_a_function_marked_correctness_decides_success(user_file):
    rewards = Rewards(GoldVerifier(), [RewardFunction("length", f"{user_file}:length", 1.0, correctness=True)])
    scored = rewards.score(["1234", "123456"], ["x", "y"])  # lengths 0.4, 0.6: >= 0.5 is correct
    np.testing.assert_array_equal(scored.correct, [0, 1])


def test_the_pool_scores_a_raising_or_hung_call_zero_and_counts_it(user_file):
    said = []
    with VerifierPool(workers=1, timeout=2.0) as pool:
        rewards = Rewards(pool, [RewardFunction("flaky", f"{user_file}:flaky")], say=said.append)
        scored = rewards.score(["a", "b", "3", "c"], ["1", "1", "1", "1"])
    # "a" hangs (first call of the worker: killed at 2 s), "3" raises, "b" and "c" score 1.
    np.testing.assert_array_equal(scored.scores["flaky"], [0, 1, 0, 1])
    assert scored.failed == {"flaky": 2}
    assert len(said) == 1 and "failed on 2 of 4 completions" in said[0] and "ValueError" in said[0], said
    assert "timeout" in said[0]


def test_a_bad_path_is_one_line_naming_the_key(user_file, tmp_path, capsys):
    cases = {
        "nowhere_module:f": "cannot import nowhere_module",
        f"{user_file}:missing": "has no 'missing'",
        f"{user_file}:not_a_function": "is a int, not a function",
        f"{tmp_path / 'absent.py'}:f": "no such file",
        "no_colon": "must be package.module:function",
    }
    assert load_function("json:dumps")([1]) == "[1]"  # a module's function, imported by its dotted name
    for path, said in cases.items():
        with pytest.raises(ConfigError, match=r"^reward\.functions\[0\]\.fn: ") as err:
            load_config(None, [f'reward.functions=[{{fn: "{path}"}}]'])
        assert said in str(err.value) and "\n" not in str(err.value), err.value
    with pytest.raises(ConfigError, match="two functions are named length"):
        load_config(None, [f'reward.functions=[{{fn: "{user_file}:length"}}, {{fn: "{user_file}:length"}}]'])
    argv = ["--config", "configs/demo.yaml", "--out", str(tmp_path / "run"), 'reward.functions=[{fn: "nope:f"}]']
    assert cli.train_main(argv) == 2
    assert "reward.functions[0].fn: cannot import nope" in one_line(capsys, "lspo-train")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_shipped_examples_by_hand():
    boxed_once, concise = load_function(FORMAT), load_function(CONCISE)
    assert boxed_once(["1+2=3;\\boxed{3}", "\\boxed{3} \\boxed{3}", "3", "\\boxed{3"]) == [1.0, 0.0, 0.0, 0.0]
    # 1 word, correct: 1 - 0.5 * 1/200 = 0.9975; wrong: 0; 400 words, correct: 1 - 0.5 * min(1, 2) = 0.5
    long = "so " * 399 + "\\boxed{7}"
    assert concise(["\\boxed{7}", "\\boxed{8}", long], answer=["7", "7", "7"]) == pytest.approx([0.9975, 0, 0.5])


def test_two_steps_with_the_examples_and_a_failing_function(tmp_path, make_config, user_file):
    """The real verifier pool (one worker, 2 s a call) scores the toy model's rollouts with math-verify, the two
    shipped examples and the user's ``flaky`` and ``has_problem``; the run finishes, each function's mean is in every
    train record, ``flaky``'s hang and raises are counted there, and ``has_problem`` saw every row's fields."""
    functions = [{"fn": "math_verify"}, {"fn": FORMAT, "weight": 0.1, "name": "format"},
                 {"fn": CONCISE, "weight": 0.5, "name": "concise"}, {"fn": f"{user_file}:flaky", "weight": 0.0},
                 {"fn": f"{user_file}:has_problem", "weight": 0.0}]  # fmt: skip
    config = make_config(reward__functions=functions, reward__workers=1, reward__timeout_s=2.0, scaffold__enabled=False)
    out = str(tmp_path / "run")
    job = Run(config, out)
    try:
        job.train()
    finally:
        job.close()
    records = train_records(out)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for name in ("math_verify", "format", "concise", "flaky", "has_problem"):
            assert 0.0 <= record[f"reward/{name}"] <= 1.0 and f"reward/{name}_failed" in record, (name, record)
        assert record["reward/has_problem"] == 1.0 and record["reward/math_verify_failed"] == 0
        assert record["accuracy_mean"] == record["reward/math_verify"]  # correctness is the verifier's
    assert sum(r["reward/flaky_failed"] for r in records) >= 1  # the hang, at least
    assert os.path.exists(os.path.join(out, "summary.json"))
