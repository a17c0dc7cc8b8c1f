"""The old dotted paths: every module that lived at the package's top imports by its old name as the very module
at its new path (a name patched through either is patched for both), the public functional API among them, and
importing the package or a command's module imports no JAX."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import lspo_jax

# The public functional API, by the paths users import it from (DESIGN.md).
PUBLIC_API = [
    ("lspo_jax.losses", "group_advantages"), ("lspo_jax.losses", "policy_loss"), ("lspo_jax.losses", "sft_loss"),
    ("lspo_jax.rewards", "overlong_penalty"), ("lspo_jax.rewards", "math_reward"),
    ("lspo_jax.scaffold", "find_cliffs"), ("lspo_jax.evaluation", "pass_at_k"), ("lspo_jax.hf", "load_pretrained"),
    ("lspo_jax.hf", "save_pretrained"), ("lspo_jax.model", "forward"),
]  # fmt: skip


@pytest.mark.parametrize(("old", "name"), PUBLIC_API)
def test_the_public_api_imports_by_its_old_path(old, name):
    new = f"lspo_jax.{lspo_jax.MOVED[old.rpartition('.')[2]]}"
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)
    exec(f"from {old} import {name}", {})  # the form users write


@pytest.mark.parametrize("old", sorted(lspo_jax.MOVED))
def test_every_old_module_is_the_moved_one(old):
    module = importlib.import_module(f"lspo_jax.{old}")
    assert module is importlib.import_module(f"lspo_jax.{lspo_jax.MOVED[old]}")
    assert sys.modules[f"lspo_jax.{old}"] is module and getattr(lspo_jax, old) is module
    assert module.__spec__.name == module.__name__  # its own spec, not the old path's


def test_patching_through_the_old_path_patches_the_module(monkeypatch):
    from lspo_jax import losses
    from lspo_jax.rl import losses as moved

    monkeypatch.setattr(losses, "sft_loss", "patched")
    assert moved.sft_loss == "patched"


def test_an_unknown_old_name_is_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lspo_jax.no_such_module")


def test_a_folder_exports_resolve():
    for folder in ("models", "tasks", "rollout", "rl", "job", "methods.first_mistake", "methods.l2rr"):
        package = importlib.import_module(f"lspo_jax.{folder}")
        for name in dir(package):
            assert getattr(package, name) is not None, f"lspo_jax.{folder}.{name}"


def test_importing_the_package_or_a_command_imports_no_jax():
    """The commands start fast: their module imports JAX only when a command runs."""
    code = "import sys, lspo_jax.cli, lspo_jax.job, lspo_jax.rl, lspo_jax.methods.l2rr; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_python_dash_m_on_an_old_path_runs_the_moved_module():
    """``python -m lspo_jax.make_toy_model``-style calls by an old path ran into ``AttributeError`` in runpy (the
    finder had no ``get_code``); they run the moved module's code."""
    done = subprocess.run([sys.executable, "-m", "lspo_jax.compiles"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_an_empty_out_is_a_usage_error_naming_the_flag(capsys):
    from lspo_jax.job import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.train_main(["--config", "configs/demo.yaml", "--out", ""])
    assert exit_info.value.code == 2 and "--out '': name the run's directory" in capsys.readouterr().err
