"""The model's logical axes and the one table that maps them onto the mesh axes ``data``, ``fsdp`` and ``tp``.

A leaf module: the model pins activations with ``constrain`` and ``sharding`` derives every layout from
``LOGICAL_RULES``, so neither imports the other for it (see ``sharding`` for the mesh itself).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

MESH_AXES = ("data", "fsdp", "tp")

# Logical axis -> mesh axes it is split over. Logical axes not listed (layers, head_dim, lora_rank, the
# sequence) are replicated. "batch" names the rows of every batch, activation and KV cache.
LOGICAL_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp",)),
    ("vocab", ("tp",)),
    ("heads", ("tp",)),
    ("kv_heads", ("tp",)),
    ("mlp", ("tp",)),
)


def logical_spec(
    shape: Sequence[int],
    axes: Sequence[str | None],
    mesh: Mesh | jax.sharding.AbstractMesh,
    rules: Sequence[tuple[str, tuple[str, ...]]] = LOGICAL_RULES,
) -> PartitionSpec:
    """The ``PartitionSpec`` of an array of ``shape`` whose dimensions are named ``axes``.

    A rule is dropped for a dimension whose size does not divide by its mesh axes (e.g. 2 KV heads on
    tp = 4: replicated there), so every layout is legal whatever the model and mesh sizes. Mesh axes of
    size 1 are left out, and a mesh axis is used at most once per array.
    """
    if len(shape) != len(axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(axes)} differ in rank")
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for size, name in zip(shape, axes, strict=True):
        mesh_axes = tuple(a for a in table.get(name, ()) if mesh.shape[a] > 1 and a not in used)
        if not mesh_axes or size % math.prod(mesh.shape[a] for a in mesh_axes):
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout to its logical ``axes`` (None: replicated) under the current mesh.

    The model calls this at a few points (the residual stream, projections, logits) so that the
    partitioner splits activations by rows and gathers weights, rather than the reverse. Outside a mesh
    context (``jax.set_mesh`` / ``jax.sharding.use_abstract_mesh``), and on a mesh of one device, where there
    is nothing to split and a constraint would only stand between XLA's fusions, it returns ``x`` unchanged.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(x.shape, axes, mesh))
