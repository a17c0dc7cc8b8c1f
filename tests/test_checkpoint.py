"""Checkpoints on their own: a damaged newest step falls back to the one before it, quietly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Saves steps 1 and 2 of a small state, cuts the largest file of step 2 to 100 bytes (a disk error, a copy cut
# short), then, in a fresh process as a resumed run would, restores the newest readable step. With this state the
# cut file holds more than one array, so several of orbax's reads fail (before the fix: 62 lines of tracebacks).
SCRIPT = textwrap.dedent(
    """
    import gc, os, sys, time
    import jax.numpy as jnp
    from lspo_jax.rl.checkpoint import Checkpointer

    directory, mode = sys.argv[1], sys.argv[2]
    state = {"base": {"w": jnp.arange(4096.0).reshape(64, 64), "b": jnp.ones(64)}, "rl_opt": {"m": jnp.zeros(64)}}
    checkpointer = Checkpointer(directory, keep=3)
    if mode == "make":
        checkpointer.save(1, state, {"step": 1})
        checkpointer.save(2, state, {"step": 2})
        files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(directory, "2")) for f in names]
        os.truncate(max(files, key=os.path.getsize), 100)
    else:
        _, meta, failures = checkpointer.restore_readable(state)
        print("restored", meta, failures)  # the leftovers are collected when allocation runs the collector: here
        print(meta["step"], len(failures), failures[0].split(":")[0])
        time.sleep(1.0)  # reads still in flight on orbax's threads finish and are collected after the fallback
        gc.collect()
    """
)


def test_a_damaged_step_falls_back_with_one_line_and_no_traceback(tmp_path):
    script, directory = tmp_path / "ckpt.py", tmp_path / "checkpoints"
    script.write_text(SCRIPT)
    make = subprocess.run([sys.executable, str(script), str(directory), "make"], capture_output=True, text=True)
    assert make.returncode == 0, make.stderr
    read = subprocess.run([sys.executable, str(script), str(directory), "read"], capture_output=True, text=True)
    assert read.returncode == 0, read.stderr
    last = read.stdout.splitlines()[-1].split()
    assert last == ["1", "1", "checkpoint", "step", "2", "in", str(directory), "is", "unreadable"]
    # Orbax's other reads of the damaged step fail too; their unretrieved exceptions must not reach the console.
    for noise in ("Traceback", "Exception ignored", "Task exception was never retrieved", "ERROR"):
        assert noise not in read.stderr, read.stderr[:2000]


# Late leftovers, made deterministic: a suspended coroutine whose cleanup raises and an asyncio task whose exception
# is never retrieved, each once from code whose file lies under an ``orbax`` directory and once from elsewhere; and
# a callback to a closed event loop (seen when a damaged step's other reads finished after the fallback).
LEFTOVERS = textwrap.dedent(
    """
    import asyncio, gc, sys, types
    from lspo_jax.rl import checkpoint

    SOURCE = '''
    import types
    @types.coroutine
    def pause():
        yield
    async def suspended():
        try:
            await pause()
        finally:
            raise RuntimeError("late read failed in " + __name__)
    async def failing():
        raise RuntimeError("task failed in " + __name__)
    '''

    def leave_leftovers(filename, name):
        space = {"__name__": name}
        exec(compile(SOURCE, filename, "exec"), space)
        coroutine = space["suspended"]()
        coroutine.send(None)
        del coroutine
        loop = asyncio.new_event_loop()
        task = loop.create_task(space["failing"]())
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
        del task
        gc.collect()

    class LateCallback:  # a read finishing after orbax closed its loop: only asyncio's frames in the traceback
        def __init__(self):
            self.loop = asyncio.new_event_loop()
            self.loop.close()

        def __del__(self):
            self.loop.call_soon_threadsafe(print)

    def native_callback(message):  # the same, handed over by a native thread: printed through sys.excepthook
        loop = asyncio.new_event_loop()
        loop.close()
        try:
            loop.call_soon_threadsafe(print)
        except RuntimeError as err:
            err.add_note(message)
            sys.excepthook(RuntimeError, err, err.__traceback__.tb_next)  # asyncio's frames only, as PyErr_Print
            sys.excepthook(RuntimeError, err, err.__traceback__)  # with a Python caller: reported

    checkpoint._drop_orbax_leftovers()
    leave_leftovers("/site-packages/orbax/checkpoint/fake.py", "orbax_read")
    LateCallback()
    native_callback("closed loop called from user code")
    leave_leftovers("/site-packages/user/code.py", "user_code")
    """
)


def test_late_orbax_leftovers_are_dropped_and_every_other_report_kept(tmp_path):
    script = tmp_path / "leftovers.py"
    script.write_text(LEFTOVERS)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "orbax_read" not in run.stderr, run.stderr
    # The closed loop's callback is reported once: from the user's code, not when asyncio's frames are all there is.
    reported = run.stderr.count("RuntimeError: Event loop is closed")
    assert reported == 1 and "called from user code" in run.stderr, run.stderr
    assert "late read failed in user_code" in run.stderr and "task failed in user_code" in run.stderr, run.stderr


def test_a_checkpoint_that_cannot_be_written_is_one_line_naming_the_os_error(tmp_path, monkeypatch):
    """A full disk during a save once printed 1,014 lines (each of orbax's threads logging the failure) and exit
    1. Tensorstore names the OS error only in its text; the save's error carries it as an ``OSError``, so every
    command says what it is and what to do in one line, and the half-written step is removed."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import pytest

    from lspo_jax.job import errors
    from lspo_jax.rl.checkpoint import Checkpointer, CheckpointError

    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))

    def disk_full(manager, step, **kwargs):
        (tmp_path / "checkpoints" / f"{step}.orbax-checkpoint-tmp-1").mkdir()  # what a failed write leaves
        # Tensorstore's words on a full tmpfs (jax 0.10.2, orbax-checkpoint 0.12.8), shortened in the middle.
        words = "Failed to write 2728891 bytes to file 6: No space left on device [os_error_code='28']"
        raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "base.w/0.0" in OCDBT database at "...": {words}')

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full)
    with pytest.raises(CheckpointError, match="checkpoint step 3 could not be written in ") as info:
        checkpointer.save(3, {"base": {"w": jnp.ones(3)}, "rl_opt": {}}, {"step": 3})
    assert errors.describe(info.value) == (
        f"cannot write {checkpointer.directory}: No space left on device; free some space; a run continues from "
        "its last checkpoint with --resume"
    )
    assert os.listdir(checkpointer.directory) == []
    checkpointer.close()
