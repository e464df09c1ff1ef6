"""Compilation: the seconds JAX spends tracing, lowering and compiling (from jax.monitoring's compile events: the
time of a first call less a later call's is no measure of it where the machine's speed drifts), and the `jaxport`
command's on-disk cache of compiled programs. The XLA options programs compile with are `jaxport.runtime`'s."""

import functools
import os
import warnings
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


# -- deprecated: the XLA options moved to jaxport.runtime -----------------------------------------------------------


def __getattr__(name: str):
    from jaxport.runtime import policy

    if name in ("LARGE_MATMUL_ROWS", "YNN_FUSION_TYPES", "INDIVIDUAL_DOTS", "PLAIN_REDUCTIONS"):
        return getattr(policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compiler_options(rows: int, dtype, platform: str, *, plain_reductions: bool = True) -> dict | None:
    """Deprecated: `jaxport.runtime.for_devices(devices).for_program(dtype, rows).compiler_options`."""
    from jaxport.runtime import policy

    warnings.warn("compile_time.compiler_options moved to jaxport.runtime", DeprecationWarning, stacklevel=2)
    return dict(policy._xla_options(platform, dtype, rows, not plain_reductions)) or None


def jit_with_options(function, options: dict | None, **jit_kwargs):
    """Deprecated: `jaxport.runtime.jit(function, runtime, **jit_kwargs)`."""
    warnings.warn("compile_time.jit_with_options moved to jaxport.runtime.jit", DeprecationWarning, stacklevel=2)
    frozen = tuple(sorted(options.items())) if options else None
    return _jit_with_options(function, frozen, tuple(sorted(jit_kwargs.items())))


@functools.cache
def _jit_with_options(function, options, jit_kwargs):
    return jax.jit(function, compiler_options=dict(options) if options else None, **dict(jit_kwargs))
