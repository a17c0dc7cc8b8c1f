"""First-mistake advantages as the step's token-advantages strategy (``rl.train.TokenAdvantages``), built from the
run's ``first_mistake`` section by ``make_token_advantages``: the one line the run's builder has for this method."""

from __future__ import annotations

from typing import Any

import numpy as np

from lspo_jax.methods.first_mistake import teacher
from lspo_jax.methods.first_mistake.advantages import first_mistake_advantages
from lspo_jax.methods.first_mistake.config import FirstMistakeConfig
from lspo_jax.tasks import toy
from lspo_jax.train_config import TrainConfig


class JudgedAdvantages:
    """``[rows, length]`` first-mistake token advantages of the (spliced) batch and the judge's metrics, timed as
    the step's ``judge`` phase.

    A teacher names the first wrong sentence of each failed rollout in a mixed group; see ``advantages``.
    When the policy judges itself (``judge_path: null``) it judges with this step's weights.
    """

    phase = "judge"
    checks_stop = True  # called with ``check``, between the teacher's batches (``train.TokenAdvantages``)

    def __init__(self, judge: teacher.Judge, config: FirstMistakeConfig):
        self.judge, self.config = judge, config

    def __call__(self, learner: Any, rows: Any, examples: list[Any], outcome: np.ndarray, valid=None, check=None):
        run = learner.run
        slots = run.data.max_prompt_tokens
        response_ids = [
            t[slots : slots + int(n)].tolist() for t, n in zip(rows["tokens"], rows["lengths"], strict=True)
        ]
        truncated = (~rows["eos"]) & (rows["lengths"] >= run.rollout.max_new_tokens)
        return first_mistake_advantages(
            problems=[ex.problem for ex in examples], golds=[ex.answer for ex in examples],
            references=[ex.solution for ex in examples], response_texts=learner.decode(rows),
            response_ids=response_ids, response_mask=rows["mask"], truncated=truncated,
            accuracy=rows["accuracy"], outcome_adv=outcome, group_size=run.rollout.group_size,
            score=learner.verifier.score, judge=self.judge, tokenizer=learner.policy.tokenizer, config=self.config,
            valid=valid, check=check,
        )  # fmt: skip


def make_judge(run: TrainConfig, policy: Any, params: Any, mesh: Any = None) -> teacher.Judge:
    """The first-mistake judge of ``run``: ``judge_path: toy:judge`` is the demo task's scripted teacher
    (``toy.first_mistake_judge``), anything else goes to ``teacher.make_judge``."""
    if run.first_mistake.judge_path == "toy:judge":
        script = lambda prompts: [toy.first_mistake_judge(p) for p in prompts]
        return teacher.Judge(script, max_batch=run.first_mistake.max_batch)
    return teacher.make_judge(run.first_mistake, policy=policy, params=params, mesh=mesh)


def make_token_advantages(
    run: TrainConfig, policy: Any, params: Any, mesh: Any = None, judge: teacher.Judge | None = None
) -> JudgedAdvantages | None:
    """The strategy of a run with ``first_mistake.enabled`` (None otherwise), judged by ``judge`` or the one
    ``make_judge`` builds (``params``: the policy's weights, or a function returning its current ones)."""
    if not run.first_mistake.enabled:
        return None
    return JudgedAdvantages(judge or make_judge(run, policy, params, mesh), run.first_mistake)
