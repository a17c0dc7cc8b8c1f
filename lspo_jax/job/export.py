"""A run's checkpoint -> a Hugging Face directory that ``transformers`` loads (base model only).

``lspo-export RUN_DIR OUT`` reads ``RUN_DIR/config.yaml``, rebuilds the policy the run trained, restores the
base params of the latest (or a chosen) checkpoint and writes ``config.json``, ``model.safetensors`` and the
tokenizer files. There is no scaffold adapter to export: LSPO discards it every step and never checkpoints it. A LoRA
RL run (``optim.train: lora``) checkpoints its policy adapter alone: the export is the merged policy
(``W + (alpha / r) A B`` folded into the base it was trained on, read from ``model.path`` and checked against the
checkpoint's ``base_sha256``), or with ``adapter=True`` (``--adapter``) the adapter as a PEFT directory
(``models.peft``). Weights that hold a NaN or an infinity are refused, naming the tensor and the step.
``lspo-eval`` restores a run's checkpoint the same way (``restore_run``).

OUT is written beside itself (``OUT.partial-<pid>``) and renamed into place once complete, so a stop or a failure
leaves it as it was: "nothing was exported" stays true, and transformers never finds a directory with a shard
missing. An OUT that exists is replaced whole, never mixed with the new files; only an empty directory or a Hugging
Face model's (a ``config.json`` and files) is replaced, and never the run's own directory or its checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax import hub
from lspo_jax.config import ModelConfig
from lspo_jax.job.build import abstract_checkpoint_state, load_policy, model_dir
from lspo_jax.job.config import load_config
from lspo_jax.job.errors import NoPolicyAdapterError
from lspo_jax.job.signals import StopFlag
from lspo_jax.models import hf, lora, peft
from lspo_jax.models.specs import Params
from lspo_jax.rl import checkpoint
from lspo_jax.rl.checkpoint import Checkpointer, CheckpointError
from lspo_jax.rollout.generator import Policy
from lspo_jax.train_config import TrainConfig


def is_run_dir(path: str) -> bool:
    """True for a training run's output directory (its ``config.yaml`` and ``checkpoints/``)."""
    return os.path.isfile(os.path.join(path, "config.yaml")) and os.path.isdir(os.path.join(path, "checkpoints"))


def restore_run(
    run_dir: str, step: int | None = None, overrides: Sequence[str] = ()
) -> tuple[TrainConfig, Policy, Params, int]:
    """The run's config (with ``overrides``), its policy and the base params ``{"base": ...}`` of checkpoint
    ``step`` (default: the latest), and that step. A LoRA RL run's params are ``{"base", "policy"}``: the base read
    from ``model.path``, the policy adapter from the checkpoint."""
    run = load_config(os.path.join(run_dir, "config.yaml"), list(overrides))
    policy, base = load_policy(run, os.path.join(run_dir, "cache"))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    # Restored onto one device: export gathers the whole model on the host anyway.
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        abstract_checkpoint_state(run, policy.config),
    )
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=run.checkpoint.keep)
    try:
        restored, meta = checkpointer.restore(step, target)
    except CheckpointError as err:
        if step is not None and step not in checkpointer.steps():
            raise
        failed = checkpointer.latest_step() if step is None else step
        others = [s for s in checkpointer.readable_steps(target) if s != failed]
        hint = f"readable steps: {', '.join(map(str, others))} (pass --step)" if others else "no other step is readable"
        raise CheckpointError(f"{err}; {hint}") from None
    finally:
        checkpointer.close()
    return run, policy, _policy_params(base, restored, meta), int(meta["step"])


def _policy_params(base: Params, restored: dict, meta: dict) -> Params:
    """The restored policy: the checkpoint's base, or (LoRA RL) ``base`` with the checkpoint's policy adapter, once
    ``base`` is found to be the one the adapter was trained on (``checkpoint.BASE_DIGEST``)."""
    if "policy" not in restored:
        return {"base": restored["base"]}
    saved = meta.get(checkpoint.BASE_DIGEST)
    if saved is not None and checkpoint.base_digest(base["base"]) != saved:
        raise CheckpointError(f"checkpoint step {meta['step']}: its policy adapter was trained on another base than "
                              "the one at model.path (their sha256 differ)")  # fmt: skip
    return {"base": base["base"], "policy": restored["policy"]}


