"""A run directory between runs: the records it holds (a new run is refused over them), the ``config.yaml`` a run
writes (an earlier one kept as ``config.stepN.yaml`` when a resume changes a setting), and what a resume may change:
any setting but those that decide what the checkpoint means, and the model's place (``model.path`` moved, copied or
named on the hub) but not the model, compared by its shapes and vocabulary with what the run's checkpoints recorded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from typing import Any

import yaml

from lspo_jax import options
from lspo_jax.job.build import model_dir
from lspo_jax.job.config_io import to_dict
from lspo_jax.tasks.text import error_cause
from lspo_jax.train_config import ConfigError, TrainConfig


def check_resumable(run: TrainConfig, out_dir: str, *, writer: bool = True) -> str | None:
    """Refuse to resume what the checkpoints cannot hold: another model than the run's own (the arrays would not
    fit it, and the error would come from deep inside the restore), or an adapter lifetime that checkpoints the
    adapter where the run's did not (or the reverse). How the model computes (dtype, remat, attention) may change.

    A ``model.path`` other than the one in the run's ``config.yaml`` is the same model moved (``check_moved_model``):
    accepted when its shapes are the run's. Returns, for a move whose shapes could not be compared, what to say if
    the checkpoint then does not restore into it; None otherwise. ``writer``: the process that says what it found."""
    path = os.path.join(out_dir, "config.yaml")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        saved = yaml.safe_load(f) or {}
    saved_path = (saved.get("model") or {}).get("path")
    unchecked = None
    if saved_path is not None and saved_path != run.model.path:
        unchecked = check_moved_model(run, out_dir, saved_path, writer=writer)
    lifetimes = options.ADAPTER_LIFETIMES
    saved_adapter = (saved.get("scaffold") or {}).get("adapter", run.scaffold.adapter)
    if saved_adapter not in lifetimes:
        return unchecked  # a config.yaml from another version: the restore says what does not fit
    if lifetimes.resolve(saved_adapter).checkpointed != lifetimes.resolve(run.scaffold.adapter).checkpointed:
        raise ConfigError(
            f"--resume: scaffold.adapter {run.scaffold.adapter!r} cannot continue the run's checkpoints, written "
            f"with {saved_adapter!r} (one keeps the adapter in them, the other not); start a new run to change it"
        )
    return unchecked


def check_moved_model(run: TrainConfig, out_dir: str, saved_path: str, *, writer: bool = True) -> str | None:
    """Accept ``model.path`` in place of the run's ``saved_path`` when it holds the same model: the same
    ``model_shapes``, read from both directories' files (a hub name or ``toy`` resolved as the run resolves it), or
    from the checkpoint's record of them (``recorded_model_shapes``) first, which is the model the checkpoint was
    trained from even if ``saved_path`` now holds another. Refuses another model in one line naming what differs.

    When the run recorded nothing and ``saved_path`` is gone, the move is accepted unchecked: the restore refuses
    arrays of other shapes anyway (orbax checks each one), and the returned line says so then (``Run._restore``)."""
    cache = os.path.join(out_dir, "cache")
    try:
        new = model_shapes(model_dir(run, cache))
    except (OSError, ValueError) as err:
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConfigError(
            f"--resume: model.path {run.model.path!r} is not the run's {saved_path!r} and holds no model to compare "
            f"with it ({first}); resume without --config to use the run's own config"
        ) from None
    old = recorded_model_shapes(out_dir)
    if old is None:
        try:
            old = model_shapes(model_dir(_with_model_path(run, saved_path), cache))
        except (OSError, ValueError):  # moved, not copied: gone from there
            old = None
    say = (lambda line: print(f"lspo-train: {line}", file=sys.stderr)) if writer else (lambda line: None)
    if old is None:
        say(f"model.path moved from {saved_path} to {run.model.path}: the shapes could not be compared ({saved_path} "
            "cannot be read, and the run's checkpoints do not record them); resuming: a checkpoint of other shapes "
            "does not restore")  # fmt: skip
        return f"moved from {saved_path}, its shapes not compared"
    differ = [f"{key} {new[key]}, the run's model had {old[key]}" for key in old
              if new.get(key) is not None and old[key] is not None and new[key] != old[key]]  # fmt: skip
    if differ:
        raise ConfigError(
            f"--resume: model.path {run.model.path}: {'; '.join(differ)} (at {saved_path}); the run's checkpoints "
            "do not fit it: resume with the run's own model, or start a new run to train another"
        )
    say(f"model.path moved from {saved_path} to {run.model.path}: the same model (shapes and vocabulary); resuming")
    return None


def _with_model_path(run: TrainConfig, path: str) -> TrainConfig:
    return dataclasses.replace(run, model=dataclasses.replace(run.model, path=path))


def model_shapes(directory: str) -> dict[str, Any]:
    """What fixes the shapes of a model's params, read from its ``config.json`` (with ``from_hf_config``'s
    defaults) without loading a weight, and its tokenizer's vocabulary size (None when its files do not tell).

    A checkpoint restores into a model only if these agree; the other fields (rope, norms, positions) change how the
    model computes, not what it holds."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):  # hf.load_pretrained's words
        what = "no such directory" if not os.path.isdir(directory) else "no config.json in it"
        raise FileNotFoundError(f"{directory}: not a Hugging Face model directory ({what})")
    with open(path) as f:
        hf = json.load(f)
    try:
        heads = hf["num_attention_heads"]
        shapes = {
            "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
            "num_hidden_layers": hf["num_hidden_layers"], "num_attention_heads": heads,
            "num_key_value_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
            "intermediate_size": hf["intermediate_size"],
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }  # fmt: skip
    except KeyError as err:
        raise ValueError(f"{directory}/config.json has no {err.args[0]}") from None
    return {**shapes, "tokenizer_vocab_size": tokenizer_vocab_size(directory)}


