"""Device meshes, logical-axis sharding rules, host transfers and multi-host start-up."""

from jaxport.distributed.host import fetch_replicated, gather_objects, gather_to_host, local_rows
from jaxport.distributed.launch import initialize, initialize_from_argv
from jaxport.distributed.mesh import (
    LOGICAL_AXIS_RULES,
    logical_constraint,
    logical_sharding,
    logical_spec,
    make_mesh,
    parse_mesh,
    replicate,
    shard_batch,
    shard_leading,
    tree_shardings,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "fetch_replicated",
    "gather_objects",
    "gather_to_host",
    "initialize",
    "initialize_from_argv",
    "local_rows",
    "logical_constraint",
    "logical_sharding",
    "logical_spec",
    "make_mesh",
    "parse_mesh",
    "replicate",
    "shard_batch",
    "shard_leading",
    "tree_shardings",
]
