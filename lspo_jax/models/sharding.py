"""Device meshes and the one table that maps the model's logical axes onto them.

The mesh has three axes: ``data`` (pure data parallelism: whole replicas), ``fsdp`` (data parallelism
whose replicas also split the weights and optimizer state, ZeRO-3 style) and ``tp`` (tensor parallelism:
heads, MLP hidden units and vocabulary split across devices). The model names its dimensions logically
(``specs.logical_axes``: layers, vocab, embed, heads, ...); ``axes.LOGICAL_RULES`` is the only place
that says which mesh axes a logical axis is split over. Everything else (parameter, optimizer-state,
batch and KV-cache layouts) derives from the rules, so it cannot drift apart.

XLA's SPMD partitioner (GSPMD) inserts every collective: the jitted programs only declare the layouts
of their inputs and outputs (``jax.jit`` with ``in_shardings``/``out_shardings``). Several hosts run the
same program on one global mesh after ``initialize_distributed``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from lspo_jax.config import ModelConfig
from lspo_jax.models import attention, specs
from lspo_jax.models.axes import LOGICAL_RULES, MESH_AXES, logical_spec


# ---------------------------------------------------------------------------------------------- mesh
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the ``data``, ``fsdp`` and ``tp`` mesh axes; one of them may be -1: the rest of the devices."""

    data: int = 1
    fsdp: int = -1
    tp: int = 1

    def __post_init__(self) -> None:
        sizes = dataclasses.asdict(self)
        for name, size in sizes.items():
            if not (isinstance(size, int) and (size >= 1 or size == -1)):
                raise ValueError(f"MeshConfig.{name}: must be a positive int or -1, got {size!r}")
        if list(sizes.values()).count(-1) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1 (the rest of the devices), got {sizes}")

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """``(data, fsdp, tp)`` for ``num_devices`` devices, with -1 resolved; an error if they do not fit."""
        sizes = (self.data, self.fsdp, self.tp)
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"MeshConfig {self}: {num_devices} devices do not divide by the fixed axes ({known})")
            sizes = tuple(num_devices // known if s == -1 else s for s in sizes)
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"MeshConfig {self}: data * fsdp * tp = {math.prod(sizes)}, but there are {num_devices} devices"
            )
        return sizes


def make_mesh(mesh_config: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "fsdp", "tp")`` mesh over ``devices`` (all devices of all hosts by default).

    ``jax.make_mesh`` orders devices so that ``tp`` (the most communication-hungry axis) stays inside a host's
    fast interconnect. Axes are ``Auto``: the partitioner propagates layouts from the declared inputs.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_config.shape(len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def local_mesh() -> Mesh:
    """This process's first device as a 1 x 1 x 1 mesh: one program per pass whether a run has one device or
    many (on several hosts each process holds its own)."""
    return _local_mesh(jax.local_devices()[0])


@functools.cache
def _local_mesh(device: jax.Device) -> Mesh:
    return make_mesh(MeshConfig(1, 1, 1), [device])


def sampling_mesh(mesh: Mesh | jax.sharding.AbstractMesh) -> Mesh | jax.sharding.AbstractMesh:
    """The run's sampler mesh: ``mesh``'s devices, in order, with ``tp`` folded into ``fsdp``, so decoding splits
    rows over every device and each holds whole layers. A cache split by KV heads over ``tp`` was laid out anew
    inside a TPU's decode loop and copied back after it (19.2 GiB of temporaries a chip at the paper's shape on
    fsdp 4 x tp 2, against 1.2 on fsdp 8: over a v6e's budget); whole layers of the 1.5B model cost 1.7 GiB more."""
    data, fsdp, tp = (dict(mesh.shape)[axis] for axis in MESH_AXES)
    if tp == 1:
        return mesh
    shape, types = (data, fsdp * tp, 1), mesh.axis_types
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return jax.sharding.AbstractMesh(shape, MESH_AXES, axis_types=types)
    return Mesh(mesh.devices.reshape(shape), MESH_AXES, axis_types=types)


def mesh_or_local(mesh: Mesh | None) -> Mesh:
    """``mesh``, or ``local_mesh()`` when None (the functional APIs' default)."""
    return local_mesh() if mesh is None else mesh


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _without(rules: Sequence[tuple[str, tuple[str, ...]]], mesh_axis: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((name, tuple(a for a in axes if a != mesh_axis)) for name, axes in rules)


# ------------------------------------------------------------------------------------------- params
@functools.cache  # built per call of every pass otherwise; callers only read it
def param_shardings(config: ModelConfig, mesh: Mesh, *, gather_fsdp: bool = False) -> specs.Params:
    """``NamedSharding`` for every parameter (``{"base", "lora"}``), from ``specs.param_specs`` and the rules.

    ``gather_fsdp=True`` keeps weights whole across the ``fsdp`` axis (split over ``tp`` only): the decode
    layout, where re-gathering FSDP-split weights at every generated token would cost more traffic than
    the replicated weights cost memory.
    """
    rules = _without(LOGICAL_RULES, "fsdp") if gather_fsdp else LOGICAL_RULES
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, logical_spec(spec.shape, spec.axes, mesh, rules)),
        specs.param_specs(config),
        is_leaf=lambda x: isinstance(x, specs.ParamSpec),
    )


