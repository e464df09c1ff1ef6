"""Compilation: the seconds JAX spends tracing, lowering and compiling (from jax.monitoring's compile events: the
time of a first call less a later call's is no measure of it where the machine's speed drifts), and the `jaxport`
command's on-disk cache of compiled programs. The XLA options programs compile with are `jaxport.runtime`'s."""

import os
from pathlib import Path

import jax
from jax import monitoring

# programs that compile faster than this are not worth a file (docs/performance.md, "Compiled programs kept")
CACHE_MIN_COMPILE_SECONDS = 0.2
CACHE_MAX_BYTES = 2 << 30  # the least recently used programs go beyond this

_seconds = [0.0]  # compilation in this process since `with_compile_seconds` first listened
_listening = []


def _count(event: str, seconds: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        _seconds[0] += seconds


def with_compile_seconds(call):
    """`(call(), seconds JAX spent compiling during it)`. The first call registers a jax.monitoring listener for
    the rest of the process."""
    if not _listening:
        monitoring.register_event_duration_secs_listener(_count)
        _listening.append(_count)
    before = _seconds[0]
    result = call()
    return result, _seconds[0] - before


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxport" / "xla"


def keep_compiled_programs() -> Path | None:
    """Turn on JAX's persistent compilation cache in `default_cache_dir()`, so that running a command again (the
    same model shapes and options) loads its compiled steps instead of compiling them. The executables are the
    same, so are the results. JAX's own settings win: `JAX_COMPILATION_CACHE_DIR` picks another folder and
    `JAX_ENABLE_COMPILATION_CACHE=false` turns the cache off. Returns the folder in use (None: off)."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    folder = Path(jax.config.jax_compilation_cache_dir or default_cache_dir())
    if not jax.config.jax_compilation_cache_dir:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home: compile every run, as without the cache
            return None
        jax.config.update("jax_compilation_cache_dir", str(folder))
    # JAX's own threshold (1 s) leaves out programs such as the README run's evaluation, compiled again every run
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    return folder

