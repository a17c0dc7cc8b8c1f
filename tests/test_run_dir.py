"""Who may write a run directory: a new run is refused one that holds an earlier run's records, and a live run's lock
holds whatever is done to its lock file. Nothing here trains: each refusal comes before the model loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from run_fixtures import PAPER_CONFIG, one_line

from lspo_jax.job import cli
from lspo_jax.job.run_dir import run_records
from lspo_jax.job.run_lock import LOCK_NAME, RunLock

# Another process taking the lock of the directory argv[1]: exit 0 when it got it, else the refusal's traceback.
TAKE = "import sys; from lspo_jax.job.run_lock import RunLock; RunLock(sys.argv[1]).close()"
# Another process holding the lock until it is killed, "held" printed once it has it.
HOLD = (
    "import sys, time; from lspo_jax.job.run_lock import RunLock; RunLock(sys.argv[1]); print('held', flush=True); "
    "time.sleep(120)"
)


def take(out: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TAKE, out], capture_output=True, text=True, timeout=60)


def write_files(out, contents: dict[str, str]) -> None:
    for name, text in contents.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# ------------------------------------------------------------------------------ an earlier run's records
NO_CHECKPOINT = "and no checkpoint to resume from: choose another --out, or remove them to start a new run there"


@pytest.mark.parametrize(
    "records, refusal",
    [
        ({"metrics.jsonl": '{"kind": "train", "step": 1}\n', "summary.json": "{}", "config.yaml": "steps: 1\n"},
         f"already holds a run's records (config.yaml, metrics.jsonl, summary.json) {NO_CHECKPOINT}"),
        ({"tensorboard/events.out.tfevents.1.host": "events"},
         f"already holds a run's records (tensorboard/) {NO_CHECKPOINT}"),
        ({"config.yaml": "steps: 4\n", "checkpoints/4/state": "arrays"},
         "already holds a run (config.yaml, checkpoints/; checkpoint at step 4): pass --resume to continue it, or "
         "choose another --out"),
    ],
)  # fmt: skip
def test_a_new_run_is_refused_a_directory_holding_an_earlier_runs_records(tmp_path, capsys, records, refusal):
    """Its checkpoints deleted for space, or stopped before the first: a new run once replaced the records without
    a word, and TensorBoard showed both runs as one. With a checkpoint, the line says ``--resume`` continues it."""
    out = tmp_path / "run"
    write_files(out, records)
    assert cli.train_main(["--config", PAPER_CONFIG, "--out", str(out)]) == 2
    err = one_line(capsys, "lspo-train")
    assert err.strip().splitlines()[-1] == f"lspo-train: --out {out} {refusal}"
    for name, text in records.items():
        assert (out / name).read_text() == text  # byte for byte
    assert sorted(os.listdir(out)) == sorted({LOCK_NAME, *(name.split("/")[0] for name in records)})


def test_what_a_failed_start_leaves_is_no_record(tmp_path):
    """A run that stopped before its config was written leaves its lock, the model cache, the checkpointer's empty
    folder and perhaps plots: a new run may take the directory."""
    out = tmp_path / "run"
    write_files(out, {LOCK_NAME: "pid 1 on host", "cache/model.json": "{}", "eval_curves.png": "png"})
    (out / "checkpoints").mkdir()
    (out / "tensorboard").mkdir()
    assert run_records(str(out)) == []
    write_files(out, {"wandb_id": "0123", "checkpoints/4/state": "arrays"})  # W&B would continue the earlier run
    assert run_records(str(out)) == ["wandb_id", "checkpoints/"]


# ----------------------------------------------------------------------------- the lock and its file
def test_deleting_the_lock_file_does_not_let_a_second_writer_in(tmp_path):
    """The lock belongs to an inode: once, deleting the file a live run held let a second run lock a new one, both
    exiting 0 with the first run's later steps overwritten."""
    out = str(tmp_path)
    path = os.path.join(out, LOCK_NAME)
    lock = RunLock(out)
    try:
        os.remove(path)
        refused = take(out)
        assert refused.returncode == 1
        assert f"FileExistsError: --out {out} is being written by another run (" in refused.stderr, refused.stderr
        lock.check()  # what the live run does before each write: its file is back, saying who holds it
        with open(path) as f:
            assert f.read().startswith(f"pid {os.getpid()} on ")
        os.remove(path)
        with open(path, "w") as f:  # replaced, not removed: the same
            f.write("stale")
        refused = take(out)
        assert refused.returncode == 1 and f"{out} is being written by another run" in refused.stderr
    finally:
        lock.close()
    assert take(out).returncode == 0  # once the run has ended, the next one takes the directory


def test_a_run_stops_before_writing_when_its_directory_is_taken(tmp_path):
    """Where the directory's lock is only one machine's (NFS), a run on another host can take a re-created lock file;
    the live run then stops before its next write rather than writing beside it. Here the other host is a process
    holding the file's lock alone."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    path = os.path.join(out, LOCK_NAME)
    other = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
             "os.write(fd, b'pid 7 on elsewhere'); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
             "time.sleep(120)")  # fmt: skip
    lock = RunLock(out)
    try:
        os.remove(path)
        holder = subprocess.Popen([sys.executable, "-c", other, path], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline() == "held\n"
            with pytest.raises(FileExistsError, match=r"another run \(pid 7 on elsewhere\) took the directory"):
                lock.check()
        finally:
            holder.kill()
            holder.wait()
        shutil.rmtree(out)  # the whole directory removed and made anew under the run
        os.makedirs(out)
        with pytest.raises(FileExistsError, match=f"--out {out} was removed or replaced while this run was writing"):
            lock.check()
    finally:
        lock.close()


def test_a_resume_beside_a_live_run_is_refused_after_its_lock_file_is_deleted(tmp_path, capsys):
    """What a user does taking the lock for a stale one: ``rm .lspo-train.lock``, then ``lspo-train --resume``. The
    directory has what a resume reads first (a checkpoint step, the run's config.yaml), so the lock is what refuses."""
    out = tmp_path / "run"
    write_files(out, {"metrics.jsonl": '{"kind": "train", "step": 1}\n', "checkpoints/1/state": "arrays"})
    shutil.copyfile(PAPER_CONFIG, out / "config.yaml")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        os.remove(out / LOCK_NAME)
        for argv in (["--out", str(out), "--resume"], ["--config", PAPER_CONFIG, "--out", str(out)]):
            assert cli.train_main(argv) == 2
            assert f"lspo-train: --out {out} is being written by another run (" in one_line(capsys, "lspo-train")
    finally:
        holder.kill()
        holder.wait()
    assert (out / "metrics.jsonl").read_text() == '{"kind": "train", "step": 1}\n'
    assert sorted(os.listdir(out / "checkpoints")) == ["1"]
