"""Meshes over all devices (all hosts), with logical axis names mapped onto mesh axes.

Every family names array dimensions logically (`batch`, `embed`, `heads`, ...) and
these rules decide which mesh axis, if any, splits them, as MaxText does. Weights and activations name
their embedding dimension apart: FSDP splits the weights' `embed`, while activations keep theirs whole and
are split by `batch` (`logical_constraint`), so XLA gathers the weights where a layer needs them instead of
splitting the products' contraction and all-reducing partial sums over the whole batch.
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxport.errors import JaxportError

# logical dimension -> mesh axis (or tuple of axes); absent means replicated.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "seq": None,
    "activation_embed": None,
}


def make_mesh(data: int = -1, fsdp: int = 1, model: int = 1, devices=None) -> Mesh:
    """A `(data, fsdp, model)` mesh over `devices` (default: every device of every process).
    One of the sizes may be -1: it takes whatever the others leave."""
    devices = jax.devices() if devices is None else devices
    sizes = [data, fsdp, model]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis size may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh (data={sizes[0]}, fsdp={sizes[1]}, model={sizes[2]}) does not cover {len(devices)} devices"
        )
    return Mesh(np.asarray(devices).reshape(sizes), ("data", "fsdp", "model"))


def parse_mesh(spec: str | None, devices=None) -> Mesh | None:
    """`--mesh DATA,FSDP,MODEL` sizes -> a mesh over `devices` (default: every device; None without a spec)."""
    if not spec:
        return None
    try:
        data, fsdp, model = (int(v) for v in spec.split(","))
        return make_mesh(data=data, fsdp=fsdp, model=model, devices=devices)
    except ValueError as err:
        count = jax.device_count() if devices is None else len(devices)
        raise JaxportError(
            f"--mesh {spec!r}: expected DATA,FSDP,MODEL sizes covering {count} devices ({err})"
        ) from None


def logical_spec(mesh, *logical_axes: str | None, shape: tuple | None = None) -> P:
    """The PartitionSpec of an array whose dimensions have these logical names on `mesh` (a Mesh or an
    AbstractMesh). With `shape`, a dimension that its mesh axes do not divide evenly is replicated instead."""
    spec = []
    for i, name in enumerate(logical_axes):
        axes = LOGICAL_AXIS_RULES.get(name) if name else None
        if isinstance(axes, tuple):
            axes = tuple(a for a in axes if mesh.shape[a] > 1) or None
            axes = axes[0] if axes and len(axes) == 1 else axes
        elif axes is not None and mesh.shape[axes] == 1:
            axes = None
        if axes is not None and shape is not None:
            ways = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
            axes = axes if shape[i] % ways == 0 else None
        spec.append(axes)
    return P(*spec)


def logical_sharding(mesh: Mesh, *logical_axes: str | None, shape: tuple | None = None) -> NamedSharding:
    """NamedSharding for an array whose dimensions have these logical names (see `logical_spec`)."""
    return NamedSharding(mesh, logical_spec(mesh, *logical_axes, shape=shape))


def logical_constraint(x, *logical_axes: str | None):
    """`x`, whose dimensions have these logical names, placed by the rules on the mesh of the program being
    traced (`jax.sharding.use_abstract_mesh`, set by the step that jits it); unchanged without one (one
    device, or a program that sets no mesh), so a single-device program stays as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(mesh, *logical_axes, shape=x.shape))


def tree_shardings(tree, mesh: Mesh, logical_axes_of):
    """Shardings for a tree of parameters: `logical_axes_of(dotted path)` names each array's dimensions
    (a family's table of logical axes), and `logical_sharding` places them on the mesh."""

    def sharding(path, x):
        dotted = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return logical_sharding(mesh, *logical_axes_of(dotted), shape=np.shape(x))

    return jax.tree_util.tree_map_with_path(sharding, tree)


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, P()))


def _batch_sharding(mesh: Mesh, ndim: int, batch_dim: int = 0) -> NamedSharding:
    axes = [None] * ndim
    axes[batch_dim] = "batch"
    return logical_sharding(mesh, *axes)


def shard_batch(batch, mesh: Mesh, batch_dim: int = 0):
    """Global arrays from each process's own rows: the leading (batch) dimension is split over the
    mesh's batch axes and every process supplies the rows its devices hold (one process: all rows).
    `batch_dim` names another dimension as the batch, e.g. -2 for micro-batches `[steps, B, T]`."""

    arrays, treedef = jax.tree.flatten(batch)
    arrays = [np.asarray(x) for x in arrays]
    shardings = [_batch_sharding(mesh, x.ndim, batch_dim) for x in arrays]
    if jax.process_count() == 1:  # all rows are this process's: one batched transfer, less host time per step
        return jax.tree.unflatten(treedef, jax.device_put(arrays, shardings))
    placed = [jax.make_array_from_process_local_data(s, x) for s, x in zip(shardings, arrays)]
    return jax.tree.unflatten(treedef, placed)


def shard_leading(tree, mesh: Mesh):
    """Split the leading dimension of arrays that every process holds whole (e.g. a fresh ACT carry)."""
    return jax.tree.map(lambda x: jax.device_put(x, _batch_sharding(mesh, x.ndim)), tree)
