"""One writer per run directory: a second ``lspo-train`` into the same ``--out`` is refused, not interleaved.

Two runs writing one directory overwrite each other's config, records and checkpoints while both report success.
The lock is an exclusive ``flock`` on ``<out>/.lspo-train.lock``, held for the run's life: the kernel drops it
when the process ends however it ends (a kill included), so a crashed run never leaves a stale lock behind. The
file holds who holds it, for the refusal's message. Only the process that writes the run's files takes it (process
0 of a multi-host job); ``flock`` on a network file system is as good as that file system's locking.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time

LOCK_NAME = ".lspo-train.lock"


class RunLock:
    """Holds ``<out_dir>/.lspo-train.lock`` until ``close``; ``FileExistsError`` naming the holder when another
    process has it. An unwritable directory fails here, first, with the ``OSError`` that says why."""

    def __init__(self, out_dir: str):
        path = os.path.join(out_dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                raise FileExistsError(
                    f"--out {out_dir} is being written by another run ({holder}); wait for it to end or choose "
                    "another --out"
                ) from None
            os.ftruncate(fd, 0)
            since = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}".encode())
        except BaseException:  # a refusal, a full disk, a stop: the descriptor (and any lock on it) goes too
            os.close(fd)
            raise
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


def take_run_lock(out_dir: str) -> RunLock | None:
    """The run's lock, taken by process 0 (the writer); ``None`` on the other processes. With several processes all
    of them learn whether process 0 got it, so a refused job ends on every host in one line: the others would
    otherwise wait at their first collective for a process that has gone."""
    import jax
    import numpy as np

    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = RunLock(out_dir)
        except BaseException as err:  # a refusal, an unwritable directory, a Ctrl-C: the others hear of it too
            error = err
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        try:
            refused = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        except BaseException:
            if lock is not None:
                lock.close()
            raise
        if refused and error is None:
            error = FileExistsError(
                f"--out {out_dir}: process 0 could not take the run's lock (its own message says why); nothing "
                "was started"
            )
    if error is not None:
        raise error
    return lock
