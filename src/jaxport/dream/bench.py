"""Deprecated: `jaxport.dream.throughput`."""

import warnings

from jaxport.dream.throughput import environment, peak_memory_bytes, run, timed  # noqa: F401

warnings.warn("jaxport.dream.bench is now jaxport.dream.throughput", DeprecationWarning, stacklevel=2)
