"""What a run is built from (``job/build.py``): the mesh its config asks for, refused in one line where the devices
cannot hold it, and said where the sizes it names go unused; the optional methods, one of a kind."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import jax
import pytest

from lspo_jax.job import build, config_io
from lspo_jax.job.config import RunConfig, load_config
from lspo_jax.train_config import ConfigError

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def test_a_mesh_the_devices_cannot_hold_is_a_config_error_naming_the_keys():
    run = load_config(None, ["mesh.enabled=true", "mesh.tp=3"])
    with pytest.raises(ConfigError, match=rf"mesh: .*set mesh.data, mesh.fsdp and mesh.tp to multiply to the "
                                          rf"{jax.device_count()} devices"):  # fmt: skip
        build.run_mesh(run)


def test_mesh_sizes_on_one_device_are_said_to_go_unused(capsys):
    if jax.device_count() != 1:
        pytest.skip("the run spans every device when JAX sees more than one")
    mesh = build.run_mesh(load_config(None, ["mesh.tp=2"]))
    assert mesh.devices.size == 1
    assert "mesh sizes {'data': 1, 'fsdp': -1, 'tp': 2} are not used: JAX sees one device" in capsys.readouterr().err
    build.run_mesh(load_config(None, []))
    assert capsys.readouterr().err == ""  # the defaults name no sizes: nothing to say


# A toy method, composed as a method's own section is (``job.config``) and plugged in where the builder finds the
# methods: a prompt source and a token-advantages strategy that each say they were built.
@dataclasses.dataclass(frozen=True)
class ToySection:
    enabled: bool = False


@dataclasses.dataclass(frozen=True)
class WithToy(RunConfig):
    toy_method: ToySection = dataclasses.field(default_factory=ToySection)


def toy_run(*overrides: str) -> WithToy:
    return config_io.load_config(DEMO, list(overrides), cls=WithToy)


@pytest.mark.parametrize("kind", ["prompt", "token-advantages"])
def test_a_method_is_its_section_and_one_entry_and_two_of_one_kind_are_refused(kind, monkeypatch):
    table = build.PROMPT_METHODS if kind == "prompt" else build.ADVANTAGE_METHODS
    other = "l2rr" if kind == "prompt" else "first_mistake"
    monkeypatch.setitem(table, "toy_method", lambda *args: f"toy {kind}")
    if kind == "prompt":
        make = lambda run: build.prompt_source(run, [object()], policy=types.SimpleNamespace(config=None))
        on = ["l2rr.enabled=true", "l2rr.target=toy:heldout_2digit"]
    else:
        make = lambda run: build.make_token_advantages(run, policy=None, base_params=None, mesh=None)
        on = ["first_mistake.enabled=true"]
    assert make(toy_run("toy_method.enabled=true")) == f"toy {kind}"
    both = sorted([other, "toy_method"], key=list(table).index)  # named in the table's order
    message = rf"^{both[0]}\.enabled and {both[1]}\.enabled: both are {kind} methods and a run takes one; turn one off$"
    with pytest.raises(ConfigError, match=message):
        make(toy_run("toy_method.enabled=true", *on))
