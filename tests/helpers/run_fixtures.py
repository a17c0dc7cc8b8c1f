"""Fixtures and helpers of the training-loop tests (test_step_scaffold.py, test_run_resume.py, test_run_failures.py,
test_method_runs.py, test_staleness.py): the tiny random policy, eight addition rows, a config maker with the shapes
every run shares, a fake verifier that places the cliffs, and a trained run to read.

Every run has the same shapes (2 prompts x 2 rollouts, 12 new tokens, 16 prompt slots: ``make_config``), and the
jitted steps take only the config sections they read as static arguments, so the sampler, log-prob and update
programs compile once per process. The fake verifier decides which rollouts pass, so each test places the cliffs
where it needs them.

Registered from conftest.py (``pytest_plugins``), so the fixtures are session-scoped and each xdist worker builds
them at most once; the tests only read what they return (a test that changes a run's directory copies it first).
The plain functions and classes are imported by name: ``from run_fixtures import ...``.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib

import jax
import numpy as np
import pytest

from lspo_jax.job import compiles, toy_model
from lspo_jax.job import run as run_module
from lspo_jax.job.config import load_config
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run import Run
from lspo_jax.rl.checkpoint import checkpoint_state
from lspo_jax.rollout.generator import Generator
from lspo_jax.tasks import toy

K = 2  # rollouts per prompt in every run of the training-loop tests
LONG_PROBLEM = "+".join("123456789") + "="  # 18 characters and BOS: over make_config's 16 prompt slots
# What a user passes to lspo-train for a new run: the paper's recipe, its paths overridden.
PAPER_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "lspo_deepmath_r1_distill_qwen_1p5b.yaml")


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
    call of the run (rollouts, re-rolls, validation) goes through its learner's generator, or for rollouts sampled
    on devices of their own (``rollout.placement: split``) the sampler's."""

    def flag(*args, lora_scale=0.0, **kwargs):
        verifier.adapter_on = lora_scale > 0

    sampling = job.prefetcher.sampling
    for generator in {job.learner.generator, sampling and sampling.generator} - {None}:
        wrap(generator, "generate", before=flag)


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return toy_model.ensure_model(str(tmp_path_factory.mktemp("policy") / "toy"), steps=0)


def addition_rows() -> list[dict]:
    rows = toy.addition_rows(8, (2, 2), seed=0)
    assert len({row["answer"] for row in rows}) == len(rows)  # the fake verifiers tell prompts apart by gold
    return rows


def rule_of(easy: set[str]):
    """Rows whose gold is in ``easy`` pass in slot 0, the others never (``easy_rule``)."""
    return lambda response, gold, slot: gold in easy and slot == 0


EASY_ROWS = (1, 2, 5, 6)


@pytest.fixture(scope="session")
def train_rows():
    return addition_rows()


@pytest.fixture(scope="session")
def train_file(tmp_path_factory, train_rows) -> str:
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", train_rows)


@pytest.fixture(scope="session")
def easy_answers(train_rows):
    return {train_rows[i]["answer"] for i in EASY_ROWS}


@pytest.fixture(scope="session")
def easy_rule(easy_answers):
    """Batches are rows (0, 1), (2, 3), ... (no shuffling). Rows 1, 2, 5, 6 pass in slot 0, the others never,
    so every step has one cliff and one mixed group, the cliff first in odd steps and second in even ones."""
    return rule_of(easy_answers)


def hash_rule(response, gold, slot):
    return zlib.crc32(response.encode()) % 2 == 0


def config_maker(model_dir: str, train_file: str):
    """``make_config`` outside pytest (a script of its own process): the same configs from these paths."""

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


@pytest.fixture(scope="session")
def make_config(model_dir, train_file):
    """A run config with the shapes every run shares; keyword arguments are overrides, ``__`` for ``.``."""
    return config_maker(model_dir, train_file)


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


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, make_config, train_file, easy_rule):
    """4 uninterrupted steps, checkpoints at 2 and 4, validation on two training prompts before and after."""
    out = str(tmp_path_factory.mktemp("trained"))
    job = run_steps(make_config(steps=4, eval__benchmarks=[train_file]), out, easy_rule)
    return {"dir": out, "job": job, "state": copy_tree(checkpoint_state(job.state.params, job.state.opt_state))}


# ------------------------------------------------------------------------------ console entry points
def one_line(capsys, prog: str) -> str:
    """stderr of a refused command: no traceback, and the refusal on a line of its own naming the command."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and any(line.startswith(f"{prog}: ") for line in err.splitlines()), err
    return err


def too_long_rows(n: int) -> list[dict]:
    """``n`` benchmark rows ``p0, p1, ...`` whose prompt is over make_config's prompt slots."""
    return [{"id": f"p{i}", "problem": LONG_PROBLEM, "answer": "45", "solution": "\\boxed{45}"} for i in range(n)]


@contextlib.contextmanager
def cli_verifier(monkeypatch, rule):
    """lspo-train's verifier replaced by a FakeVerifier (re-rolls scored by ``hash_rule``); the run is
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