def abstract_params(config: ModelConfig, mesh: Mesh) -> specs.Params:
    """``specs.abstract_params`` with each leaf's sharding: a sharded init or restore target, no allocation."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        specs.abstract_params(config),
        param_shardings(config, mesh),
    )


def shard_params(params: specs.Params, shardings: specs.Params) -> specs.Params:
    """Place ``params`` on the mesh; ``shardings`` may cover more subtrees (e.g. base + lora) than params hold."""
    return jax.device_put(params, _matching(shardings, params))


def _matching(shardings: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    return {key: shardings[key] for key in params}


def opt_state_shardings(config: ModelConfig, mesh: Mesh, tx: optax.GradientTransformation) -> Any:
    """Shardings of ``tx.init(params)``: a moment follows its parameter's sharding, scalars are replicated.

    A state leaf is matched to its parameter by key path (Adam's ``mu`` and ``nu`` are copies of the params
    tree, so their paths end in the parameter's path) and the shapes must agree; the optimizer state is
    traced with ``jax.eval_shape``, never allocated.
    """
    by_path = {
        _dict_keys(path): (sharding, spec.shape)
        for (path, spec), sharding in zip(
            jax.tree_util.tree_leaves_with_path(specs.abstract_params(config)),
            jax.tree.leaves(param_shardings(config, mesh)),
            strict=True,
        )
    }

    def leaf_sharding(path, leaf):
        sharding, shape = by_path.get(_dict_keys(path), (None, None))
        return sharding if shape == leaf.shape else replicated(mesh)

    abstract_state = jax.eval_shape(tx.init, specs.abstract_params(config))
    return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_state)


def _dict_keys(path: tuple[Any, ...]) -> tuple[str, ...]:
    """The trailing run of dict keys of a key path: the parameter path inside an optimizer-state leaf's."""
    keys = []
    for entry in reversed(path):
        if not isinstance(entry, jax.tree_util.DictKey):
            break
        keys.append(entry.key)
    return tuple(reversed(keys))


# -------------------------------------------------------------------------------------- activations
def batch_sharding(mesh: Mesh, rows: int | None = None) -> NamedSharding:
    """Rows (axis 0) split over ``data`` and ``fsdp``; any trailing axes replicated.

    One sharding fits every leaf of a batch dict (``[B]`` and ``[B, T]`` alike). With ``rows`` given, a row
    count that does not divide gives the replicated layout instead of an error.
    """
    if rows is None:
        rows = batch_shards(mesh)
    return NamedSharding(mesh, logical_spec((rows,), ("batch",), mesh))


def batch_shards(mesh: Mesh) -> int:
    """How many ways ``batch_sharding`` splits the rows: the product of the data-parallel axes' sizes."""
    return math.prod(mesh.shape[a] for a in dict(LOGICAL_RULES)["batch"])


def kv_cache_sharding(config: ModelConfig, mesh: Mesh, rows: int) -> NamedSharding:
    """Layout of a layer's ``[B, K, S, E]`` cache leaf: rows over ``data`` + ``fsdp``, KV heads over ``tp``
    if they divide. Slots and head dim are never split, so it is also the layout of slots-last keys ``"kT"``.

    ``rows`` is the cache's row count: a count that does not divide leaves the rows whole.
    """
    shape = (rows, config.num_kv_heads, 1, config.head_dim)
    return NamedSharding(mesh, logical_spec(shape, attention.CACHE_AXES, mesh))


def device_bytes(tree: Any) -> int:
    """Bytes the first addressable device holds of the arrays in ``tree`` (its shards)."""
    device = jax.local_devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


# ----------------------------------------------------------------------------------------- multi-host
def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Join the processes of a multi-host job (``jax.distributed.initialize``); call before any JAX use.

    Missing arguments come from ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0), ``JAX_NUM_PROCESSES``
    and ``JAX_PROCESS_ID``; under SLURM or Open MPI with none of them set, JAX detects all three itself.
    A single process (no setting, or a count of 1, outside such a cluster) is a no-op. Returns whether
    the distributed runtime was started.
    """
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if num_processes == 1:
        return False
    in_cluster = int(os.environ.get("SLURM_NTASKS", "1")) > 1 or int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    if coordinator is None and num_processes is None and process_id is None and not in_cluster:
        return False
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value in (None, "") else int(value)


def fetch(x: jax.Array) -> np.ndarray:
    """A global array as one host array on every host (gathered across hosts when there are several)."""
    return np.asarray(x) if jax.process_count() == 1 else np.asarray(multihost_utils.process_allgather(x, tiled=True))


def host_batch_slice(global_batch: int, process_index: int, process_count: int) -> slice:
    """The rows of a global batch that host ``process_index`` of ``process_count`` loads (contiguous blocks).

    Hosts own consecutive device blocks of the mesh, so host i's rows are block i of the batch axis.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if global_batch % process_count:
        raise ValueError(f"global batch of {global_batch} rows does not split over {process_count} hosts")
    per_host = global_batch // process_count
    return slice(process_index * per_host, (process_index + 1) * per_host)


def global_batch(mesh: Mesh, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """Global arrays laid out by ``batch_sharding`` from a batch that every host holds whole.

    The training loop's case: every host runs the same data order and gathers the rollouts, so each one
    copies only the rows its own devices hold. Works alike on one host and on many.
    """

    def place(x: np.ndarray) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, batch_sharding(mesh, x.shape[0]), lambda index: x[index])

    return {k: place(v) for k, v in batch.items()}


def host_local_batch(mesh: Mesh, local_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """Global arrays from each host's own rows (``host_batch_slice``), laid out by ``batch_sharding``.

    For input pipelines where a host loads only its rows; on one host this is a sharded ``device_put``.
    """
    rows = next(iter(local_batch.values())).shape[0] * jax.process_count()
    sharding = batch_sharding(mesh, rows)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}