def tokenizer_vocab_size(directory: str) -> int | None:
    """Tokens the directory's tokenizer knows, added ones included: from ``tokenizer.json`` (the Rust tokenizer
    parses it without building a transformers tokenizer), else ``vocab.json`` and the added tokens of
    ``tokenizer_config.json``; None for other formats."""
    fast = os.path.join(directory, "tokenizer.json")
    if os.path.exists(fast):
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(fast).get_vocab_size(with_added_tokens=True)
        except Exception as err:  # the Rust tokenizer raises its own kind for a file it cannot read
            raise ValueError(f"{fast}: {error_cause(err)}") from None
    slow = os.path.join(directory, "vocab.json")
    if not os.path.exists(slow):
        return None
    with open(slow) as f:
        vocab = json.load(f)
    added = {}
    if os.path.exists(config := os.path.join(directory, "tokenizer_config.json")):
        with open(config) as f:
            added = json.load(f).get("added_tokens_decoder") or {}
    return len(vocab) + sum(entry.get("content") not in vocab for entry in added.values())


# Where orbax puts a checkpoint's JSON meta (``Checkpointer``'s item "meta", the JSON handler's file name): read
# directly, it costs no orbax manager before the resume's other refusals.
META_FILE = os.path.join("meta", "metadata")


def recorded_model_shapes(out_dir: str) -> dict[str, Any] | None:
    """The ``model_shapes`` the run's newest checkpoint recorded (``Run.save``); None for a checkpoint written before
    they were recorded, or a meta that cannot be read (the restore then says what is wrong with it)."""
    directory = os.path.join(out_dir, "checkpoints")
    steps = sorted((int(name) for name in os.listdir(directory) if name.isdigit()), reverse=True)
    for step in steps:
        try:
            with open(os.path.join(directory, str(step), META_FILE)) as f:
                shapes = json.load(f).get("model")
        except (OSError, ValueError, AttributeError):
            continue
        return shapes if isinstance(shapes, dict) else None
    return None


# What a run leaves in its directory, as ``Run`` writes it: a new run would mix its own into them (TensorBoard shows
# both runs' events as one, W&B continues the old run) or replace them. Plots and the model cache are not records.
RECORDS = ("config.yaml", "metrics.jsonl", "summary.json", "tensorboard", "wandb_id", "checkpoints")


def run_records(out_dir: str) -> list[str]:
    """The ``RECORDS`` in ``out_dir`` (a folder among them when it holds anything), folders with a ``/``."""
    held = []
    for name in RECORDS:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            held += [f"{name}/"] if os.listdir(path) else []
        elif os.path.exists(path):
            held.append(name)
    return held


def new_run_refused(out_dir: str, records: list[str]) -> FileExistsError:
    """The refusal of a new run (no ``--resume``) into a directory holding an earlier run's ``records``, with the
    newest checkpoint step that ``--resume`` would continue (orbax names finished steps by number)."""
    held = ", ".join(records)
    checkpoints = os.path.join(out_dir, "checkpoints")
    steps = [int(name) for name in os.listdir(checkpoints) if name.isdigit()] if "checkpoints/" in records else []
    if steps:
        return FileExistsError(f"--out {out_dir} already holds a run ({held}; checkpoint at step {max(steps)}): pass "
                               "--resume to continue it, or choose another --out")  # fmt: skip
    return FileExistsError(f"--out {out_dir} already holds a run's records ({held}) and no checkpoint to resume from: "
                           "choose another --out, or remove them to start a new run there")  # fmt: skip


def record_config(run: TrainConfig, out_dir: str, step: int | None) -> None:
    """Write the run's ``config.yaml``. Resuming at ``step`` with settings that differ from the file's, the file
    the steps so far ran with is kept beside it as ``config.step<step>.yaml`` (the first such file for that step
    stays), and a line names what changed."""
    path = os.path.join(out_dir, "config.yaml")
    new = to_dict(run)
    if step and os.path.exists(path):
        with open(path) as f:
            old = yaml.safe_load(f) or {}
        changed = [key for key in _changed(old, new) if key != "mesh.process_id"]  # each host's own
        if changed:
            kept = os.path.join(out_dir, f"config.step{step}.yaml")
            if not os.path.exists(kept):
                shutil.copyfile(path, kept)
            shown = ", ".join(f"{key} {_get(old, key)!r} -> {_get(new, key)!r}" for key in changed[:6])
            more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
            print(f"lspo-train: --resume changes {shown}{more}; steps 1-{step} ran with {kept}", file=sys.stderr)
    with open(path + ".tmp", "w") as f:  # replaced whole: a full disk or a stop leaves the old file, not half one
        yaml.safe_dump(new, f, sort_keys=False)
    os.replace(path + ".tmp", path)


def _changed(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = dict.fromkeys([*old, *new])
        return [k for key in keys for k in _changed(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [prefix[:-1]]


def _get(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree
