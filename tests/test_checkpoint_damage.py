"""Damage that reads back as numbers: bytes flipped in a checkpoint's file (orbax keeps no checksum of array data, so
the step restores with other values; its sha256 digest catches them) and a checkpoint whose weights hold a NaN
(refused by lspo-export, naming the tensor)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from run_fixtures import FakeVerifier, assert_trees_equal, one_line, trees_differ

from lspo_jax.job import cli
from lspo_jax.job.export import export_checkpoint
from lspo_jax.job.run import Run
from lspo_jax.rl.checkpoint import Checkpointer, CheckpointError


def flip_a_byte(step_dir: str) -> None:
    """Invert the middle byte of the largest file of a checkpoint step, keeping its size (a disk's bit rot)."""
    files = [os.path.join(d, f) for d, _, names in os.walk(step_dir) for f in names]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.seek(os.path.getsize(largest) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def read_by_orbax_alone(step_dir: str, like):
    """The step's arrays as orbax reads them, with no digest check."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"), abstract)


def test_flipped_bytes_are_caught_by_the_digest_and_the_step_before_restores(tmp_path):
    rng = np.random.default_rng(0)
    # Random bits with the exponent's top bit clear (|x| < 2, never NaN or infinity) do not compress: the file holds
    # them as they are, so a flipped byte is one other number and every file still decodes.
    weights = (rng.integers(0, 2**32, (64, 64), dtype=np.uint32) & np.uint32(0xBFFFFFFF)).view(np.float32)
    state = {"base": {"w": jnp.asarray(weights), "b": jnp.ones(64)}, "rl_opt": [jnp.zeros(64), jnp.int32(3)]}
    directory = tmp_path / "checkpoints"
    checkpointer = Checkpointer(str(directory), keep=5)
    for step in (1, 2, 3):
        checkpointer.save(step, state, {"step": step})
    (directory / "1" / "meta" / "metadata").write_text(json.dumps({"step": 1}))  # as written before the digest
    flip_a_byte(str(directory / "3"))
    assert trees_differ(read_by_orbax_alone(str(directory / "3"), state), state)  # orbax reads other numbers
    restored, meta, failures = checkpointer.restore_readable(state)
    assert meta == {"step": 2}  # the digest is the checkpoint's own: not handed back with the run's meta
    assert_trees_equal(restored, state)
    assert failures == [
        f"checkpoint step 3 in {directory} is unreadable: its array base.w does not match the sha256 saved with it "
        "(a damaged file)"
    ]
    assert checkpointer.readable_steps(state) == [1, 2]
    # A restore in another dtype (a resume with another model.param_dtype) casts the arrays: not taken for damage.
    as_bf16 = {**state, "base": {**state["base"], "w": state["base"]["w"].astype(jnp.bfloat16)}}
    assert checkpointer.restore(2, as_bf16)[0]["base"]["w"].dtype == jnp.bfloat16
    assert checkpointer.restore(1, state)[1] == {"step": 1}
    checkpointer.set_aside([3])
    assert checkpointer.steps() == [1, 2] and os.listdir(f"{directory}.unreadable") == ["3"]
    checkpointer.close()


def test_a_run_with_a_flipped_checkpoint_is_not_exported_and_resumes_from_the_step_before(
    trained_run, make_config, train_file, easy_rule, tmp_path, capsys
):
    run_dir = str(shutil.copytree(trained_run["dir"], tmp_path / "run"))
    step_dir = os.path.join(run_dir, "checkpoints", "4")
    flip_a_byte(step_dir)
    target = jax.tree.map(jnp.asarray, trained_run["state"])
    assert trees_differ(read_by_orbax_alone(step_dir, target), target)  # orbax alone reads other numbers
    assert cli.export_main([run_dir, str(tmp_path / "hf")]) == 2
    err = one_line(capsys, "lspo-export")
    assert "checkpoint step 4 in" in err and "does not match the sha256 saved with it" in err, err
    assert "readable steps: 2 (pass --step)" in err and not os.path.exists(tmp_path / "hf")
    config = make_config(steps=4, eval__benchmarks=[train_file])
    resumed = Run(config, run_dir, resume=True, verifier=FakeVerifier(easy_rule))
    try:
        assert resumed.state.step == 2
    finally:
        resumed.close()
    err = capsys.readouterr().err
    assert "does not match the sha256" in err and "resuming from step 2, the newest readable checkpoint" in err, err
    assert os.listdir(os.path.join(run_dir, "checkpoints.unreadable")) == ["4"]


def test_export_refuses_weights_that_hold_a_nan(trained_run, tmp_path, capsys):
    run_dir = str(shutil.copytree(trained_run["dir"], tmp_path / "run"))
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=5)
    state, meta = checkpointer.restore(4, jax.tree.map(jnp.asarray, trained_run["state"]))
    layers = state["base"]["layers"]
    state["base"]["layers"] = {**layers, "up": layers["up"].at[1, 0, 0].set(jnp.nan)}  # layer 1's up-projection
    checkpointer.save(6, state, {**meta, "step": 6})  # a NaN trained in and saved: a sound file, a bad model
    checkpointer.close()
    out = str(tmp_path / "hf")
    message = "step 6: base weight model.layers.1.mlp.up_proj.weight holds NaN; export an earlier step (--step)"
    with pytest.raises(CheckpointError) as info:
        export_checkpoint(run_dir, out)
    assert str(info.value) == message
    assert cli.export_main([run_dir, out]) == 2
    assert f"lspo-export: {message}\n" in one_line(capsys, "lspo-export") and not os.path.exists(out)
    assert export_checkpoint(run_dir, out, step=4) == out
