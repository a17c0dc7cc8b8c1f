"""Orbax checkpoints of a run: base params, the RL optimizer state, the step's counters and the data order.

The train state (``TrainState``) is saved and restored whole, in one call each. LSPO's adapter is never written: it
lives for one step and is discarded (the deliverable is base-only); a persistent one is. A LoRA RL run
(``optim.train: lora``) writes its policy adapter and that adapter's optimizer state in place of the base, which it
never changes: the base is named by the run's model (``model.path``, its shapes in the meta's ``model``) and by the
sha256 of its bytes (``base_digest``, the meta's ``base_sha256``), and a resume onto another base is refused.
Orbax writes each step to a temporary directory and renames it when complete, so a crash mid-write
leaves the previous checkpoint intact; ``keep`` bounds how many are kept. Sharded arrays are written by
the devices (and hosts) that hold them; every process of a multi-host run calls ``save`` and ``restore``.

A checkpoint damaged afterwards (a truncated file, a disk error) is reported as ``CheckpointError`` naming
its step; ``restore_readable`` then falls back to the newest step that restores. Orbax keeps no checksum of array
data, so flipped bytes in a file of the right size would read back as other numbers (a NaN in Adam's second moment
writes NaN into the base at the next update): each save stores the sha256 of every array in its JSON meta
(``array_digest``), and a restore whose arrays do not match it is unreadable too. A checkpoint written before the
digest existed restores unchecked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import glob
import hashlib
import logging
import os
import re
import shutil
import sys
import traceback
from types import TracebackType
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from lspo_jax.tasks.text import error_cause


class CheckpointError(RuntimeError):
    """A checkpoint step that is missing or cannot be read; the message names the step and the directory."""


@dataclasses.dataclass
class TrainState:
    """Everything a step reads and writes. ``params["lora"]`` is scratch space for the step's adapter."""

    step: int
    params: Any
    opt_state: Any
    nonfinite_in_row: int = 0
    nonfinite_total: int = 0
    # RL updates applied (skipped ones not included): the learning-rate schedule's count. One per step unless
    # ``optim.mini_batches`` or ``optim.epochs`` is above 1.
    updates: int = 0
    # The step at which a persistent adapter (``scaffold.adapter: persistent``) was last reset; None: never.
    adapter_reset_step: int | None = None
    # LoRA RL: the sha256 of the frozen base's bytes (``base_digest``), its identity in a checkpoint that holds only
    # the policy adapter; None for a full run (its checkpoint holds the base itself) or where it cannot be read whole.
    base_digest: str | None = None


# The train state's counters, stored in a checkpoint's JSON meta beside the arrays.
COUNTERS = ("step", "nonfinite_total", "nonfinite_in_row", "adapter_reset_step", "updates")
# The meta's key for ``array_digest``: written by ``Checkpointer.save``, checked and removed by ``restore``.
DIGEST = "array_sha256"
# The meta's key for a LoRA RL run's ``TrainState.base_digest``.
BASE_DIGEST = "base_sha256"


def checkpoint_state(params: Any, opt_state: Any, *, adapter: bool = False) -> dict[str, Any]:
    """What a checkpoint holds: the params the RL update trains, the base (``"base"``) or LoRA RL's policy adapter
    (``"policy"``, where ``params`` hold one: the frozen base is not stored), and their RL optimizer state; with
    ``adapter`` (an adapter lifetime that is checkpointed, ``scaffold.adapter: persistent``) the scaffold's adapter
    and its SFT state under ``"adapter"``. LSPO's own adapter, fresh every step, is never stored.

    Optimizer states are stored as their lists of leaves: each tree mirrors ``{"base", "lora"}`` with empty
    placeholders on the other side, so storing the tree would tie a checkpoint to the adapter's targets.
    """
    trained = trained_key(params)
    state = {trained: params[trained], "rl_opt": jax.tree.leaves(opt_state.inner_states[trained])}
    if adapter:
        state["adapter"] = {"lora": params["lora"], "sft_opt": jax.tree.leaves(opt_state.inner_states["lora"])}
    return state


