"""Deprecated: the host-memory policy is `jaxport.runtime.host_memory`."""

import warnings

from jaxport.runtime import host_memory

warnings.warn("jaxport.malloc moved to jaxport.runtime.host_memory", DeprecationWarning, stacklevel=2)


def keep_freed_memory() -> None:
    """`host_memory.tune_process(training=True)`."""
    host_memory.tune_process(training=True)


def reuse_memory_for(compiled) -> None:
    """`host_memory.keep_temporaries(compiled)`."""
    host_memory.keep_temporaries(compiled)


def restart_with_huge_pages() -> None:
    """No longer restarts the process: set `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` before starting it instead."""
