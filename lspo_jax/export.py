"""A run's checkpoint -> a Hugging Face directory that ``transformers`` loads (base model only).

``lspo-export RUN_DIR OUT`` reads ``RUN_DIR/config.yaml``, rebuilds the policy the run trained, restores the
base params of the latest (or a chosen) checkpoint and writes ``config.json``, ``model.safetensors`` and the
tokenizer files. There is no adapter to export: LSPO discards it every step and never checkpoints it.
"""

from __future__ import annotations

import os

import jax

from lspo_jax import hf
from lspo_jax.checkpoint import Checkpointer
from lspo_jax.run import abstract_checkpoint_state, load_policy, model_dir
from lspo_jax.train_config import load_config


def export_checkpoint(run_dir: str, out: str, step: int | None = None) -> str:
    """Write the base params of checkpoint ``step`` (default: the latest) of ``run_dir`` to ``out``; return ``out``."""
    run = load_config(os.path.join(run_dir, "config.yaml"))
    cache_dir = os.path.join(run_dir, "cache")
    policy, _ = load_policy(run, cache_dir)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    # Restored onto one device: export gathers the whole model on the host anyway.
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        abstract_checkpoint_state(run, policy.config),
    )
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=run.checkpoint.keep)
    try:
        restored, _ = checkpointer.restore(step, target)
    finally:
        checkpointer.close()
    hf.save_pretrained(out, policy.config, {"base": restored["base"]}, tokenizer_from=model_dir(run, cache_dir))
    return out