def trained_key(params: Any) -> str:
    """The subtree the RL update trains: ``"policy"`` where ``params`` hold LoRA RL's policy adapter, else
    ``"base"``."""
    return "policy" if "policy" in params else "base"


def base_digest(base: Any) -> str | None:
    """The sha256 of a base's arrays (each leaf's name, dtype and bytes, ``array_digest``), a frozen base's identity;
    None where they are not all on this host (a multi-host run)."""
    digest = array_digest(base)
    return None if digest is None else hashlib.sha256(repr(sorted(digest.items())).encode()).hexdigest()


def with_rl_state(opt_state: Any, leaves: list[Any], name: str = "base") -> Any:
    """``opt_state`` with its RL part (``name="lora"``: its SFT part) rebuilt from checkpointed leaves (the inverse
    of ``checkpoint_state``)."""
    part = jax.tree.unflatten(jax.tree.structure(opt_state.inner_states[name]), leaves)
    return opt_state._replace(inner_states={**opt_state.inner_states, name: part})


def _restored_state(template: TrainState, restored: dict[str, Any], meta: dict[str, Any]) -> TrainState:
    """``template`` with the checkpoint's arrays and counters (those of older checkpoints defaulted)."""
    trained = trained_key(template.params)
    params = {**template.params, trained: restored[trained]}
    opt_state = with_rl_state(template.opt_state, restored["rl_opt"], trained)
    if "adapter" in restored:
        params["lora"] = restored["adapter"]["lora"]
        opt_state = with_rl_state(opt_state, restored["adapter"]["sft_opt"], "lora")
    step, nonfinite_total = int(meta["step"]), int(meta.get("nonfinite_total", 0))
    return TrainState(
        step=step, params=params, opt_state=opt_state, nonfinite_total=nonfinite_total,
        nonfinite_in_row=int(meta.get("nonfinite_in_row", 0)),
        adapter_reset_step=meta.get("adapter_reset_step") if "adapter" in restored else None,
        # A checkpoint from before optim.mini_batches took one update a step.
        updates=int(meta.get("updates", step - nonfinite_total)), base_digest=template.base_digest,
    )  # fmt: skip


