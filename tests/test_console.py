"""What a run prints: progress as plain lines where the output is not a terminal, the first step timed apart,
and no advice from transformers about PyTorch, which the JAX path never needs."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from lspo_jax.job import progress as progress_module
from lspo_jax.job.progress import Progress

METRICS = {"accuracy_mean": 0.25, "cliff_groups": 3, "surpassed_groups": 1}


class Clock:
    """A stand-in for ``time.perf_counter`` that the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_log_file_gets_plain_lines_every_few_steps_and_the_compile_step_apart(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    stream = io.StringIO()  # not a terminal, as a scheduler's log file
    bar = Progress(total=10, initial=0, stream=stream, every=4)
    clock.now = 30.0  # step 1 compiles: 30 s
    bar.step(1, METRICS)
    for step in range(2, 11):  # then 2 s a step
        clock.now += 2.0
        bar.step(step, METRICS)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "lspo: step 1 took 30.0 s, compilation included; the time left counts from the next step"
    assert [line.split(",")[0] for line in lines[1:]] == ["lspo: step 4/10", "lspo: step 8/10", "lspo: step 10/10"]
    # At step 8: 7 steps after the first took 14 s, so 2.00 s/step and 2 steps (4 s) left; the 30 s of step 1
    # would have made it 44 / 8 = 5.5 s/step.
    assert lines[2] == "lspo: step 8/10, acc 0.25, cliffs 3, rescued 1, 2.00 s/step, 0:00:04 left"


def test_the_first_step_says_what_it_compiled():
    stream = io.StringIO()
    bar = Progress(total=10, stream=stream)
    bar.step(1, {**METRICS, "compiles": 3, "compiles_cached": 21, "time_compile": 4.25})
    line = stream.getvalue().splitlines()[0]
    assert line.endswith(", 4.2 s of it compiling 3 programs, 21 read from the compile cache; the time left counts "
                         "from the next step"), line  # fmt: skip


def test_a_resumed_run_counts_from_its_checkpoint_and_a_disabled_one_prints_nothing():
    stream = io.StringIO()
    bar = Progress(total=10, initial=6, stream=stream)
    assert bar.every == 1  # (10 - 6) // 20 rounds to 0: a line every step
    bar.step(7, METRICS)
    bar.step(8, METRICS)
    assert stream.getvalue().splitlines()[-1].startswith("lspo: step 8/10, acc 0.25")
    quiet = io.StringIO()
    off = Progress(total=10, stream=quiet, enabled=False)
    off.step(1, METRICS)
    off.write("x")
    assert quiet.getvalue() == ""


# transformers' import as on a machine without torch (the demo's install): the finder refuses torch.
NO_TORCH = """
import importlib.util, sys
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "torch" else find_spec(name, *a, **k)
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_no_pytorch_advice_from_the_entry_points(quiet):
    quieted = "from lspo_jax.job import errors; errors._quiet_imports()\n" if quiet else ""
    code = NO_TORCH + quieted + "import transformers"
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stderr
    assert ("PyTorch was not found" in err) is not quiet  # without the entry point's setting it is printed


def test_vllm_log_lines_go_to_the_run_directory_and_only_errors_to_the_console(tmp_path, capsys, monkeypatch):
    import logging

    from lspo_jax.rollout.vllm_setup import route_logs

    for name in ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH"):  # restored after the test
        monkeypatch.setenv(name, "")
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])
    path = tmp_path / "vllm.log"
    route_logs(str(path))
    child = logging.getLogger("vllm.engine")  # vLLM's loggers are children of "vllm"
    child.info("engine started")
    child.warning("libtcmalloc is not found")
    child.error("engine died")
    for handler in vllm_logger.handlers:
        handler.flush()
    logged = path.read_text()
    assert "engine started" in logged and "libtcmalloc" in logged and "engine died" in logged
    err = capsys.readouterr().err
    assert "engine died" in err and "engine started" not in err and "libtcmalloc" not in err
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(tmp_path / "vllm_logging.json")  # the engine's own read
    for handler in vllm_logger.handlers:
        handler.close()


def test_the_lines_name_the_arm_a_dapo_run_is_not_called_lspo():
    from lspo_jax.job.config_io import load_config

    def name(*overrides):
        return progress_module.arm_name(load_config(None, list(overrides)).scaffold)

    assert (name(), name("scaffold.enabled=false"), name("scaffold.supervise=mixed")) == ("lspo", "dapo", "mixed")
    stream = io.StringIO()
    bar = Progress(total=2, stream=stream, name="dapo")
    bar.step(1, METRICS)
    bar.step(2, METRICS)
    assert {line.split(":")[0] for line in stream.getvalue().splitlines()} == {"dapo"}
