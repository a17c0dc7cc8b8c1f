"""Orbax checkpoints of a run: base params, the RL optimizer state, the step and the data order.

The adapter is never written: it lives for one step and is discarded (the deliverable is base-only).
Orbax writes each step to a temporary directory and renames it when complete, so a crash mid-write
leaves the previous checkpoint intact; ``keep`` bounds how many are kept. Sharded arrays are written by
the devices (and hosts) that hold them; every process of a multi-host run calls ``save`` and ``restore``.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Save and restore ``{"base": params, "rl_opt": RL optimizer state}`` plus a JSON ``meta`` dict."""

    def __init__(self, directory: str, *, keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        if "lora" in state:
            raise ValueError("refusing to checkpoint an adapter: LSPO's adapter is discarded every step")
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()

    def restore(self, step: int | None, target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore into the structure, shapes, dtypes and shardings of ``target`` (arrays or ShapeDtypeStructs).

        Each leaf comes back in its target's layout, whatever mesh wrote it: a run saved with fsdp = 8 resumes
        on fsdp = 2 x tp = 4 given a target from ``sharding.abstract_params`` / ``opt_state_shardings``.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        return restored["state"], restored["meta"]

    def close(self) -> None:
        self._manager.close()
