"""Multi-host start-up, the same for every family: `--coordinator HOST:PORT --num-processes N
--process-id I`, or the JAXPORT_COORDINATOR / JAXPORT_NUM_PROCESSES / JAXPORT_PROCESS_ID variables, or
JAX's auto-detection on TPU pods and GPU clusters (SLURM, Open MPI)."""

import argparse
import os

import jax

from jaxport.errors import JaxportError

CLUSTER_VARIABLES = ("SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "OMPI_COMM_WORLD_SIZE")


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """Start multi-host JAX when the arguments, the JAXPORT_* variables or a cluster say so; else nothing."""
    coordinator_address = coordinator_address or os.environ.get("JAXPORT_COORDINATOR")
    if coordinator_address is None and num_processes is None:
        if any(os.environ.get(v) for v in CLUSTER_VARIABLES):
            jax.distributed.initialize()
        return
    try:
        num_processes = num_processes if num_processes is not None else int(os.environ["JAXPORT_NUM_PROCESSES"])
        process_id = process_id if process_id is not None else int(os.environ["JAXPORT_PROCESS_ID"])
    except (KeyError, ValueError):
        raise JaxportError(
            "a coordinator needs --num-processes N and --process-id I (or JAXPORT_NUM_PROCESSES and JAXPORT_PROCESS_ID)"
        ) from None
    if not 0 <= process_id < num_processes:
        raise JaxportError(f"--process-id {process_id} must lie in 0..{num_processes - 1} (--num-processes)")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id)


def initialize_from_argv(argv: list[str]) -> list[str]:
    """Take the multi-host flags out of `argv`, start multi-host JAX if asked, return the rest."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    flags, rest = parser.parse_known_args(argv)
    initialize(flags.coordinator, flags.num_processes, flags.process_id)
    return rest
