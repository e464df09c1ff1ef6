"""Fixtures shared by test modules, and the session's compilation cache."""

import os
import shutil
import tempfile

import pytest

XLA_CACHE = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
    """Most tests start `jaxport` processes that compile the same small programs again (the tiny TRM, GPT
    and Dream configurations); one persistent XLA cache for the session, inherited by every subprocess
    and xdist worker, compiles each program once (a tiny TRM run: 33 -> 11 CPU seconds). The executables
    are the same, so are the results. A folder of the session's own, removed at its end: every session
    compiles from cold."""
    if XLA_CACHE not in os.environ:
        config.jaxport_xla_cache = tempfile.mkdtemp(prefix="jaxport-tests-xla-cache-")
        os.environ.update(
            {
                XLA_CACHE: config.jaxport_xla_cache,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # most of these programs compile in < 1 s
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            }
        )


def pytest_sessionstart(session):
    """The test processes themselves compile without the persistent cache (the `jaxport` subprocesses keep it):
    XLA:CPU's executable serialization for the cache write has aborted a test worker (a fatal error inside
    `compilation_cache.put_executable_and_time`, seen once in a Fast-dLLM fixture test under load), and an abort
    there takes every test of its module down with it."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


def free_compiled_programs():
    """Frees the compiled programs nothing references any more. An XLA:CPU executable keeps a memory mapping per
    section of each kernel it loaded (Dream's prefix cache at 256 new tokens: ~8,000 for one call, a program per
    block), and a test worker that kept the programs of every module it ran reached the kernel's limit on mappings
    (`vm.max_map_count`, 65530): LLVM's loader then aborted the next compilation."""
    import gc

    import jax

    from jaxport.runtime import policy

    gc.collect()
    policy.jit_once.cache_clear()
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def free_each_modules_programs():
    yield
    free_compiled_programs()


def pytest_unconfigure(config):
    if getattr(config, "jaxport_xla_cache", None):
        shutil.rmtree(config.jaxport_xla_cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def each_test_starts_with_automatic_runtime_settings(monkeypatch):
    """A test that runs `jaxport.cli.main` in the test process sets the process's runtime settings (`runtime.start`);
    the tests after it start from every setting auto again."""
    from jaxport.runtime import settings

    monkeypatch.setattr(settings, "_process", dict(settings._process))


@pytest.fixture
def keep_malloc_defaults(monkeypatch):
    """The jaxport command tunes glibc's malloc for its process; tests that call `jaxport.cli.main` in the test
    process use this to leave the test process alone."""
    from jaxport.runtime import host_memory

    monkeypatch.setattr(host_memory, "tune_process", lambda training: None)
