"""Compilation: the seconds JAX spends tracing, lowering and compiling, from jax.monitoring's compile events
(the compile time a benchmark reports apart from its steady state; a first call's time less a later call's is
no measure of it: on a machine whose speed drifts by a quarter within minutes that difference even goes
negative), the XLA options the models' programs compile with, and the `jaxport` command's on-disk cache of
compiled programs."""

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
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


# Rows from which XLA:CPU's other dot path beats its YNNPACK dot fusions on float32 products (jaxlib 0.10.2, on
# this project's 2-core CPU with a 32 MB L3): [M, 384] x [384, 1536] runs at 205 GFLOP/s through YNNPACK with
# M = 2048 and at 132-138 with M >= 4096, against 157-209 for the other path, which loses below 2048 rows
# (183 against 198 at M = 768); Dream's 40M decoding runs 2x slower and the TRM steps no faster without YNNPACK,
# and bfloat16 dots need it (TRM's bfloat16 step: 7.5 s with, 10.4 s without).
LARGE_MATMUL_ROWS = 8192
YNN_FUSION_TYPES = "xla_cpu_experimental_ynn_fusion_type"
INDIVIDUAL_DOTS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
# XLA:CPU rewrites every reduction of more than 32 values into a windowed one (windows of 32, then across the
# windows) whose emitter runs 3-7x slower than the plain reduction: a sum of exp over [256, 32000] 18.9 against
# 2.6 ms, a softmax 15.2 against 5.3 ms (2026-11-26, jaxlib 0.10.2, 2-core AMX host).
PLAIN_REDUCTIONS = {"xla_disable_hlo_passes": "tree_reduction_rewriter"}


def compiler_options(rows: int, dtype, platform: str, *, plain_reductions: bool = True) -> dict | None:
    """`jax.jit(..., compiler_options=)` for a model's program whose matrix products have `rows` rows per device;
    XLA's defaults off the CPU. On a CPU:
    - large float32 products (GPT's train_shakespeare_char step, 64 x 256 rows) skip YNNPACK altogether: -11% to
      -30% time;
    - smaller ones compile as YNNPACK fusions of one dot each: XLA:CPU's default also folds a reduction that reads
      a dot's result into the dot's fusion, which runs that product 1.4-1.5x slower ([256, 512] x [512, 32000]
      then a sum: 101 against 70 ms), and Dream's vocabulary projection feeds the sampler's softmax that way
      (exact decoding, 40M, 64 tokens at batch 4: 14.3 -> 9.9 s);
    - below LARGE_MATMUL_ROWS rows, reductions stay plain (`PLAIN_REDUCTIONS`: LayerNorm, RMSNorm and softmax rows,
      the loss, Dream's sampler over the vocabulary; nanoGPT README's CPU step 48 -> 44 ms, 884 -> 593 fusions).
      Above, the windowed form wins: the train_shakespeare_char step took 8.55 s with it against 8.96 s without
      (2026-11-26, alternating calls of both programs in one process on the 2-core AMX host).
      `plain_reductions=False` keeps the windowed form for a program whose norms reduce a leading axis (TRM's
      sequence-major mlp_t), which the plain emitter runs slowly (docs/performance.md, "Sequence-major mlp_t")."""
    if platform != "cpu":
        return None
    if rows >= LARGE_MATMUL_ROWS:
        return {YNN_FUSION_TYPES: ""} if jnp.dtype(dtype) == jnp.float32 else {YNN_FUSION_TYPES: INDIVIDUAL_DOTS}
    return {YNN_FUSION_TYPES: INDIVIDUAL_DOTS, **(PLAIN_REDUCTIONS if plain_reductions else {})}


def jit_with_options(function, options: dict | None, **jit_kwargs):
    """`jax.jit(function, compiler_options=options, **jit_kwargs)`, made once per distinct options, for a program
    whose options depend on what it runs on (see `compiler_options`)."""
    frozen = tuple(sorted(options.items())) if options else None
    return _jit_with_options(function, frozen, tuple(sorted(jit_kwargs.items())))


@functools.cache
def _jit_with_options(function, options, jit_kwargs):
    return jax.jit(function, compiler_options=dict(options) if options else None, **dict(jit_kwargs))
