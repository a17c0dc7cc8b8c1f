"""LoRA Scaffolded Policy Optimization in JAX: one folder per layer, each importing only the ones below it.

    options     every option's values and the checks of a config's fields
    config      the model's frozen config (its shape, numerics and LoRA adapters)
    train_config, step_config, optim_config
                the run's frozen config, section by section, each key's meaning the docstring under its field
    hub         models and datasets by their Hugging Face hub names, from the standard cache (the root's one
                module beyond the config: tasks/, which reads only the root, fetches datasets with it, and job/
                the policy's weights)
    models/     the Qwen2 forward pass, attention kernels, logical axes and the mesh, Hugging Face conversion
    tasks/      prompts, gold answers and worked solutions; the math verifier and its worker pool; the toy task
    rollout/    sampling: the KV cache, the JAX sampler, the vLLM engine
    rl/         the training step: losses, log-probs, optimizers, the scaffold, the learner, checkpoints
    methods/    optional methods the step never names: first_mistake/ (token advantages from a judge) and l2rr/
                (a learned prompt sampler with a target's scores around the update)
    job/        a training run end to end: the loop, validation, metrics, plots, export, the commands

The Python API is importable from the package itself, each imported at first use (``PUBLIC``): ``lspo_jax.train``
(a whole run, as ``lspo-train`` makes it), ``lspo_jax.open_run`` (a started run, for a loop of one's own over its
learner's verbs) and ``lspo_jax.load_config`` (``docs/python.md``).

The public functional API (``DEPRECATED``) also imports by its pre-folder paths (``lspo_jax.losses.policy_loss``, ...),
for release 0.1 only: each such name warns with a ``DeprecationWarning`` naming its real path, and every other
old name is gone. Importing the package imports nothing else (no JAX): the commands start fast.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import warnings
from typing import Any

REMOVED_IN = "0.2.0"
# Old top-level module -> (its module now, the public names it keeps there): the public functional API users
# unit-test the loss math with (docs/architecture.md).
DEPRECATED = {
    "losses": ("rl.losses", ("group_advantages", "policy_loss", "sft_loss")),
    "rewards": ("tasks.rewards", ("overlong_penalty", "math_reward")),
    "scaffold": ("rl.scaffold", ("find_cliffs",)),
    "evaluation": ("job.evaluation", ("pass_at_k",)),
    "hf": ("models.hf", ("load_pretrained", "save_pretrained")),
    "model": ("models.model", ("forward",)),
}


def _deprecated_module(old: str) -> types.ModuleType:
    """``lspo_jax.<old>``: a module holding only the public names, each read from its real module with a warning."""
    new, names = DEPRECATED[old]
    module = types.ModuleType(f"{__name__}.{old}", f"Deprecated: the public names of {__name__}.{new}.")

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"{__name__}.{old} has no {name!r}: import it from {__name__}.{new}")
        warnings.warn(f"{__name__}.{old}.{name} is {__name__}.{new}.{name}; the old path goes in {REMOVED_IN}",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return getattr(importlib.import_module(f"{__name__}.{new}"), name)

    module.__getattr__ = __getattr__
    module.__all__ = list(names)
    return module


class _OldPaths:
    """Imports ``lspo_jax.<old>`` for the names of ``DEPRECATED``. A meta-path finder and its loader
    (``importlib.abc``'s protocols, not its classes: importing that costs the commands' start)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        package, _, old = fullname.rpartition(".")
        if package != __name__ or old not in DEPRECATED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> Any:
        return _deprecated_module(spec.name.rpartition(".")[2])

    def exec_module(self, module: Any) -> None:
        pass


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())


def moved_names(module: str, names: dict[str, str]) -> Any:
    """A module's ``__getattr__`` for the public names that moved out of it: ``names`` maps each to the module it
    lives in now (relative to the package); reading one there warns with a ``DeprecationWarning`` naming that path,
    for release 0.1 only."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new = f"{__name__}.{names[name]}"
        warnings.warn(f"{module}.{name} is {new}.{name}; the old path goes in {REMOVED_IN}", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        return getattr(importlib.import_module(new), name)

    return __getattr__


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


# The Python API (``job.api``), stable names of the package itself, imported at first use: ``import lspo_jax`` stays
# free of JAX, so the commands start fast.
PUBLIC = {"train": "job.api", "open_run": "job.api", "load_config": "job.api"}
__all__ = sorted(PUBLIC)
_public_getattr, _ = lazy_exports(__name__, PUBLIC)


def __getattr__(name: str) -> Any:
    return _public_getattr(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