class Checkpointer:
    """Save and restore ``{"base": params, "rl_opt": RL optimizer state}`` plus a JSON ``meta`` dict; a run's whole
    ``TrainState`` in one call with ``save_state`` and ``restore_state``."""

    def __init__(self, directory: str, *, keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """Every complete step on disk, oldest first (a write cut short is not listed)."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        if "lora" in state:
            raise ValueError("refusing to checkpoint an adapter: LSPO's adapter is discarded every step")
        digest = array_digest(state)
        meta = {**meta, DIGEST: digest} if digest is not None else meta
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        try:
            with _muted_leftovers():  # a failed write is logged with its traceback by each of orbax's threads
                self._manager.save(step, args=args, force=True)
                self._manager.wait_until_finished()
        except Exception as err:
            for partial in glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")):
                shutil.rmtree(partial, ignore_errors=True)  # the space it took back, for the log and the next try
            message, cause = _write_error(step, self.directory, err)
            raise CheckpointError(message) from cause

    def save_state(self, state: TrainState, meta: dict[str, Any], *, adapter: bool = False) -> None:
        """The whole train state at its step in one checkpoint: arrays (``checkpoint_state``), counters, and the
        run's own ``meta`` (the prompt source's state, the seed) beside them."""
        counters = {name: getattr(state, name) for name in COUNTERS}
        if state.base_digest is not None:
            counters[BASE_DIGEST] = state.base_digest
        self.save(state.step, checkpoint_state(state.params, state.opt_state, adapter=adapter), {**counters, **meta})

    def restore_state(
        self, template: TrainState, *, adapter: bool = False
    ) -> tuple[TrainState, dict[str, Any], list[str]]:
        """The newest readable checkpoint as a train state in ``template``'s structure and layouts (the inverse of
        ``save_state``), its meta, and one line per newer step that did not restore (``restore_readable``)."""
        target = checkpoint_state(template.params, template.opt_state, adapter=adapter)
        restored, meta, failures = self.restore_readable(target)
        saved = meta.get(BASE_DIGEST)
        if None not in (saved, template.base_digest) and saved != template.base_digest:
            raise CheckpointError(
                f"checkpoint step {meta['step']} in {self.directory} holds a policy adapter trained on another base "
                f"(its sha256 {saved[:12]}..., this one's {template.base_digest[:12]}...)"
            )
        return _restored_state(template, restored, meta), meta, failures

    def restore(self, step: int | None, target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore into the structure, shapes, dtypes and shardings of ``target`` (arrays or ShapeDtypeStructs).

        Each leaf comes back in its target's layout, whatever mesh wrote it: a run saved with fsdp = 8 resumes
        on fsdp = 2 x tp = 4 given a target from ``sharding.abstract_params`` / ``opt_state_shardings``.
        Raises ``CheckpointError`` when ``step`` (default: the latest) is absent or unreadable, or when an array
        does not match the digest saved with it (``array_digest``).
        """
        steps = self.steps()
        step = (steps[-1] if steps else None) if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step not in steps:
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory}; its steps: {_listed(steps)}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        # Before the read, not after its failure: a damaged step's other reads may hand their results to orbax's
        # closed event loop while the restore is still unwinding (seen once in seven suite runs, under load).
        _drop_orbax_leftovers()
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as err:  # orbax, tensorstore and json each raise their own kinds for a damaged file
            cause = error_cause(err)
        else:
            meta = dict(restored["meta"])
            damaged = _mismatch(restored["state"], meta.pop(DIGEST, None))
            if damaged is None:
                return restored["state"], meta
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is unreadable: its array {damaged} does not match the "
                "sha256 saved with it (a damaged file)"
            )
        # Not chained: the error's frames hold orbax's other failed reads, collected (quietly) only once it is gone.
        with _muted_leftovers():
            gc.collect()
        raise CheckpointError(f"checkpoint step {step} in {self.directory} is unreadable: {cause}")

    def restore_readable(
        self, target: dict[str, Any], before: int | None = None
    ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        """The newest step (below ``before`` when given) that restores, and one line per newer step that did not.

        Raises ``CheckpointError`` listing every failure when none restores.
        """
        failures = []
        for step in reversed([s for s in self.steps() if before is None or s < before]):
            try:
                return (*self.restore(step, target), failures)
            except CheckpointError as err:
                failures.append(str(err))
        raise CheckpointError("; ".join(failures) if failures else f"no checkpoint in {self.directory}")

    def readable_steps(self, target: dict[str, Any]) -> list[int]:
        """The steps that restore into ``target`` (each is read in full: for error messages, not a hot path)."""
        readable = []
        for step in self.steps():
            try:
                self.restore(step, target)
                readable.append(step)
            except CheckpointError:
                pass
        return readable

    def set_aside(self, steps: list[int]) -> str:
        """Move unreadable ``steps`` out of the way (to ``<directory>.unreadable/``), so that the run can write
        those steps again; returns where they went. Called by one process of a run."""
        aside = self.directory + ".unreadable"
        os.makedirs(aside, exist_ok=True)
        for step in steps:
            source, dest = os.path.join(self.directory, str(step)), os.path.join(aside, str(step))
            if os.path.exists(dest):
                shutil.rmtree(dest)
            shutil.move(source, dest)
        self._manager.reload()
        return aside

    def close(self) -> None:
        self._manager.close()


def array_digest(state: Any) -> dict[str, str] | None:
    """``{leaf name: "dtype:sha256 of its bytes"}`` of every array in ``state`` (names as ``base.embed``, ``rl_opt.3``).

    None when an array is not fully addressable (a multi-host run): each process holds only its shards, and a digest
    of those would need a gather of the whole state to one host; such a checkpoint is stored without one and restored
    unchecked. One host's arrays are read back to it one at a time, once more than orbax's own write does; sha256
    ran at 1.76 GB/s on one core of the work machine (benchmarks/RESULTS.md): about 10 s for the 18 GB of a 1.5B
    model's float32 base and AdamW moments, once every ``checkpoint.every`` steps.
    """
    leaves = jax.tree_util.tree_leaves_with_path(state)
    if not all(getattr(leaf, "is_fully_addressable", True) for _, leaf in leaves):
        return None
    return {_leaf_name(path): _sha256(leaf) for path, leaf in leaves}


def _mismatch(restored: Any, digest: dict[str, str] | None) -> str | None:
    """The name of the first restored array whose bytes differ from ``digest`` (None: all match, or no digest).

    An array restored in another dtype than it was saved in (a resume with another ``model.param_dtype``) was cast
    on the way: its bytes are not the saved ones, so it is not checked.
    """
    current = array_digest(restored) if digest is not None else None
    for name, now in (current or {}).items():
        saved = digest.get(name, now)
        if saved.split(":")[0] == now.split(":")[0] and saved != now:
            return name
    return None


def _leaf_name(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _sha256(leaf: Any) -> str:
    host = np.ascontiguousarray(jax.device_get(leaf))
    return f"{host.dtype.name}:{hashlib.sha256(host.reshape(-1).view(np.uint8)).hexdigest()}"


@contextlib.contextmanager
def _muted_leftovers():
    """A failed read leaves orbax's other reads of the step failing too: coroutines and asyncio tasks whose
    exceptions nobody retrieves, reported with full tracebacks when they are collected. The first failure is
    already the ``CheckpointError``'s cause, so the rest is collected here with those reports muted. Reads
    still in flight on orbax's own threads may finish after this; ``_drop_orbax_leftovers`` mutes those."""
    _drop_orbax_leftovers()
    loggers = [logging.getLogger(name) for name in ("asyncio", "absl", "orbax")]
    levels = [logger.level for logger in loggers]
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _orbax_leftover(error: BaseException | None, tb: TracebackType | None) -> bool:
    """Raised inside orbax, or a read that finished after orbax closed its event loop (asyncio's frames only)."""
    frames = traceback.extract_tb(tb)
    if any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames):
        return True
    closed = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
    return closed and bool(frames) and frames[-1].filename.endswith(os.path.join("asyncio", "base_events.py"))


class _OrbaxLeftoverFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _orbax_leftover(record.exc_info[1], record.exc_info[2]))


