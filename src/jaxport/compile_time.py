"""Compilation: the seconds JAX spends tracing, lowering and compiling, from jax.monitoring's compile events
(the compile time a benchmark reports apart from its steady state; a first call's time less a later call's is
no measure of it: on a machine whose speed drifts by a quarter within minutes that difference even goes
negative), and the `jaxport` command's on-disk cache of compiled programs."""

import os
from pathlib import Path

import jax
from jax import monitoring

_seconds = [0.0]  # all compilation so far in this process

# programs that compile faster than this are not worth a file (eager ops take ~0.02 s)
CACHE_MIN_COMPILE_SECONDS = 0.2
CACHE_MAX_BYTES = 2 << 30  # the least recently used programs go beyond this


def _count(event: str, seconds: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        _seconds[0] += seconds


monitoring.register_event_duration_secs_listener(_count)


def with_compile_seconds(call):
    """`(call(), seconds JAX spent compiling during it)`."""
    before = _seconds[0]
    result = call()
    return result, _seconds[0] - before


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxport" / "xla"


def keep_compiled_programs() -> Path | None:
    """Turn on JAX's persistent compilation cache in `default_cache_dir()`, so that running a command again
    (the same model shapes and options) loads its compiled steps instead of compiling them: nanoGPT README's
    CPU run compiles 7-9 s of programs before its first iterations. The executables are the same, so are the
    results. JAX's own settings win: `JAX_COMPILATION_CACHE_DIR` picks another folder and
    `JAX_ENABLE_COMPILATION_CACHE=false` turns the cache off. Returns the folder in use (None: off)."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    folder = default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: compile every run, as without the cache
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    return folder
