"""What a run is built from (``job/build.py``): the mesh its config asks for, refused in one line where the devices
cannot hold it, and said where the sizes it names go unused."""

from __future__ import annotations

import jax
import pytest

from lspo_jax.job import build
from lspo_jax.train_config import ConfigError, load_config


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