def check_run_dir(run_dir: str) -> None:
    """Refuse, in one line, a path that is not a training run's output directory."""
    if not is_run_dir(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a training run (no config.yaml and checkpoints/ in it)")


def export_checkpoint(
    run_dir: str, out: str, step: int | None = None, *, adapter: bool = False, check: Callable[[], None] | None = None
) -> str:
    """Write the base params of checkpoint ``step`` (default: the latest) of ``run_dir`` to ``out``; return ``out``.
    A LoRA RL run's are the merged policy, or with ``adapter`` its policy adapter as a PEFT directory.

    ``adapter`` of a run that trained the base itself is refused (``NoPolicyAdapterError``): it has none.

    ``out`` ends up either the whole export or as it was: the files are written beside it and renamed into place
    (``_staged``). ``check`` is called after the restore and after each tensor and file written, and may raise to
    end the export there (a stop: ``StopFlag.startup_point``), leaving ``out`` as it was. Once the rename is done, a
    SIGTERM or Ctrl-C that came during it is dropped: the export is complete, so the call returns as a success."""
    check = check or (lambda: None)
    check_run_dir(run_dir)
    check_out(run_dir, out)
    run, policy, params, step = restore_run(run_dir, step)
    check()
    tokenizer_from = model_dir(run, os.path.join(run_dir, "cache"))
    if adapter:
        if "policy" not in params:
            raise NoPolicyAdapterError("no policy adapter to write: the run trained the base (optim.train: full)")
        base_model = run.model.path if hub.is_hub_name(run.model.path) else os.path.abspath(tokenizer_from)
        with _staged(os.path.realpath(out)) as staging:
            peft.save_adapter(staging, policy.config, params, base_model=base_model, check=check)
            check()  # the last chance to leave OUT as it was: after the rename the export is complete
        return out
    if "policy" in params:  # LoRA RL: the adapter folded into the base, one rounding to the base's dtype
        params = {"base": lora.merge_lora(policy.config, params, 0.0)}
    check_finite(policy.config, params, step)
    check()
    with _staged(os.path.realpath(out)) as staging:
        hf.save_pretrained(staging, policy.config, params, tokenizer_from=tokenizer_from, check=check)
        check()  # the last chance to leave OUT as it was: after the rename the export is complete
    return out


_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")  # a sharded checkpoint's files


def check_out(run_dir: str, out: str) -> None:
    """Refuse, in one line, an ``out`` that an export must not replace: a file; the run's directory or one that
    holds it, or a place among its checkpoints (an export there mixes a model with the run's records); a directory
    holding anything but a Hugging Face model's files (an export replaces ``out`` whole: they would be deleted)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"{out} exists and is not a directory: lspo-export writes a Hugging Face directory")
    target, run = os.path.realpath(out), os.path.realpath(run_dir)
    if os.path.commonpath([target, run]) == target:
        raise FileExistsError(
            f"{out} is the run directory {run_dir} or holds it: export to a new directory, beside the run or "
            f"inside it (e.g. {os.path.join(run_dir, 'hf')})"
        )
    for records in ("checkpoints", "checkpoints.unreadable"):  # the Checkpointer's, and where it sets steps aside
        if os.path.commonpath([target, os.path.join(run, records)]) == os.path.join(run, records):
            raise CheckpointError(f"{out} is inside {os.path.join(run_dir, records)}: export outside the checkpoints")
    entries = sorted(os.listdir(target)) if os.path.isdir(target) else []
    foreign = [name for name in entries if not os.path.isfile(os.path.join(target, name))]
    if entries and (foreign or not {"config.json", "adapter_config.json"} & set(entries)):
        held = f"{foreign[0]}, not a file" if foreign else "no config.json"
        raise FileExistsError(
            f"{out} holds {held}: lspo-export replaces OUT whole, so only an empty directory or a Hugging Face "
            "model's (a config.json and files); choose a new OUT"
        )
    # A Hugging Face model's files (an earlier export's, a sharded writer's, its card) are replaced; any other file
    # (the user's notes, results) would be deleted with them, so it is refused by name.
    model_files = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                   "adapter_config.json", "adapter_model.safetensors", "tokenizer.model", "README.md",
                   *hf._TOKENIZER_FILES}  # fmt: skip
    others = [name for name in entries if name not in model_files and not _SHARD.fullmatch(name)]
    if others:
        listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise FileExistsError(f"{out} holds files an export does not write ({listed}): lspo-export replaces OUT whole "
                              "and would delete them; move them out or choose a new OUT")  # fmt: skip


@contextlib.contextmanager
def _staged(target: str) -> Iterator[str]:
    """A new directory beside ``target`` (same parent: the rename is atomic, on one file system) for the block to
    write; renamed to ``target`` when the block ends, removed (with the parents made for it) when the block raises,
    a KeyboardInterrupt included. The renames and the removal run with stops held (``_stops_held``): a stop
    between them would leave ``target`` set aside, or half removed."""
    made = _make_parents(target)
    staging = f"{target}.partial-{os.getpid()}"
    try:
        os.mkdir(staging)  # not ``exist_ok``: a directory of that name is not this call's to fill or remove
    except BaseException:
        _remove_empty(made)
        raise
    try:
        yield staging
        with _stops_held():
            _replace(staging, target)
        # Nothing after the rename may raise: the caller's next act is its success line.
    except BaseException:
        with _stops_held():
            shutil.rmtree(staging, ignore_errors=True)
            _remove_empty(made)
        raise


def _replace(staging: str, target: str) -> None:
    """Rename ``staging`` to ``target``. An existing ``target`` is renamed aside first and removed after, so that
    ``target`` never holds a mix of its old files and the new ones (and comes back if the second rename fails)."""
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    aside = f"{target}.replaced-{os.getpid()}"
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def _stops_held() -> Iterator[None]:
    """SIGTERM and Ctrl-C recorded, not acted on, while entered; the record is dropped. Around the last rename of an
    export the stop would otherwise read as "interrupted; nothing was exported" of a complete export, and around a
    cleanup it would cut the cleanup short. Signals reach Python's handlers in the main thread only. The wakeup
    descriptor is taken from the command's own flag meanwhile: its watcher would announce a stop that never comes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wakeup = signal.set_wakeup_fd(-1)
    try:
        with StopFlag():
            yield
    finally:
        signal.set_wakeup_fd(wakeup)


def _make_parents(path: str) -> list[str]:
    """Make the missing directories above ``path`` (OUT's parent may not exist yet); return them, deepest first."""
    missing, parent = [], os.path.dirname(path)
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except BaseException:
        _remove_empty(missing)
        raise
    return missing


def _remove_empty(directories: list[str]) -> None:
    for directory in directories:
        with contextlib.suppress(OSError):  # not empty (another writer's files) or already gone: left as it is
            os.rmdir(directory)


def check_finite(config: ModelConfig, params: Params, step: int) -> None:
    """Refuse, naming the first Hugging Face tensor that holds one, base params with a NaN or an infinity: a
    model.safetensors of them loads without a word and gives NaN logits."""
    if all(bool(flag) for flag in jax.tree.leaves(_finite_leaves(params["base"]))):
        return
    for name, tensor in hf.to_hf_state_dict(config, params):  # the names the export would write
        if not np.all(np.isfinite(tensor)):
            held = "NaN" if np.isnan(tensor).any() else "an infinity"
            raise CheckpointError(f"step {step}: base weight {name} holds {held}; export an earlier step (--step)")


@jax.jit
def _finite_leaves(base: Params) -> Params:
    """Per leaf of ``base``, whether it is all finite: one program on the device, the weights left there."""
    return jax.tree.map(lambda leaf: jnp.all(jnp.isfinite(leaf)), base)
