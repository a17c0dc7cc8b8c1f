"""The Python API: docs/python.md's code blocks run as written (so the page cannot rot), ``lspo_jax.train`` writes
the records ``lspo-train`` writes for the same config and seed, and reward functions given as callables become
import paths (a lambda is refused in one line)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from run_fixtures import train_records

import lspo_jax
from lspo_jax.job import cli
from lspo_jax.job.api import function_path
from lspo_jax.job.config_io import to_dict
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.train_config import ConfigError

pytestmark = pytest.mark.slow  # whole training runs

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "python.md"


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def test_the_pages_code_blocks_run(tmp_path, monkeypatch):
    for folder in ("configs", "examples"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(PAGE)
    assert len(blocks) == 4, "the page's blocks changed: update what this test checks after each"
    namespace: dict = {"__name__": "docs_python"}
    exec(compile(blocks[0], "python.md block 1", "exec"), namespace)  # a whole run
    assert namespace["summary"]["steps"] == 2 and (tmp_path / "runs/python_demo/summary.json").exists()
    exec(compile(blocks[1], "python.md block 2", "exec"), namespace)  # reward functions and a callback
    train = namespace["train_records"]
    assert namespace["summary"]["stopped_early"] and len(train) == 1  # the callback's True stopped it at step 1
    assert 0 <= train[0]["reward/format"] <= 1 and "reward/math_verify" in train[0]
    saved = yaml.safe_load((tmp_path / "runs/python_rewards/config.yaml").read_text())
    assert saved["reward"]["functions"][1]["fn"] == "examples.format_reward:boxed_once"  # the command can resume
    exec(compile(blocks[2], "python.md block 3", "exec"), namespace)  # a loop of one's own
    assert set(namespace["results"]) >= {"toy_heldout_3digit"} and (tmp_path / "runs/my_loop/checkpoints").is_dir()
    exec(compile(blocks[3], "python.md block 4", "exec"), namespace)  # the loss math
    # One cliff group (advantages 0) and one of A = +-1/(std([1, 0]) + 1e-6) = +-0.7071; ratios 1.2 on the positive
    # row's first token (not clipped: 1.2 < 1.28) and 0.8 on the negative's (at the clip's edge 1 - 0.2).
    assert namespace["metrics"]["clip_frac_high"] == 0.0


def test_train_writes_the_records_the_command_writes(tmp_path, make_config, train_file):
    config = make_config(steps=2, eval__every=1, eval__benchmarks=[train_file])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    assert cli.train_main(["--config", str(path), "--out", str(tmp_path / "command"), "--no-plots"]) == 0
    summary = lspo_jax.train(path, out=tmp_path / "python", plots=False)
    assert summary["steps"] == 2
    command, python = train_records(tmp_path / "command"), train_records(tmp_path / "python")
    assert len(command) == 2 and command == python
    evals = [[r for r in read_metrics(os.path.join(d, "metrics.jsonl")) if r["kind"] == "eval"]
             for d in (tmp_path / "command", tmp_path / "python")]  # fmt: skip
    assert len(evals[0]) == 3 and evals[0] == evals[1]
    assert (tmp_path / "python/config.yaml").read_text() == (tmp_path / "command/config.yaml").read_text()


def module_level_reward(completions, **columns):
    return [0.0 for _ in completions]


def test_callables_become_paths_and_a_lambda_is_refused():
    assert function_path(module_level_reward) == f"{__name__}:module_level_reward"
    with pytest.raises(ConfigError, match=r"^reward_functions: .* define it at the top level of a module or a \.py"):
        lspo_jax.load_config(None, reward_functions=[lambda completions, **columns: [1.0]])
    config = lspo_jax.load_config(None, reward_functions=[{"fn": module_level_reward, "weight": 0.5}])
    (entry,) = config.reward.functions
    assert (entry.fn, entry.name, entry.weight) == (f"{__name__}:module_level_reward", "module_level_reward", 0.5)
