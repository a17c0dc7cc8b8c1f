"""Dynamic sampling's draw on data with little signal, driven with a stub learner (no model): it says where it is as
the rounds go by, from the writing process only, and holds the rows of a bounded number of rounds however many it
draws, with the batch they would have given."""

from __future__ import annotations

import contextlib
import types
import weakref

import jax
import numpy as np

from lspo_jax.job.config import load_config
from lspo_jax.rl.rounds import DynamicSamplingPrompts

K, B = 2, 4  # rollouts a prompt, groups a batch


class StubLearner:
    """Samples nothing: only prompts 0, 1 and 2 get a group with a signal (slot 0 passes, slot 1 fails), every other
    group fails in both slots. Keeps a weak reference to each round's rows, to count those still held."""

    def __init__(self, step: int):
        self.state = types.SimpleNamespace(step=step)
        self.rounds: list[weakref.ref] = []
        self.held: list[int] = []  # before each round's scoring: earlier rounds whose rows are still held

    def sample(self, prompt_ids, key, lora_scale):
        return {"tokens": np.array([ids for ids in prompt_ids for _ in range(K)], np.int32)}

    def score(self, rows, examples):
        self.held.append(sum(ref() is not None for ref in self.rounds))
        signal = [ex.answer in ("0", "1", "2") for ex in examples]
        accuracy = np.array([float(s and slot == 0) for s in signal for slot in range(K)], np.float32)
        self.rounds.append(weakref.ref(accuracy))
        return {**rows, "accuracy": accuracy}


def draw(max_rounds: int, step: int = 11):
    overrides = {"dynamic_sampling": "true", "max_draw_rounds": max_rounds, "prompts_per_step": B, "group_size": K}
    run = load_config(None, [f"rollout.{key}={value}" for key, value in overrides.items()] + ["data.shuffle=false"])
    examples = [types.SimpleNamespace(prompt_ids=[i], answer=str(i), solution_ids=None) for i in range(200)]
    learner = StubLearner(step)
    phases = lambda name, **kwargs: contextlib.nullcontext()  # noqa: E731
    return DynamicSamplingPrompts(run, examples).next_batch(learner, jax.random.key(0), phases), learner


def test_a_long_draw_says_where_it_is_from_the_writing_process(capsys, monkeypatch):
    # Round 1 draws prompts 0-3 and keeps 0, 1, 2; every later round draws the shortfall, one prompt without a signal
    # (4, 5, 6, ...), until the bound. The lines come before rounds 5, 10, 20, 30 and 40.
    draw(max_rounds=45)
    assert capsys.readouterr().err.splitlines() == [
        f"lspo-train: step 12: dynamic sampling round {r} of 45, 3 of {B} groups with a signal so far"
        for r in (5, 10, 20, 30, 40)
    ]
    draw(max_rounds=4)  # rounds 1-4: below the first line
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(jax, "process_index", lambda: 1)  # another host of the job: the same rounds, no line
    draw(max_rounds=45)
    assert capsys.readouterr().err == ""


def test_a_long_draw_holds_a_bounded_share_of_its_rows():
    batch, learner = draw(max_rounds=45)  # as above: 45 rounds, 48 prompts, 3 of them with a signal
    assert batch.record.rounds == 45 and len(batch.record.indices) == 48 and int(batch.record.usable.sum()) == 3
    # The batch: the three with a signal, filled with the first dropped group (prompt 3), its rows those sampled.
    assert [ex.prompt_ids[0] for ex in batch.examples] == [0, 1, 2, 3]
    np.testing.assert_array_equal(batch.rows["tokens"][:, 0], np.repeat([0, 1, 2, 3], K))
    np.testing.assert_array_equal(batch.rows["accuracy"], [1, 0, 1, 0, 1, 0, 0, 0])
    # The dropped groups of rounds 1-4 (prompts 3, 4, 5, 6) are a batch's worth of fillers: from round 5 on, a round
    # without a signal is let go once scored, so at most those four rounds' rows are ever held, not 44.
    assert max(learner.held) == 4 and learner.held[-1] == 4
