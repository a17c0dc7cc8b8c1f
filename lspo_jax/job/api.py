"""The Python API: a run from a script or a notebook, the same run ``lspo-train`` makes (``docs/python.md``).

    summary = lspo_jax.train("configs/demo.yaml", out="runs/demo", overrides=["steps=10"])   # the whole run
    with lspo_jax.open_run(config, out="runs/mine") as run:                                   # a loop of one's own
        rows = run.learner.sample(...); rows = run.learner.score(rows, examples); ...

``train``, ``open_run`` and ``load_config`` are importable from ``lspo_jax`` and stable. A config is a YAML path, a
mapping of the YAML's sections, or a ``RunConfig``; ``overrides`` are the command's ``dotted.key=value`` strings.
Reward functions given as Python callables become ``reward.functions`` entries by their import path, so the run's
``config.yaml`` names them and ``lspo-train --resume`` continues the run as the command would have made it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lspo_jax import step_config
from lspo_jax.job import config as job_config
from lspo_jax.job import config_io
from lspo_jax.train_config import ConfigError

Config = str | Path | Mapping[str, Any] | job_config.RunConfig
Callback = Callable[[dict], Any]


def load_config(
    config: Config | None = None, overrides: Sequence[str] = (), *, reward_functions: Sequence[Any] | None = None
) -> job_config.RunConfig:
    """The run's whole config (``RunConfig``) from a YAML path, a mapping of its sections or a config (None: the
    defaults, the paper's shape), with ``overrides`` laid on top and ``reward_functions`` (see ``train``) in place of
    ``reward.functions``. Checked whole: a bad key or value is a ``ConfigError`` naming it."""
    overrides = list(overrides)
    if reward_functions is not None:
        overrides.append(f"reward.functions={json.dumps([_function_entry(f) for f in reward_functions])}")
    if isinstance(config, job_config.RunConfig):
        data = config_io.to_dict(config)
        return config_io.from_dict(job_config.RunConfig, config_io.apply_overrides(data, overrides))
    if isinstance(config, Mapping):
        return config_io.from_dict(job_config.RunConfig, config_io.apply_overrides(dict(config), overrides))
    return job_config.load_config(config, overrides)


def open_run(
    config: Config, out: str | Path, *, overrides: Sequence[str] = (), reward_functions: Sequence[Any] | None = None,
    callbacks: Sequence[Callback] = (), resume: bool = False, verifier: Any = None,
) -> Any:  # fmt: skip
    """A started run (``job.run.Run``) writing to ``out``: the policy, data, verifier and learner built from the
    config, nothing trained yet. ``run.train()`` trains it as ``lspo-train`` does; or drive it one verb at a time
    (``run.learner.sample / score / logprobs / rl_step``, ``run.one_step()``, ``run.validate()``, ``run.save()``).
    Use it in a ``with`` block, which closes it (the verifier's workers, the checkpointer, the run's lock).
    ``resume`` continues from ``out``'s latest checkpoint; ``verifier`` replaces the math-verify pool."""
    from lspo_jax.job.run import Run

    run = _prepared(load_config(config, overrides, reward_functions=reward_functions))
    return Run(run, str(out), resume=resume, verifier=verifier, callbacks=callbacks)


def train(
    config: Config, out: str | Path, *, overrides: Sequence[str] = (), reward_functions: Sequence[Any] | None = None,
    callbacks: Sequence[Callback] = (), resume: bool = False, plots: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Train as ``lspo-train --config CONFIG --out OUT OVERRIDES...`` does, into the same run directory
    (``config.yaml``, ``metrics.jsonl``, checkpoints, ``summary.json``, plots unless ``plots=False``), and return the
    run's summary. SIGTERM and Ctrl-C stop it with a checkpoint (``summary["stopped_early"]``); ``resume=True``
    continues it.

    ``reward_functions``: in place of ``reward.functions``, each a callable defined at the top level of a module or a
    ``.py`` file (the verifier's worker processes import it by that path), a path string, or a mapping of a
    ``reward.functions`` entry whose ``fn`` may be such a callable (``{"fn": my_reward, "weight": 0.1}``).
    ``callbacks``: called with each record the run writes (``train``, ``eval``); one returning True stops the run.
    """
    from lspo_jax.job.run import train_run

    run = _prepared(load_config(config, overrides, reward_functions=reward_functions))
    summary = train_run(run, str(out), resume=resume, callbacks=callbacks)  # RunStopped: non-finite in a row
    if plots:
        import jax

        from lspo_jax.job.plots import plot_run

        if jax.process_index() == 0:
            plot_run(str(out))
    return summary


def _prepared(run: job_config.RunConfig) -> job_config.RunConfig:
    """What ``lspo-train`` does before a run starts: the device memory share and the compile cache, set before JAX's
    backends start and before anything compiles (each read once per process)."""
    from lspo_jax.job.build import claim_device_memory
    from lspo_jax.job.compiles import use_cache

    run = claim_device_memory(run)
    use_cache(run.compile_cache)
    return run


def _function_entry(item: Any) -> dict[str, Any]:
    """A ``reward.functions`` entry (a mapping) from a callable, a path string or a mapping whose ``fn`` is either."""
    if isinstance(item, step_config.RewardFunctionConfig):
        return dataclasses.asdict(item)
    entry = dict(item) if isinstance(item, Mapping) else {"fn": item}
    if callable(entry.get("fn")):
        entry.setdefault("name", entry["fn"].__name__)
        entry["fn"] = function_path(entry["fn"])
    if not isinstance(entry.get("fn"), str):
        raise ConfigError(f"reward_functions: {item!r} is not a function, a path or an entry with fn")
    return entry


def function_path(fn: Callable) -> str:
    """The path ``options.load_function`` reads ``fn`` back from: ``module:name`` when its module imports by name,
    else ``file.py:name`` (a script's, a file's loaded by path). A lambda, a nested function or one typed into a
    notebook has neither: a one-line ``ConfigError`` says where to put it."""
    name, module = getattr(fn, "__qualname__", ""), getattr(fn, "__module__", None)
    if not name or "<" in name or "." in name:
        raise ConfigError(f"reward_functions: {fn!r} cannot be imported by the verifier's worker processes; define it "
                          "at the top level of a module or a .py file")  # fmt: skip
    if module and module != "__main__" and _importable(module):
        return f"{module}:{name}"
    try:
        source = inspect.getsourcefile(fn)
    except TypeError:
        source = None
    if not source or not source.endswith(".py") or not Path(source).is_file():
        raise ConfigError(f"reward_functions: {name} has no module or .py file to import it from (a notebook "
                          "cell's?); write it to a .py file and pass the function from there, or its path")  # fmt: skip
    return f"{Path(source).resolve()}:{name}"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None and not module.startswith("lspo_plugin_")
    except (ImportError, ValueError):
        return False
