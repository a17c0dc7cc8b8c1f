"""The step's stages: one set of names (the timer's, the step's docstring, docs/architecture.md) and the order
``train_step`` runs them in, with a fake learner that records which of its verbs ran in which stage."""

from __future__ import annotations

import contextlib
import re
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from lspo_jax.job.config import load_config
from lspo_jax.rl import corrections, losses, scaffold, train
from lspo_jax.rl.packing import Rows
from lspo_jax.rl.phases import Phases
from lspo_jax.rl.prompts import Draw

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, K, RESPONSE = 2, 2, 4  # group 0 has one passing rollout; group 1 is a cliff


def documented_stages(text: str, indent: str) -> list[str]:
    """The stage names of a stage table: a word at ``indent`` followed by two spaces or more."""
    return re.findall(rf"^{re.escape(indent)}([a-z]+) {{2,}}\S", text, re.MULTILINE)


def test_the_stages_have_one_name_set_in_the_code_the_docstring_and_the_docs():
    assert documented_stages(train.__doc__, "    ") == list(Phases.NAMES)
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert documented_stages(architecture, " │     ") == list(Phases.NAMES)


class RecordingPhases(Phases):
    """The step's timer, also keeping the stage each learner verb ran in."""

    def __init__(self):
        super().__init__()
        self.open: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str, *, check_stop: bool = True):
        assert name in self.NAMES, name
        self.open.append(name)
        try:
            with super().__call__(name, check_stop=check_stop):
                yield
        finally:
            self.open.pop()


class FakeLearner:
    """The verbs ``train_step`` calls, on numpy rows: rollouts pass only in group 0's first row, or with the
    adapter on; each call is logged with its stage and adapter scale."""

    def __init__(self, run, phases: RecordingPhases):
        self.run, self.phases, self.calls = run, phases, []
        self.vllm, self.verifier, self.token_advantages = None, None, None
        self.state = types.SimpleNamespace(step=0, nonfinite_total=0)
        self.estimator = losses.ESTIMATORS.resolve(run.loss.advantage)
        self.splice_variant = scaffold.SPLICE_VARIANTS.resolve(run.scaffold.splice)
        self.correction = corrections.CORRECTIONS.resolve(run.scaffold.correction)
        self.seen = []

    def _log(self, verb: str, scale: float | None = None) -> None:
        self.calls.append((verb, self.phases.open[-1] if self.phases.open else None, scale))

    def sample(self, prompts, key, *, lora_scale, n=None, temperature=None):
        self._log("sample", lora_scale)
        count, slots = len(prompts) * (n or K), self.run.data.max_prompt_tokens + self.run.rollout.max_new_tokens
        mask = np.zeros((count, slots), np.int32)
        mask[:, self.run.data.max_prompt_tokens :][:, :RESPONSE] = 1
        return Rows(tokens=np.ones((count, slots), np.int32), attention_mask=np.ones((count, slots), np.int32),
                    mask=mask, lengths=np.full(count, RESPONSE, np.int32), eos=np.ones(count, bool),
                    sampler_logp=np.zeros((count, slots), np.float32),
                    scale=np.full(count, lora_scale, np.float32))  # fmt: skip

    def score(self, rows, examples, *, per_row=False):
        self._log("score")
        self._seen(rows)
        passing = rows["scale"] > 0
        passing[0] = True
        return rows.replace(accuracy=passing.astype(np.float32), reward=passing.astype(np.float32))

    def _seen(self, rows) -> None:
        """Keep what a verb was given, and a copy of it: a later stage must not change it."""
        self.seen.append((rows, {name: np.array(value) for name, value in rows.items()}))

    def adapter_due(self) -> bool:
        return True

    def take_reward_failures(self) -> dict:
        return {}

    def reset_adapter(self, key) -> None:
        self._log("reset_adapter")

    def sft_step(self, batch):
        self._log("sft_step")
        return {"sft_loss": 0.5}

    def logprobs(self, rows, *, lora_scale, min_rows=1, temperature=None):
        self._log("logprobs", lora_scale)
        self._seen(rows)
        return np.where(rows["mask"] > 0, -1.0 - lora_scale, 0.0).astype(np.float32)

    def rl_step(self, batch, *, ends_step=True):
        self._log("rl_step")
        self._seen(batch)
        self.state.step += 1
        return {"loss": 0.1, "grad_norm": 1.0, "lr": 1e-3, "finite": True, "pad_fraction": 0.0}


def _examples():
    return [types.SimpleNamespace(prompt_ids=[5, 6, 7], answer="1", solution_ids=[8, 9, 10], problem="1+0",
                                  solution="1") for _ in range(PROMPTS)]  # fmt: skip


@pytest.mark.parametrize("judged", [False, True])
def test_train_step_runs_its_stages_in_the_documented_order(judged):
    overrides = [f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={K}", "scaffold.sft_steps=2",
                 "scaffold.min_cliff_bucket=1", f"first_mistake.enabled={str(judged).lower()}"]  # fmt: skip
    run = load_config(str(ROOT / "configs" / "demo.yaml"), overrides)
    phases = RecordingPhases()
    learner = FakeLearner(run, phases)

    class Judged:  # a token-advantages strategy, as a method gives the learner one
        phase = "judge"

        def __call__(self, learner_, rows, examples, outcome, valid=None):
            learner_._log("judge")
            return np.repeat(outcome[:, None], rows["mask"].shape[1], axis=1), {}

    learner.token_advantages = Judged() if judged else None
    result = train.train_step(learner, Draw(_examples(), jax.random.key(0)), phases)

    scale = run.scaffold.reroll_scale
    want = [("sample", "sample", 0.0), ("score", "reward", None),  # the batch
            ("reset_adapter", "sft", None), ("sft_step", "sft", None), ("sft_step", "sft", None),  # the cliff's adapter
            ("sample", "reroll", scale), ("score", "reward", None), ("logprobs", "logprob", scale),  # its re-rolls
            ("logprobs", "logprob", 0.0), *([("judge", "judge", None)] if judged else []),  # the whole batch
            ("rl_step", "update", None)]  # fmt: skip
    assert learner.calls == want
    # The stages in the order they first ran are the documented order (the judge's only when a teacher judges).
    first_seen = list(dict.fromkeys(stage for _, stage, _ in learner.calls))
    assert first_seen == [name for name in Phases.NAMES if judged or name != "judge"]
    # Every stage is timed in the record, 0 where it did not run; the cliff's re-rolls were spliced in.
    assert {k for k in result.metrics if k.startswith("time_") and k != "time_target"} == {
        f"time_{name}" for name in Phases.NAMES
    }
    assert (result.metrics["time_judge"] > 0) == judged
    assert result.metrics["cliff_groups"] == 1 and result.metrics["spliced_rows"] == K
    # The step's rows are a frozen record: what each verb was given holds, after the step, what it held then.
    # Fields: 7 sampled (the batch's, the re-rolls'), + accuracy and reward once scored, + adapter_logp once spliced;
    # the update's 5 (tokens, attention_mask, mask, old_logp, advantages).
    assert [len(seen) for seen, _ in learner.seen] == [7, 7, 9, 10, 5]
    for seen, copy in learner.seen:
        assert set(seen) == set(copy) and all(np.array_equal(seen[k], copy[k]) for k in copy)
    with pytest.raises(TypeError):
        learner.seen[0][0]["old_logp"] = np.zeros(1)  # type: ignore[index]
    with pytest.raises(ValueError, match="read-only"):  # nor can a field's values be written through the record
        learner.seen[-1][0]["mask"][0] = 0
