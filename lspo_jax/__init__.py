"""LoRA Scaffolded Policy Optimization in JAX: one folder per layer, each importing only the ones below it.

    config, options, train_config, text   the run's frozen config and option names (import no folder)
    hub         models and datasets by their Hugging Face hub names, from the standard cache
    models/     the Qwen2 forward pass, attention kernels, logical axes and the mesh, Hugging Face conversion
    tasks/      prompts, gold answers and worked solutions; the math verifier and its worker pool; the toy task
    rollout/    sampling: the KV cache, the JAX sampler, the vLLM engine
    rl/         the training step: losses, log-probs, optimizers, the scaffold, the learner, checkpoints
    methods/    optional methods the step never names: first_mistake/ (token advantages from a judge) and l2rr/
                (a learned prompt sampler with a target's scores around the update)
    job/        a training run end to end: the loop, validation, metrics, plots, export, the commands

Modules that lived at the package's top before the folders still import by their old dotted names
(``lspo_jax.losses``, ``lspo_jax.hf``, ...): ``_OldPaths`` resolves each to the moved module itself, so a name
patched through either path is patched for both. The two modules that were split, ``l2rr`` and ``reweight``,
resolve to the ``methods.l2rr`` package, which exports the names they held: patch those in the module that defines
them. Names that moved between modules (e.g. the per-token log-probs from ``losses`` to ``logprobs``) are found at
their new module only; the public API of DESIGN.md keeps every old path. Importing the package imports nothing else
(no JAX): the commands start fast.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from typing import Any

# Old top-level module -> its module now: the moves by folder, then the ones renamed or split on the way.
_MOVED_AS_IS = {
    "models": "axes flash hf kernels model qwen_vocab sharding",
    "tasks": "data example_store rewards toy verify_pool",
    "rollout": "kv_cache sampler vllm_sampler",
    "rl": "checkpoint corrections distributed learner logprobs losses optim packing prompts scaffold train",
    "job": "cli compiles evaluation export metrics_log plots progress run run_lock tables toy_model",
}
MOVED = {name: f"{folder}.{name}" for folder, names in _MOVED_AS_IS.items() for name in names.split()} | {
    "first_mistake": "methods.first_mistake.advantages",
    "sentences": "methods.first_mistake.sentences",
    "teacher": "methods.first_mistake.teacher",
    # Both split: the method's folder exports the names they held (dynamic sampling's are in ``rl.rounds``).
    "l2rr": "methods.l2rr",
    "reweight": "methods.l2rr",
}


class _OldPaths:
    """Imports ``lspo_jax.<old>`` as the module at its new path: the same module object under both names. A meta-path
    finder and its loader (``importlib.abc``'s protocols, not its classes: importing that costs the commands' start)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        package, _, old = fullname.rpartition(".")
        if package != __name__ or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system keeps the module's __name__ but sets __spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state  # already executed under its own name: its own spec back

    def get_code(self, fullname: str) -> Any:
        """The moved module's code: ``python -m lspo_jax.<old>`` runs it as ``python -m`` of its new path would."""
        new = f"{__name__}.{MOVED[fullname.rpartition('.')[2]]}"
        spec = importlib.util.find_spec(new)
        return spec.loader.get_code(new)


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())  # before an editable install's finder, which knows the old files


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Any, Any]:
    """``(__getattr__, __dir__)`` for a folder's ``__init__``: ``names`` maps each name it exports to the module
    (relative to ``package``, or a whole dotted path) that defines it, imported at first use, so importing a
    folder costs nothing."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = names[name] if names[name].startswith(f"{__name__}.") else f"{package}.{names[name]}"
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