@functools.cache
def _drop_orbax_leftovers() -> None:
    """From the first read on, orbax's leftovers (``_orbax_leftover``) are dropped whenever they surface:
    unretrieved exceptions collected late, callbacks of reads that outlived orbax's event loop. Every other
    unraisable exception or asyncio error is reported as before. Installed once."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _orbax_leftover(unraisable.exc_value, unraisable.exc_traceback):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_OrbaxLeftoverFilter())
    # A read's completion that a native thread hands to the closed loop fails in ``call_soon_threadsafe`` with no
    # Python caller, and is printed through ``sys.excepthook`` (a bare traceback of asyncio's frames, at random).
    previous_excepthook = sys.excepthook

    def excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        frames = traceback.extract_tb(tb)
        in_asyncio = bool(frames) and all(f"{os.sep}asyncio{os.sep}" in frame.filename for frame in frames)
        if not (in_asyncio and _orbax_leftover(error, tb)):
            previous_excepthook(kind, error, tb)

    sys.excepthook = excepthook


def _write_error(step: int, directory: str, err: BaseException) -> tuple[str, BaseException]:
    """A failed save as one line and its cause; tensorstore reports the OS error behind it (a full disk, a
    read-only file system) only as ``[os_error_code='28']`` in its text, so that becomes the ``OSError`` it
    stands for."""
    code = re.search(r"os_error_code='(\d+)'", str(err))
    cause = OSError(int(code[1]), os.strerror(int(code[1])), directory) if code else err
    return f"checkpoint step {step} could not be written in {directory}: {error_cause(cause)}", cause


def _listed(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"
