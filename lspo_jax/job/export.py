"""A run's checkpoint -> a Hugging Face directory that ``transformers`` loads (base model only).

``lspo-export RUN_DIR OUT`` reads ``RUN_DIR/config.yaml``, rebuilds the policy the run trained, restores the
base params of the latest (or a chosen) checkpoint and writes ``config.json``, ``model.safetensors`` and the
tokenizer files. There is no adapter to export: LSPO discards it every step and never checkpoints it. Weights that
hold a NaN or an infinity are refused, naming the tensor and the step.
``lspo-eval`` restores a run's checkpoint the same way (``restore_run``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax.config import ModelConfig
from lspo_jax.job.build import abstract_checkpoint_state, load_policy, model_dir
from lspo_jax.models import hf
from lspo_jax.models.model import Params
from lspo_jax.rl.checkpoint import Checkpointer, CheckpointError
from lspo_jax.rl.learner import Policy
from lspo_jax.train_config import TrainConfig, load_config


def is_run_dir(path: str) -> bool:
    """True for a training run's output directory (its ``config.yaml`` and ``checkpoints/``)."""
    return os.path.isfile(os.path.join(path, "config.yaml")) and os.path.isdir(os.path.join(path, "checkpoints"))


def restore_run(
    run_dir: str, step: int | None = None, overrides: Sequence[str] = ()
) -> tuple[TrainConfig, Policy, Params, int]:
    """The run's config (with ``overrides``), its policy and the base params ``{"base": ...}`` of checkpoint
    ``step`` (default: the latest), and that step."""
    run = load_config(os.path.join(run_dir, "config.yaml"), list(overrides))
    policy, _ = load_policy(run, os.path.join(run_dir, "cache"))
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
    return run, policy, {"base": restored["base"]}, int(meta["step"])


def check_run_dir(run_dir: str) -> None:
    """Refuse, in one line, a path that is not a training run's output directory."""
    if not is_run_dir(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a training run (no config.yaml and checkpoints/ in it)")


def export_checkpoint(run_dir: str, out: str, step: int | None = None) -> str:
    """Write the base params of checkpoint ``step`` (default: the latest) of ``run_dir`` to ``out``; return ``out``."""
    check_run_dir(run_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"{out} exists and is not a directory: lspo-export writes a Hugging Face directory")
    run, policy, params, step = restore_run(run_dir, step)
    check_finite(policy.config, params, step)
    hf.save_pretrained(out, policy.config, params, tokenizer_from=model_dir(run, os.path.join(run_dir, "cache")))
    return out


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
