"""``lspo-train`` as two processes of one job (one CPU device each, joined by ``jax.distributed``), as hosts run it.

The mesh spans both processes, so every gather of rollouts crosses them, and a SIGTERM reaching one process only
must still stop both at the same point: a process left inside a collective would hang. Restarted with
``--resume``, both restore their shards of the checkpoint and finish the run.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from lspo_jax.job.metrics_log import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # a job of two processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3  # stopped after step 1 or 2, so the resume has at least one step to run
TIMEOUT_S = 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def train_records(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in read_metrics(path) if r["kind"] == "train"]


def launch(out: str, port: int, process_id: int, *, resume: bool = False) -> subprocess.Popen:
    """``lspo-train`` as process ``process_id``; its output goes to a file beside ``out`` (a pipe nobody reads
    until the end could fill and block it)."""
    join = [f"mesh.coordinator=localhost:{port}", "mesh.num_processes=2", f"mesh.process_id={process_id}"]
    # The compile cache is the suite's (conftest's LSPO_JAX_CACHE): the resumed processes read back what the stopped
    # ones compiled, as a restarted job would.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    # No plots and no verifier processes: each would cost every start seconds that test nothing of the job's own.
    main = "from lspo_jax.job.cli import train_main; raise SystemExit(train_main())"
    cmd = [sys.executable, "-c", main, "--out", out, "--no-plots"]
    if resume:  # the run's own config.yaml, as a restarted job would
        cmd += ["--resume", *join]
    else:
        # Validation before and after, one problem a class: sampled and scored across both processes too.
        overrides = [f"steps={STEPS}", "eval.every=0", "eval.limit=1", "eval.n=2", "eval.ks=[1,2]",
                     "checkpoint.every=10", "rollout.prompts_per_step=4", "rollout.group_size=4",
                     "scaffold.sft_steps=4", "scaffold.min_cliff_bucket=4", "reward.workers=0"]  # fmt: skip
        cmd += ["--config", os.path.join(ROOT, "configs", "demo.yaml"), *overrides, *join]
    log = open(f"{out}.{'resume' if resume else 'run'}.{process_id}.log", "w")  # closed by finish()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Wait for every process (killing those still running at the deadline); their outputs."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    outputs = []
    for p in procs:
        p.log.close()
        with open(p.log.name) as f:
            outputs.append(f.read())
    return outputs


def checkpoint_steps(out: str) -> list[int]:
    return sorted(int(name) for name in os.listdir(os.path.join(out, "checkpoints")) if name.isdigit())


@pytest.fixture(scope="module")
def stopped_job(tmp_path_factory):
    """Two processes; once step 1 is logged, SIGTERM goes to process 1 alone."""
    out, port = str(tmp_path_factory.mktemp("job") / "run"), free_port()
    procs = [launch(out, port, i) for i in range(2)]
    start = time.monotonic()
    while not train_records(out) and time.monotonic() - start < TIMEOUT_S and all(p.poll() is None for p in procs):
        time.sleep(0.5)
    logged = bool(train_records(out))
    if logged:
        procs[1].send_signal(signal.SIGTERM)
    outputs = finish(procs, TIMEOUT_S - (time.monotonic() - start) if logged else 0)
    assert logged, "step 1 was never logged: " + outputs[0][-3000:]
    return {"out": out, "codes": [p.returncode for p in procs], "outputs": outputs}


def test_both_processes_stop_cleanly_at_the_same_step(stopped_job):
    assert stopped_job["codes"] == [75, 75], stopped_job["outputs"][1][-3000:]  # stopped, resumable
    steps = []
    for text in stopped_job["outputs"]:
        found = re.search(r"^steps (\d+) in [\d.]+ s \(stopped early\)$", text, re.MULTILINE)
        assert found, text[-3000:]
        steps.append(int(found.group(1)))
    assert steps[0] == steps[1] and 1 <= steps[0] < STEPS
    # Process 0 logged every finished step once, and checkpointed the last of them for a resume.
    assert [r["step"] for r in train_records(stopped_job["out"])] == list(range(1, steps[0] + 1))
    assert checkpoint_steps(stopped_job["out"]) == [steps[0]]


def test_rollouts_gathered_across_processes_are_whole(stopped_job):
    # Each process sampled its half of the rows; scoring and the update saw all of them (4 prompts x 4).
    assert all(record["rollouts"] == 4 * 4 for record in train_records(stopped_job["out"]))


def test_both_processes_resume_the_stopped_run_to_its_end(stopped_job):
    port = free_port()
    procs = [launch(stopped_job["out"], port, i, resume=True) for i in range(2)]
    outputs = finish(procs, TIMEOUT_S)
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:]
    # The whole run's time, and the resumed part's beside it.
    finished = rf"^steps {STEPS} in [\d.]+ s \([\d.]+ s since the resume\)$"
    assert all(re.search(finished, text, re.MULTILINE) for text in outputs), outputs[1][-3000:]
    # The resumed steps follow the stopped ones in the same log, none repeated or skipped.
    assert [r["step"] for r in train_records(stopped_job["out"])] == list(range(1, STEPS + 1))
    assert checkpoint_steps(stopped_job["out"])[-1] == STEPS
    assert not [name for name in os.listdir(stopped_job["out"]) if name.endswith(".png")]  # --no-plots, both runs
    # Validated across both processes before training (in the stopped run) and after it, each of the demo's classes.
    evals = [r for r in read_metrics(os.path.join(stopped_job["out"], "metrics.jsonl")) if r["kind"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [0, STEPS] and len(evals) == 2 * 4


def test_a_refused_lock_ends_every_process_in_one_line(tmp_path):
    """Another run holds the directory: process 0 is refused its lock, and process 1, which takes no lock, learns it
    from process 0 instead of waiting for it at the first collective."""
    from lspo_jax.job.run_lock import RunLock

    out = str(tmp_path / "run")
    os.makedirs(out)
    held = RunLock(out)  # this process is the other run
    try:
        port = free_port()
        procs = [launch(out, port, i) for i in range(2)]
        outputs = finish(procs, 120)
    finally:
        held.close()
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert f"--out {out} is being written by another run (pid {os.getpid()}" in outputs[0]
    assert "process 0 could not take the run's lock" in outputs[1]
    assert not any("Traceback" in text for text in outputs), outputs
    assert not os.path.exists(os.path.join(out, "config.yaml"))  # nothing of the refused run was written
