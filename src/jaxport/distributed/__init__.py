"""Device meshes, logical-axis sharding rules and multi-host start-up."""

from jaxport.distributed.mesh import (LOGICAL_AXIS_RULES, fsdp_shardings, initialize, logical_sharding, make_mesh,
                                      replicate, shard_batch, shard_leading, to_host)

__all__ = ["LOGICAL_AXIS_RULES", "fsdp_shardings", "initialize", "logical_sharding", "make_mesh", "replicate",
           "shard_batch", "shard_leading", "to_host"]
