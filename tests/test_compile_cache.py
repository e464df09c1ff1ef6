"""The `jaxport` command keeps its compiled programs on disk: a second run of the same command loads them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "gpt"
TINY_RUN = [
    "gpt",
    "train",
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--block_size=16",
    "--batch_size=4",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=32",
    "--max_iters=3",
    "--eval_interval=3",
    "--eval_iters=1",
    "--log_interval=1",
    "--progress=False",
]


def _jaxport(argv, cwd, cache_home, **env):
    """A `jaxport` process whose only cache settings are `env` (the suite's own cache folder is left out)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    done = subprocess.run(
        [sys.executable, "-m", "jaxport.cli", *argv],
        cwd=cwd,
        env={**clean, "XDG_CACHE_HOME": str(cache_home), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _programs(folder: Path) -> dict[str, int]:
    """Cached program -> when it was last read or written (JAX's LRU stamp)."""
    return {p.name[: -len("-atime")]: p.stat().st_mtime_ns for p in folder.glob("*-atime")}


def test_a_second_run_loads_the_first_runs_programs_and_trains_the_same(tmp_path):
    """Every program is kept (no compile-time threshold): which programs compile in under 0.2 s depends on the
    machine's load, so with the default threshold the two runs could keep different sets."""
    cwd, cache_home = tmp_path / "run", tmp_path / "cache"
    cwd.mkdir()
    keep_all = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    text = str(FIXTURES / "tinyshakespeare" / "input.txt")
    _jaxport(["gpt", "prepare", "shakespeare_char", "--input", text], cwd, cache_home, **keep_all)
    first = _jaxport([*TINY_RUN, "--out_dir=first"], cwd, cache_home, **keep_all)
    folder = cache_home / "jaxport" / "xla"
    stored = _programs(folder)
    assert any(name.startswith("jit_step-") for name in stored), sorted(stored)

    second = _jaxport([*TINY_RUN, "--out_dir=second"], cwd, cache_home, **keep_all)
    again = _programs(folder)
    assert again.keys() == stored.keys()  # nothing compiled anew
    assert all(again[name] > stored[name] for name in stored), "a program was not read back"
    losses = lambda out: re.findall(r"loss (\d+\.\d+)", out)  # noqa: E731
    assert losses(first) and losses(second) == losses(first)


def test_jax_s_own_setting_turns_the_cache_off(tmp_path):
    cwd, cache_home = tmp_path / "run", tmp_path / "cache"
    cwd.mkdir()
    text = str(FIXTURES / "tinyshakespeare" / "input.txt")
    off = {"JAX_ENABLE_COMPILATION_CACHE": "false"}
    _jaxport(["gpt", "prepare", "shakespeare_char", "--input", text], cwd, cache_home, **off)
    _jaxport(TINY_RUN, cwd, cache_home, **off)
    assert not (cache_home / "jaxport").exists()


def test_a_cache_folder_named_by_jax_s_setting_keeps_the_smaller_programs_too(tmp_path):
    """`JAX_COMPILATION_CACHE_DIR` picks the folder; the programs kept are still those compiling in 0.2 s or more
    (JAX's own 1 s threshold left out e.g. the README run's evaluation, which then compiled again every run)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    probe = (
        "import jax; from jaxport.runtime.compile_cache import keep_compiled_programs, CACHE_MIN_COMPILE_SECONDS as m; "
        "folder = keep_compiled_programs(); "
        "print(folder, jax.config.jax_persistent_cache_min_compile_time_secs == m, "
        "jax.config.jax_compilation_cache_dir)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**clean, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine"), "XDG_CACHE_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "mine"), "True", str(tmp_path / "mine")]
    assert not (tmp_path / "home").exists()
