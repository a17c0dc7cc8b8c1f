"""The public functional API by its real paths and, for one release, its pre-folder ones (with a warning naming
the real path; every other old name is gone); importing the package or a command's module imports no JAX."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import lspo_jax

# The public functional API (docs/architecture.md): (real module, name).
PUBLIC_API = [
    ("rl.losses", "group_advantages"), ("rl.losses", "policy_loss"), ("rl.losses", "sft_loss"),
    ("tasks.rewards", "overlong_penalty"), ("tasks.rewards", "math_reward"), ("rl.scaffold", "find_cliffs"),
    ("job.evaluation", "pass_at_k"), ("models.hf", "load_pretrained"), ("models.hf", "save_pretrained"),
    ("models.model", "forward"),
]  # fmt: skip
OLD = {new: old for old, (new, _) in lspo_jax.DEPRECATED.items()}


def test_the_deprecation_table_is_the_public_api():
    assert sorted((new, name) for new, names in lspo_jax.DEPRECATED.values() for name in names) == sorted(PUBLIC_API)


@pytest.mark.parametrize(("new", "name"), PUBLIC_API)
def test_the_public_api_by_its_old_path_warns_with_the_real_one(new, name):
    old = f"lspo_jax.{OLD[new]}"
    with pytest.warns(DeprecationWarning, match=rf"^{old}\.{name} is lspo_jax\.{new}\.{name}; the old path goes in"):
        exec(f"from {old} import {name} as got", scope := {})  # the form users write
    assert scope["got"] is getattr(importlib.import_module(f"lspo_jax.{new}"), name)


def test_an_old_path_keeps_only_the_public_names():
    from lspo_jax import losses

    with pytest.raises(AttributeError, match=r"^lspo_jax\.losses has no 'token_mean': import it from lspo_jax\.rl"):
        losses.token_mean  # noqa: B018
    with pytest.raises(ImportError):
        exec("from lspo_jax.losses import token_mean", {})


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [("train_config", "job.config_io", "load_config"), ("train_config", "job.config_io", "apply_overrides"),
     ("train_config", "step_config", "LossConfig"), ("options", "optim_config", "RLOptimConfig")],
)  # fmt: skip
def test_a_config_name_that_moved_warns_with_its_real_path(old, new, name):
    with pytest.warns(DeprecationWarning, match=rf"^lspo_jax\.{old}\.{name} is lspo_jax\.{new}\.{name}; the old path"):
        exec(f"from lspo_jax.{old} import {name} as got", scope := {})
    assert scope["got"] is getattr(importlib.import_module(f"lspo_jax.{new}"), name)
    with pytest.raises(ImportError):
        exec(f"from lspo_jax.{old} import no_such_name", {})


@pytest.mark.parametrize("old", ["compiles", "cli", "sampler", "l2rr", "first_mistake", "no_such_module"])
def test_an_old_module_outside_the_public_api_is_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"lspo_jax.{old}")


def test_importing_the_package_warns_of_nothing():
    done = subprocess.run([sys.executable, "-W", "error", "-c", "import lspo_jax"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module("lspo_jax.rl.losses")  # a real path never warns


def test_a_folder_exports_resolve():
    for folder in ("models", "tasks", "rollout", "rl", "job", "methods.first_mistake", "methods.l2rr"):
        package = importlib.import_module(f"lspo_jax.{folder}")
        for name in dir(package):
            assert getattr(package, name) is not None, f"lspo_jax.{folder}.{name}"


def test_importing_the_package_or_a_command_imports_no_jax():
    """The commands start fast: their module imports JAX only when a command runs."""
    modules = "lspo_jax.job.cli, lspo_jax.job.eval_command, lspo_jax.job.errors, lspo_jax.job, lspo_jax.rl"
    code = f"import sys, {modules}, lspo_jax.methods.l2rr; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_an_empty_out_is_a_usage_error_naming_the_flag(capsys):
    from lspo_jax.job import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.train_main(["--config", "configs/demo.yaml", "--out", ""])
    assert exit_info.value.code == 2 and "--out '': name the run's directory" in capsys.readouterr().err
