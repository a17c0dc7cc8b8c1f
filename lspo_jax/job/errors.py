"""How a command ends: its exit statuses, the one line a user error is said in, and the funnel each command's body
runs through (``run_command``; the tools' ``run_main`` follows it). A user error (a config, path, file, model
directory or checkpoint the user gave, what the machine refused, the devices' memory) is one line and
``EXIT_CONFIG``, its traceback only with ``LSPO_JAX_DEBUG`` set; anything else is a bug and keeps its traceback.

Imports no JAX: the commands start fast, and a refusal before any work costs none.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import traceback

EXIT_CONFIG = 2  # a bad config, file, path or checkpoint: nothing ran
EXIT_ROLLOUT = 4  # the rollout engine's samples were not the policy's (a rollout error); a checkpoint was written
EXIT_STOPPED = 75  # stopped by SIGTERM or Ctrl-C with a checkpoint written: `--resume` continues it (EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM before the run had started: nothing to resume from it
DEBUG_VAR = "LSPO_JAX_DEBUG"  # set (to anything but 0): a one-line error also prints its traceback


class NoPolicyAdapterError(ValueError):
    """A policy adapter asked for (``lspo-export --adapter``) of a run that trained the base itself
    (``optim.train: full``): its checkpoints hold no adapter, only the whole model."""


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors that come from what the user gave (a config, a path, a file, a model directory, a checkpoint)
    or from the machine (permissions, space): each ends a command in one line and ``EXIT_CONFIG``."""
    from lspo_jax.job.metrics_log import MetricsError
    from lspo_jax.rl.checkpoint import CheckpointError
    from lspo_jax.tasks.data_report import DataError
    from lspo_jax.train_config import ConfigError

    return ConfigError, DataError, CheckpointError, MetricsError, NoPolicyAdapterError, OSError


def out_of_memory(err: BaseException) -> bool:
    """XLA's allocation failure on an accelerator: a shape the devices cannot hold, not a bug of the program."""
    return type(err).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and str(err).startswith("RESOURCE_EXHAUSTED")


def debug_traceback() -> None:
    """The traceback of the error being handled, where ``LSPO_JAX_DEBUG`` asks for it beside its one line."""
    if os.environ.get(DEBUG_VAR, "0") not in ("", "0"):
        traceback.print_exc()


# OS errors that say what to do: (what failed, the advice). Space and a read-only file system can only be a write's,
# so they are looked for through an error's causes too (a checkpoint's write deep in orbax); permissions may be a
# read's, so only an OSError raised as it is gets that line.
RESUME_ADVICE = "a run continues from its last checkpoint with --resume"
_WRITES = {
    errno.ENOSPC: ("cannot write", f"free some space; {RESUME_ADVICE}"),
    errno.EDQUOT: ("cannot write", f"free some space; {RESUME_ADVICE}"),
    errno.EROFS: ("cannot write", "choose a writable --out"),
}
_ACCESS = {errno.EACCES: ("cannot use", "check its permissions"), errno.EPERM: ("cannot use", "check its permissions")}


def describe(err: BaseException) -> str:
    """One line for a user error: what failed, on which path, and what to do."""
    from lspo_jax.options import RolloutError
    from lspo_jax.train_config import ConfigError

    if isinstance(err, RolloutError):
        return f"rollout error: {err}"
    if isinstance(err, ConfigError):
        return f"config error: {err}"
    if out_of_memory(err):
        first = str(err).strip().splitlines()[0][:200]
        return (
            f"the devices ran out of memory ({first}); raise loss.micro_batches or lower rollout.prompts_per_step or "
            "rollout.group_size (a run continues from its last checkpoint with --resume and the new values)"
        )
    cause, seen = err, set()
    while cause is not None and id(cause) not in seen and not _os_line(cause, _WRITES):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    line = (_os_line(cause, _WRITES) if cause is not None else None) or _os_line(err, _ACCESS)
    if line:
        return line
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _os_line(err: BaseException, known: dict) -> str | None:
    if not (isinstance(err, OSError) and err.errno in known):
        return None
    what, advice = known[err.errno]
    where = f" {err.filename}" if err.filename else ""
    return f"{what}{where}: {err.strerror or os.strerror(err.errno)}; {advice}"


def has_checkpoint(out_dir: str) -> bool:
    """Whether ``out_dir`` holds a finished checkpoint step (orbax names them by number), without orbax: what
    ``--resume`` and the advice to use it rest on."""
    directory = os.path.join(out_dir, "checkpoints")
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def run_command(prog: str, body, args, interrupted: str) -> int:
    """``body(args)``'s exit status, through one funnel: a user error (``user_errors``) is one line and
    ``EXIT_CONFIG``, its traceback only with ``LSPO_JAX_DEBUG`` set; Ctrl-C or SIGTERM before the command's own
    handlers take over is ``interrupted`` and ``EXIT_INTERRUPTED``. Any other error is a bug: its traceback."""
    from lspo_jax.options import RolloutError

    _quiet_imports()
    try:
        with _terminate_as_interrupt():
            return body(args)
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RolloutError as err:  # found mid-run, from the samples: not the config's fault, and not a bug here
        debug_traceback()
        print(f"{prog}: {describe(err)}", file=sys.stderr)
        return EXIT_ROLLOUT
    except Exception as err:
        if not (isinstance(err, user_errors()) or out_of_memory(err)):
            raise
        debug_traceback()
        print(f"{prog}: {_with_resume_advice(describe(err), getattr(args, 'out', None))}", file=sys.stderr)
        return EXIT_CONFIG


def until_stopped(prog: str, where: str, what: str, body, args) -> int:
    """``body(args, stop)`` under a ``StopFlag`` that says it stops ``where``; a stop it takes (``StartupStopped``,
    raised at its points) ends the command with one line, nothing ``what``, and ``EXIT_INTERRUPTED``."""
    from lspo_jax.job.signals import StartupStopped, StopFlag

    with StopFlag(prog) as stop:
        stop.expect(f"{where}; nothing is {what}")
        try:
            return body(args, stop)
        except StartupStopped:
            print(f"{prog}: interrupted; nothing was {what}", file=sys.stderr)
            return EXIT_INTERRUPTED


def _with_resume_advice(line: str, out: str | None) -> str:
    """``line`` without the advice to ``--resume`` where the run directory ``out`` holds no checkpoint to resume from
    (the disk filled during the first one): its records refuse the same command again, so it is removed first."""
    if RESUME_ADVICE not in line or not out or has_checkpoint(out) or not os.path.isdir(out):
        return line
    return line.replace(RESUME_ADVICE, f"{out} holds no checkpoint to resume from: remove it and start the run again")


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (a scheduler's stop) read as Ctrl-C until the command's own handlers replace it: a stop during
    start-up ends with the interrupted line and ``EXIT_INTERRUPTED``, the resources opened so far closed, not
    with a silent 143. The previous handler comes back afterwards (a test, a notebook)."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: set outside Python


def _quiet_imports() -> None:
    """transformers announces at import that PyTorch is absent (the JAX path never needs it), as advice:
    advice is off unless the user set ``TRANSFORMERS_NO_ADVISORY_WARNINGS`` themselves; its warnings stay."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
