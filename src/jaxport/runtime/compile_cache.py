"""The `jaxport` command's on-disk cache of compiled programs (JAX's persistent compilation cache): running a
command again with the same model shapes and options loads its compiled steps instead of compiling them."""

import os
from pathlib import Path

import jax

# programs that compile faster than this are not worth a file (docs/performance.md, "Compiled programs kept")
CACHE_MIN_COMPILE_SECONDS = 0.2
CACHE_MAX_BYTES = 2 << 30  # the least recently used programs go beyond this


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
