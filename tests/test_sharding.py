"""Meshes and layouts: sharded equals unsharded on 8 CPU devices, and the pure rules without devices.

The 8-device checks run in one subprocess (``sharded_checks.py``): this process started JAX with one device
before any test here ran, and the device count cannot change afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from lspo_jax.config import ModelConfig
from lspo_jax.models import axes as mesh_axes
from lspo_jax.models import sharding, specs

pytestmark = pytest.mark.slow  # 8-device checks in subprocesses

# A sharded program sums in another order (and XLA's CPU kernels differ between x86 builds): float32 rounding only.
# Logits (up to 1.5), log-probs (near -ln 96 = -4.6), the loss (0.19) and metrics differ by <= 1e-6 measured, a
# few ulps of their scale: 1e-4 leaves 100x, while a sharding bug (a missing all-reduce, a wrong split) moves
# them by O(1) of their scale.
TOL = 1e-4
# Gradients: the largest difference against the largest entry of the unsharded gradient (<= 7e-7 measured).
GRAD_REL = 1e-4
# Parameters after Adam steps of lr 1e-3 (eps 1e-3: updates follow the gradient smoothly) differ by an ulp of the
# O(1) params (1.2e-7 measured); 1e-5 is 1% of one step, far below what a wrong update changes.
PARAM_TOL = 1e-5


@pytest.fixture(scope="module")
def checks() -> dict:
    script = os.path.join(os.path.dirname(__file__), "helpers", "sharded_checks.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


# ---------------------------------------------------------------------------------------- 8 devices
@pytest.mark.parametrize("layout", ["fsdp8", "fsdp4_tp2", "fsdp2_tp4"])
def test_sharded_forward_loss_and_gradients_equal_single_device(checks, layout):
    got = checks["steps"][layout]
    assert got["logits"] < TOL and got["loss"] < TOL
    assert got["grads"] < GRAD_REL * checks["steps"]["grad_scale"]


def test_fused_attention_on_a_mesh_equals_einsum_on_one_device(checks):
    """``attention: xla`` with rows over fsdp = 2 and query heads over tp = 4 (KV heads repeated) against the
    einsum path unsharded."""
    got = checks["steps"]["fused_fsdp2_tp4"]
    assert got["logits"] < TOL and got["loss"] < TOL
    assert got["grads"] < GRAD_REL * checks["steps"]["grad_scale"]


def test_sharded_step_builders_equal_single_device(checks):
    got = checks["steps"]["builders"]
    assert got["rl_step_params"] < PARAM_TOL and got["rl_step_metrics"] < TOL and got["logprobs"] < TOL
    # The layouts came from the rules: q is [layers, embed, heads, head_dim]; Adam's moment of the embedding
    # [vocab, embed] follows the parameter.
    assert got["q_spec"] == str(PartitionSpec(None, "fsdp", "tp", None))
    assert got["embed_mu_spec"] == str(PartitionSpec("tp", "fsdp"))


def test_packed_rows_on_a_mesh_equal_padded_rows_on_one_device(checks):
    """The RL and SFT gradients, the RL step and both log-prob passes over packed token buffers (several segments a
    row) on fsdp = 4 x tp = 2, against the padded rows on one device."""
    got = checks["packed"]
    assert got["most_segments"] > 1
    # Relative to each value's scale: <= 4.1e-7 measured (losses, gradients against their largest entry; a few ulps).
    for name in ("rl", "sft"):
        assert got[name]["loss"] < 1e-6 and got[name]["grads"] < 1e-6, name
    assert got["rl_step_params"] < PARAM_TOL and got["rl_step_loss"] < 1e-6
    # Log-probs up to 5.6 in size: 9.5e-7 measured, 2 ulps; 1e-6 of the scale.
    assert max(got["logprobs_0"], got["logprobs_1"]) < 1e-6 * got["logprob_scale"]


def test_sampler_on_a_mesh_equals_single_device(checks):
    got = checks["sampler"]["fsdp4_tp2"]
    assert got["tokens_equal"] and got["lengths_equal"]
    assert got["logprobs"] < TOL
    # Rows moved into a smaller bucket on the mesh: the same samples as one device without moving them.
    moved = checks["sampler"]["compacted"]
    assert moved["compactions"] >= 1 and moved["tokens_equal"] and moved["lengths_equal"]
    assert moved["logprobs"] < TOL


def test_pallas_decode_kernel_on_a_mesh_whose_tp_cannot_split_the_kv_heads(checks):
    got = checks["decode_kernel"]
    assert got["max_abs_diff"] < 1e-5 * max(1.0, got["scale"])  # float32 sums of <= 48 terms, values of O(1)


def test_fsdp8_holds_an_eighth_of_the_parameters_per_device(checks):
    got = checks["param_bytes"]
    assert got["batch_placed"]  # sharding.global_batch and host_local_batch: rows split over fsdp
    assert got["r1_base"] == pytest.approx(1 / 8, rel=1e-3)
    assert got["tiny_base"] == pytest.approx(1 / 8, rel=0.05)  # the q/k/v biases are whole on every device
    assert got["r1_all"] < 1.06 / 8  # the adapter is 0.8% of the 1.5B model's parameters


def test_checkpoint_saved_on_one_mesh_restores_on_another(checks):
    got = checks["checkpoint"]
    assert got["values"] == 0.0 and got["layouts_match"] and got["meta_step"] == 3
    assert got["q_spec"] == str(PartitionSpec(None, "fsdp", "tp", None))


# ---------------------------------------------------------------------------------------- no devices
def test_mesh_config_resolves_and_validates():
    assert sharding.MeshConfig().shape(8) == (1, 8, 1)
    assert sharding.MeshConfig(data=2, fsdp=-1, tp=2).shape(8) == (2, 2, 2)
    assert sharding.MeshConfig(data=1, fsdp=4, tp=2).shape(8) == (1, 4, 2)
    with pytest.raises(ValueError, match="at most one axis"):
        sharding.MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="tp"):
        sharding.MeshConfig(tp=0)
    with pytest.raises(ValueError, match="do not divide"):
        sharding.MeshConfig(tp=3).shape(8)
    with pytest.raises(ValueError, match="there are 8 devices"):
        sharding.MeshConfig(data=2, fsdp=2, tp=1).shape(8)


def test_rules_drop_axes_that_do_not_divide():
    mesh = AbstractMesh((1, 2, 4), mesh_axes.MESH_AXES)
    config = ModelConfig.preset("tiny")  # 4 heads, 2 KV heads, embed 64
    axes = specs.logical_axes(config)["base"]["layers"]
    shapes = specs.abstract_params(config)["base"]["layers"]
    spec = lambda name: mesh_axes.logical_spec(shapes[name].shape, axes[name], mesh)
    assert spec("q") == PartitionSpec(None, "fsdp", "tp", None)
    assert spec("k") == PartitionSpec(None, "fsdp", None, None)  # 2 KV heads on tp = 4: replicated
    assert spec("down") == PartitionSpec(None, "tp", "fsdp")
    # Rows over data and fsdp together; a mesh axis of size 1 is left out; a row count that does not divide
    # is replicated rather than an error.
    assert mesh_axes.logical_spec((8, 16), ("batch", None), mesh) == PartitionSpec("fsdp", None)
    assert mesh_axes.logical_spec((3, 16), ("batch", None), mesh) == PartitionSpec(None, None)
    both = AbstractMesh((2, 2, 2), mesh_axes.MESH_AXES)
    assert mesh_axes.logical_spec((8,), ("batch",), both) == PartitionSpec(("data", "fsdp"))
    # A mesh axis is used once per array: batch takes fsdp first, so embed stays whole.
    assert mesh_axes.logical_spec((8, 64), ("batch", "embed"), both) == PartitionSpec(("data", "fsdp"), None)


def test_host_batch_slice_tiles_the_batch():
    slices = [sharding.host_batch_slice(512, i, 4) for i in range(4)]
    assert [(s.start, s.stop) for s in slices] == [(0, 128), (128, 256), (256, 384), (384, 512)]
    with pytest.raises(ValueError, match="does not split"):
        sharding.host_batch_slice(10, 0, 4)
    with pytest.raises(ValueError, match="process_index"):
        sharding.host_batch_slice(8, 4, 4)


def test_initialize_distributed_is_a_no_op_for_one_process(monkeypatch):
    for name in (
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    assert sharding.initialize_distributed() is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert sharding.initialize_distributed(coordinator="localhost:1234") is False


def test_training_loop_on_a_mesh_equals_single_device(checks):
    """Two LSPO steps (sample, score, adapter SFT, re-roll, splice, RL update) on fsdp = 4 x tp = 2."""
    got = checks["train_loop"]
    assert got["records"] == 2 and got["cliffs"] >= 1 and got["spliced"] >= 1  # the scaffold ran on the mesh
    assert got["q_spec"] == str(PartitionSpec(None, "fsdp", "tp", None))  # the run's params were split
    assert got["moved"] > 100 * PARAM_TOL  # the base trained, so equal params are not equal by standing still
    assert got["params"] < PARAM_TOL and got["metrics"] < TOL


def test_the_runs_sampler_splits_rows_over_every_device_of_a_tp_mesh():
    """The run's ``Generator`` samples on its mesh's devices with ``tp`` folded into ``fsdp`` (a TPU's decode loop
    copied a cache split over ``tp``); a mesh without ``tp`` is its own sampling mesh."""
    from jax.sharding import AxisType

    from lspo_jax.rollout.generator import Generator

    auto = (AxisType.Auto,) * 3
    tp_mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tp"), axis_types=auto)
    folded = sharding.sampling_mesh(tp_mesh)
    assert dict(folded.shape) == {"data": 2, "fsdp": 4, "tp": 1}
    assert Generator(None, tp_mesh).mesh == folded
    rows_only = AbstractMesh((1, 8, 1), ("data", "fsdp", "tp"), axis_types=auto)
    assert sharding.sampling_mesh(rows_only) is rows_only


def test_lspo_eval_samples_on_every_device_with_the_first_device_s_responses(checks):
    got = checks["eval"]
    assert got["status"] == [0, 0] and got["devices"] == [8, 1]
    assert got["samples"] == 4 * 2 and got["responses_equal"]  # 4 problems x n 2, token for token
