"""A stop (SIGTERM or Ctrl-C) during any long phase of a run ends it promptly and says so at once: the warm-up, the
validation, the coverage pass and a step's phases, each stopped in the middle (the signal sent from inside the phase,
so the handler runs there); and ``lspo-eval``, interrupted in its own process at several moments, exits 130 every
time. Never a run trained to the end, never more than 30 s from the signal, never silent."""

from __future__ import annotations

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
from run_fixtures import run_steps, wrap

from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run_dir import run_records
from lspo_jax.rl import warmup
from lspo_jax.signals import StartupStopped, StopFlag

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
