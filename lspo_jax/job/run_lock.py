"""One writer per run directory: a second ``lspo-train`` into the same ``--out`` is refused, not interleaved.

Two runs writing one directory overwrite each other's config, records and checkpoints while both report success.
The lock is two exclusive ``flock``s held for the run's life, on the directory itself and on
``<out>/.lspo-train.lock``: the kernel drops them when the process ends however it ends (a kill included), so a
crashed run never leaves a stale lock behind. The file holds who holds it, for the refusal's message. Only the
process that writes the run's files takes it (process 0 of a multi-host job).

Why the directory too: a lock belongs to an inode, not to a name. A user who deletes the file, taking it for a stale
lock, leaves the run holding an inode no path names, and a second run would create a new file and lock that. No
removal of files inside the directory takes the directory's inode from the run, so on one machine a second writer
is refused whatever is done to the file (util-linux's ``flock(1)`` locks directories the same way). Where the file
system locks directories only on each client (NFS: its files' locks are the server's), writers on two hosts are
kept apart by the file alone; so the run checks with each record and checkpoint (``RunLock.check``, a ``stat``)
that the path still names the file it locked, takes a re-created one, and stops in one line if another process
holds it. ``flock`` on a network file system is as good as that file system's locking.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time

LOCK_NAME = ".lspo-train.lock"
_TRIES = 10  # takes of a lock file replaced between its open and its lock before giving up


class _Held(Exception):
    """Another process holds the lock; the message says who."""


class RunLock:
    """Holds ``<out_dir>`` and ``<out_dir>/.lspo-train.lock`` until ``close``; ``FileExistsError`` naming the holder
    when another process has them. An unwritable directory fails here, first, with the ``OSError`` that says why."""

    def __init__(self, out_dir: str):
        self.out_dir, self.path = out_dir, os.path.join(out_dir, LOCK_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # before the directory: an unwritable one is named
        self._fd: int | None = None
        self._dir_fd: int | None = None
        try:
            try:  # the directory first, so that of two runs starting at once one gets both locks, not each one
                self._dir_fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
                _lock_directory(self._dir_fd, fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = _lock_file(self.path, fd)  # fd is its own from here: closed unless returned
        except _Held as held:
            self.close()
            raise FileExistsError(
                f"--out {out_dir} is being written by another run ({held}); wait for it to end or choose another --out"
            ) from None
        except BaseException:  # a full disk, a stop: the descriptors (and any lock on them) go too
            self.close()
            raise

    def check(self) -> None:
        """Stop (``FileExistsError``) unless this process still holds its run directory: the path names the directory
        locked at the start, and the lock file is the one this process holds, re-created and taken again if it was
        removed or replaced (while the directory's lock kept every other run on this machine out)."""
        if self._fd is None:
            return
        if not _names(self.out_dir, self._dir_fd):
            raise FileExistsError(f"--out {self.out_dir} was removed or replaced while this run was writing it; this "
                                  "run stops here, writing nothing more")  # fmt: skip
        if _names(self.path, self._fd):
            return
        try:
            fd = _lock_file(self.path)
        except _Held as held:
            raise FileExistsError(
                f"--out {self.out_dir}: another run ({held}) took the directory while this one was writing it (its "
                f"{LOCK_NAME} was removed); this run stops here, writing nothing more"
            ) from None
        os.close(self._fd)
        self._fd = fd

    def close(self) -> None:
        for name in ("_fd", "_dir_fd"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)  # closing the descriptor releases its lock


def _lock_file(path: str, fd: int | None = None) -> int:
    """A descriptor holding the exclusive lock of the file ``path`` names (``fd``: that file, already open; created
    when missing), which now says who holds it; ``_Held`` naming the holder when another process has it."""
    for _ in range(_TRIES):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644) if fd is None else fd
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _Held(_holder(fd)) from None
            if _names(path, fd):
                os.ftruncate(fd, 0)
                since = time.strftime("%Y-%m-%d %H:%M:%S")
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}".encode(), 0)
                return fd
        except BaseException:
            os.close(fd)
            raise
        # Removed or replaced between the open and the lock: a lock on an inode no path names keeps no one out.
        os.close(fd)
        fd = None
    raise _Held(f"another process, replacing {path} as fast as it is taken")


def _lock_directory(dir_fd: int, fd: int) -> None:
    """The directory's lock, or ``_Held`` naming the holder from its lock file (``fd``)."""
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _Held(_holder(fd)) from None
    except OSError:
        pass  # a file system that cannot lock a directory: the file's lock alone refuses a second run


def _holder(fd: int) -> str:
    return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"


def _names(path: str, fd: int | None) -> bool:
    """Whether ``path`` names the file (or directory) open as ``fd``."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


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
