"""A stop (SIGTERM or Ctrl-C) during any long phase of a run ends it promptly and says so at once: the warm-up, the
validation, the coverage pass, a step's phases, the first-mistake judge's batches and L2RR's target scores, each
stopped in the middle (the signal sent from inside the phase, so the handler runs there); and ``lspo-eval``,
interrupted in its own process at several moments, exits 130 every time. Never a run trained to the end, never
more than 30 s from the signal, never silent."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from run_fixtures import run_steps, wrap, write_jsonl

from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run_dir import run_records
from lspo_jax.job.signals import StartupStopped, StopFlag
from lspo_jax.rl import warmup

pytestmark = pytest.mark.slow  # stops at each phase of whole runs

PROMPT = 30.0  # seconds from a stop to the end of the run


class Kill:
    """Send this process SIGTERM at the ``at``-th call of what it wraps (1-based), and note when."""

    def __init__(self, at: int = 1, when=lambda *args, **kwargs: True):
        self.at, self.when, self.calls, self.sent = at, when, 0, None

    def __call__(self, *args, **kwargs):
        if not self.when(*args, **kwargs):
            return
        self.calls += 1
        if self.calls == self.at:
            self.sent = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)


def stopped_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("lspo-train: SIGTERM received, stopping ")]
    assert len(lines) == 1, err  # said once, whatever the number of points that saw the flag
    return lines[0]


def test_a_stop_during_the_warm_up_ends_it_at_its_next_update_and_keeps_nothing(tmp_path, make_config, easy_rule,
                                                                                 monkeypatch, capsys):  # fmt: skip
    kill, real = Kill(at=2), warmup.sft_batch  # as the second of its updates is made: it ends after that one

    def batch_then_kill(*args):
        kill()
        return real(*args)

    monkeypatch.setattr(warmup, "sft_batch", batch_then_kill)
    out = str(tmp_path / "run")
    config = make_config(scaffold__supervise="sft_warmup", scaffold__warmup_tokens=200, steps=2)
    with pytest.raises(StartupStopped, match=r"stopped during the SFT warm-up \(after 2 updates, \d+ of its 200 "):
        run_steps(config, out, easy_rule)
    assert time.perf_counter() - kill.sent < PROMPT
    assert "after the SFT warm-up's current update: the warm-up is not saved" in stopped_line(capsys.readouterr().err)
    # Nothing of it kept, nor anything that refuses the same command: the warm-up is done again whole.
    assert run_records(out) == []


# (moment, config overrides, at which generate call of the run, what the stop's line says it waits for). With
# validation on, its call comes first at step 0 (2 samples a problem), then the coverage pass's (4 a problem).
MOMENTS = [
    ("validation at step 0", {}, lambda job, kw: job.state.step == 0, "after validation's current batch at step 0"),
    ("coverage pass at step 0", {"eval__coverage_n": 4}, lambda job, kw: kw["n"] == 4,
     "after validation's current batch at step 0"),
    ("step 1's sampling", {"eval__benchmarks": []}, lambda job, kw: True, "at step 1's next phase"),
    ("validation at the end", {}, lambda job, kw: job.state.step == 2, "after validation's current batch at step 2"),
]  # fmt: skip


@pytest.mark.parametrize("moment, more, when, said", MOMENTS, ids=[m[0] for m in MOMENTS])
def test_a_stop_in_a_long_phase_ends_the_run_promptly_with_a_checkpoint(tmp_path, make_config, train_file, easy_rule,
                                                                        capsys, moment, more, when, said):  # fmt: skip
    config = make_config(steps=2, **{"eval__benchmarks": [train_file], **more})
    out, kill = str(tmp_path / "run"), None

    def prepare(job):
        nonlocal kill
        kill = Kill(when=lambda *args, **kwargs: when(job, kwargs))
        wrap(job.learner.generator, "generate", before=kill)

    job = run_steps(config, out, easy_rule, prepare=prepare)
    assert kill.sent is not None, f"{moment}: the moment never came"
    assert time.perf_counter() - kill.sent < PROMPT
    assert job.summary["stopped_early"], moment
    assert said in stopped_line(capsys.readouterr().err), moment
    step = job.summary["steps"]
    assert job.checkpointer.latest_step() == step
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert not [r for r in records if r["kind"] == "eval" and r["step"] == step]  # validated again on resuming


def test_a_stop_is_said_while_the_main_thread_is_inside_native_code():
    """Python runs a handler between bytecodes: while the main thread waits on XLA (a compile, a long decode) the
    handler waits too. The flag's watcher reads the signal's wakeup byte and speaks then."""
    busy = jax.jit(lambda n: jax.lax.fori_loop(0, n, lambda i, v: v * 0.999999 + 1e-6, np.float32(1.0)))
    busy(1).block_until_ready()  # compiled first: the call below only runs
    start = time.perf_counter()
    busy(20_000_000).block_until_ready()
    count = int(20_000_000 * 1.5 / max(time.perf_counter() - start, 1e-3))  # about 1.5 s on this machine
    written = []

    class Stderr:
        def write(self, text):
            written.append((time.perf_counter(), text))

        def flush(self):
            pass

    real, sys.stderr = sys.stderr, Stderr()
    try:
        with StopFlag("prog") as stop:
            stop.expect("after the busy call")
            timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))
            start = time.perf_counter()
            timer.start()
            busy(count).block_until_ready()
            returned = time.perf_counter()
            timer.join()
    finally:
        sys.stderr = real
    said = [(t, text) for t, text in written if "SIGTERM received, stopping after the busy call" in text]
    assert stop.requested and len(said) == 1, written
    assert returned - start > 0.6, "the busy call no longer outlasts the signal: lengthen it"
    assert said[0][0] < returned - 0.3, (said[0][0] - start, returned - start)  # said before the call returned


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LSPO_EVAL = os.path.join(os.path.dirname(sys.executable), "lspo-eval")


@pytest.mark.parametrize("marker", ["", ": sampling "])
def test_ctrl_c_during_lspo_eval_exits_130_every_time(tmp_path, marker):
    """The demo model on three MATH500 problems, interrupted a second after its start (imports, the model loading)
    or half a second after it says it samples (compiling, decoding): the command ends with 130, saying so at once,
    and once sampling had begun its --out says unfinished."""
    out = tmp_path / "results.json"
    argv = [LSPO_EVAL, "--model", "toy", "--benchmarks", "math500", "--limit", "8", "--n", "4", "--max-new-tokens",
            "64", "--out", str(out), "data.max_prompt_tokens=160"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    seen = []
    if marker:
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                break
    time.sleep(0.5 if marker else 1.0)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    output = "".join(seen) + proc.communicate(timeout=120)[0]
    assert time.perf_counter() - sent < PROMPT
    assert proc.returncode == 130, f"Ctrl-C after {marker!r}: exit {proc.returncode}\n{output[-3000:]}"
    assert "Traceback" not in output and "lspo-eval: interrupted" in output, output[-3000:]
    if marker:
        assert "lspo-eval: Ctrl-C received, stopping after the sampler's current decode segment" in output, output
        assert json.loads(out.read_text())["finished"] is False


def abandoned_at_step_1(job, out, capsys, sent: float, phase: str) -> None:
    """The run stopped within ``PROMPT`` of the signal, saying so once, with step 1 abandoned in its ``phase``: no
    train record, the checkpoint at step 0."""
    assert time.perf_counter() - sent < PROMPT
    err = capsys.readouterr().err
    assert "at step 1's next phase" in stopped_line(err)
    assert f"stop requested during the step's {phase} phase: step 1 abandoned" in err, err
    assert job.summary["stopped_early"] and job.summary["steps"] == 0
    assert job.checkpointer.latest_step() == 0
    assert not [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "train"]


def test_a_stop_during_the_first_mistake_judge_abandons_the_step_after_its_batch(tmp_path, make_config, monkeypatch,
                                                                                 capsys):  # fmt: skip
    """Slot 0 of each group fails: step 1 sends the judge two rollouts, one a batch (``max_batch: 1``). A stop during
    the first batch ends the judging before the second and abandons the step before its update."""
    from lspo_jax.job import build, toy_model
    from lspo_jax.methods.first_mistake import strategy
    from lspo_jax.methods.first_mistake.teacher import Judge
    from lspo_jax.tasks import toy

    config = make_config(
        model__path=toy_model.model_dir(str(tmp_path / "cache")), reward__overlong_factor=0.0, scaffold__enabled=False,
        rollout__max_new_tokens=32, eval__benchmarks=[],  # the warm-started model ends its rollouts within 32 tokens
        first_mistake={"enabled": True, "reference": "ground_truth", "sentence_breaks": ";", "max_batch": 1},
    )  # fmt: skip
    kill, batches = Kill(), []

    def judge(texts):
        batches.append(len(texts))
        kill()
        return [toy.first_mistake_judge(t) for t in texts]

    scripted = functools.partial(strategy.make_token_advantages, judge=Judge(judge, max_batch=1))
    monkeypatch.setitem(build.ADVANTAGE_METHODS, "first_mistake", scripted)
    out = str(tmp_path / "run")
    job = run_steps(config, out, lambda response, gold, slot: slot == 1)
    assert batches == [1], batches  # the second batch never asked
    abandoned_at_step_1(job, out, capsys, kill.sent, "judge")


@pytest.mark.parametrize("lookahead", [False, True], ids=["scores before the update", "look-ahead after it"])
def test_a_stop_during_the_l2rr_target_scores(tmp_path, make_config, capsys, monkeypatch, lookahead):
    """SIGTERM as the target's gradient is taken (the first piece of the scores). Before the update the step is
    abandoned at the next piece; with ``lookahead`` the scores come after the update, which cannot be undone: the step
    is finished and recorded, and the run stops with its checkpoint."""
    from lspo_jax.methods.l2rr import target as l2rr_target
    from lspo_jax.tasks import toy

    target = write_jsonl(tmp_path / "target.jsonl", toy.target_rows(4))
    config = make_config(
        rollout__group_size=4, scaffold__sft_steps=1, data__limit=2, reward__overlong_factor=0.0, eval__benchmarks=[],
        l2rr={"enabled": True, "target": target, "g_min": 2, "rho_min": 0.25, "p_e": 0.5, "a": 2.0,
              "lookahead": lookahead},
    )  # fmt: skip
    kill, real = Kill(), l2rr_target.sharded_target_gradient

    def gradient_then_kill(*args, **kwargs):
        program = real(*args, **kwargs)
        return lambda *inputs: (program(*inputs), kill())[0]

    monkeypatch.setattr(l2rr_target, "sharded_target_gradient", gradient_then_kill)
    out = str(tmp_path / "run")
    job = run_steps(config, out, lambda response, gold, slot: slot == 0)
    assert kill.sent is not None
    if not lookahead:
        abandoned_at_step_1(job, out, capsys, kill.sent, "update")
        return
    assert time.perf_counter() - kill.sent < PROMPT
    assert "a step whose update has begun is finished first" in stopped_line(capsys.readouterr().err)
    assert job.summary["stopped_early"] and job.summary["steps"] == 1 and job.checkpointer.latest_step() == 1
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1]
