"""``tools.run_main``, the tools' error funnel: a user error is one line ``TOOL: what`` and exit 2 (the traceback
only with ``LSPO_JAX_DEBUG``), Ctrl-C exit 130, argparse's usage errors as they are, any other error a traceback."""

from __future__ import annotations

import argparse
import errno

import pytest

from lspo_jax.job.metrics_log import MetricsError
from lspo_jax.train_config import ConfigError
from tools import run_main


def raising(err: BaseException):
    def body(argv):
        raise err

    return body


@pytest.mark.parametrize(
    "err, line",
    [
        # A tool's ConfigError names its option itself: no "config error:" before it.
        (ConfigError("--seeds: 42 given twice; give each seed once"), "tool: --seeds: 42 given twice; give each"),
        (MetricsError("runs/x/metrics.jsonl: line 3 is not a JSON record"), "tool: runs/x/metrics.jsonl: line 3 is"),
        (FileNotFoundError("runs/x: not a training run"), "tool: runs/x: not a training run"),
        # The commands' own words for what the machine refused.
        (OSError(errno.ENOSPC, "No space left on device", "runs/x/summary.json"),
         "tool: cannot write runs/x/summary.json: No space left on device; free some space"),
    ],
)  # fmt: skip
def test_a_user_error_is_one_line_and_exit_2(err, line, monkeypatch, capsys):
    monkeypatch.delenv("LSPO_JAX_DEBUG", raising=False)
    assert run_main("tool", raising(err), []) == 2
    printed = capsys.readouterr().err
    assert printed.startswith(line) and printed.count("\n") == 1


def test_the_traceback_only_with_the_debug_variable(monkeypatch, capsys):
    monkeypatch.setenv("LSPO_JAX_DEBUG", "0")
    assert run_main("tool", raising(ConfigError("steps: must be positive")), []) == 2
    assert capsys.readouterr().err == "tool: steps: must be positive\n"
    monkeypatch.setenv("LSPO_JAX_DEBUG", "1")
    assert run_main("tool", raising(ConfigError("steps: must be positive")), []) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "ConfigError: steps: must be positive" in err
    assert err.endswith("\ntool: steps: must be positive\n")


def test_ctrl_c_is_exit_130_a_bug_its_traceback_a_status_as_it_is(capsys):
    assert run_main("tool", raising(KeyboardInterrupt()), []) == 130
    assert capsys.readouterr().err == "tool: interrupted\n"
    with pytest.raises(ZeroDivisionError):  # not the user's: the traceback shows where
        run_main("tool", raising(ZeroDivisionError("division by zero")), [])
    with pytest.raises(SystemExit) as stop:  # a stopped run's 75 passes
        run_main("tool", raising(SystemExit(75)), [])
    assert stop.value.code == 75

    def usage(argv):
        parser = argparse.ArgumentParser(prog="tool")
        parser.add_argument("--n", type=int)
        parser.parse_args(argv)

    with pytest.raises(SystemExit) as stop:  # argparse's usage error: its own message and 2
        run_main("tool", usage, ["--n", "x"])
    assert stop.value.code == 2 and "tool: error: argument --n: invalid int value: 'x'" in capsys.readouterr().err
    assert run_main("tool", lambda argv: None, []) == 0 and run_main("tool", lambda argv: 1, []) == 1
