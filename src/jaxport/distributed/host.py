"""Moving device arrays to the host, one helper per kind of transfer. In a multi-host run a
"global" array spans every process's devices, so each kind needs its own collective (or none)."""

import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def fetch_replicated(tree):
    """Replicated (or single-device) arrays as numpy, read from this process's own copies in one
    transfer: no collective, so any process may call it alone (losses, metrics, a halting flag)."""

    def own_copy(x):
        return x.addressable_data(0) if isinstance(x, jax.Array) and not x.is_fully_addressable else x

    return jax.tree.map(np.asarray, jax.device_get(jax.tree.map(own_copy, tree)))


def gather_to_host(tree):
    """Numpy copies of whole (possibly sharded, possibly multi-host) arrays on every process; a
    collective: every process must call it (e.g. to write a single-file checkpoint)."""
    if jax.process_count() > 1:
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


def local_rows(x: jax.Array, mesh: Mesh) -> np.ndarray:
    """This process's rows of a batch-sharded array (the rows it fed in), as numpy."""
    if x.is_fully_addressable:
        return np.asarray(x)
    spec = P(("data", "fsdp"), *([None] * (x.ndim - 1)))
    return np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, spec))


def gather_objects(obj) -> list:
    """Every process's `obj` (any picklable payload, of any size), on every process; a collective."""
    if jax.process_count() == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([payload.size], np.int64))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: payload.size] = payload
    gathered = multihost_utils.process_allgather(padded)
    return [pickle.loads(gathered[i, : int(sizes[i, 0])].tobytes()) for i in range(gathered.shape[0])]
