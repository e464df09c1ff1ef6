"""One training run's folder and everything it owns, for every family.

    with Run(run_dir, config=cfg, config_name="all_config.yaml", total_steps=n) as run:
        restored = run.restore(abstract_like(state))      # None on a fresh run
        for step ...:
            state, loss = train_step(state, batch)
            run.check_finite(step, loss)                  # NaN/Inf: stop, naming the last good checkpoint
            run.log(step, {"train/loss": loss})           # process 0: bar, metrics.jsonl, wandb, tensorboard
            run.save(step, state, meta={"data": loader.state_dict()})   # asynchronous, atomic, sharded

The run folder holds the config snapshot, `metrics.jsonl`, `learning_curves.png` (written at close) and
`jaxport_checkpoints/<step>` (orbax). Leaving the `with` block, by any path (an error, Ctrl-C, SIGTERM),
waits for saves in flight and stops orbax's threads, so no half-written checkpoint or stray traceback
is left behind.
"""

import contextlib
import importlib
import math
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import yaml
from etils import epath
from tqdm import tqdm

from jaxport.checkpoint.runs import RunCheckpoints
from jaxport.distributed import fetch_replicated
from jaxport.errors import JaxportError
from jaxport.training.metrics_log import MetricsLog, pyplot

CHECKPOINT_SUBDIR = "jaxport_checkpoints"


def run_checkpoints(run_dir, **kwargs) -> RunCheckpoints:
    """The orbax checkpoints of the run in `run_dir` (e.g. to load a finished run's weights)."""
    return RunCheckpoints(epath.Path(run_dir) / CHECKPOINT_SUBDIR, **kwargs)


class Run:
    """The run folder, its config snapshot, process-0 logging, checkpoints and the finite-loss check.

    `keep_last` newest checkpoints are kept (None: all) plus every `keep_every`-th step. `loggers` is any of
    jsonl, wandb, tensorboard. `shown` picks the metric suffixes the progress bar displays; without `progress`
    there is no bar and messages go to stdout."""

    def __init__(
        self,
        run_dir,
        *,
        config: dict | None = None,
        config_name: str | None = None,
        total_steps: int,
        initial_step: int = 0,
        loggers=("jsonl",),
        keep_last: int | None = 3,
        keep_every: int | None = None,
        project: str | None = None,
        name: str | None = None,
        shown=("lm_loss", "loss", "accuracy"),
        progress: bool = True,
    ):
        self.dir = epath.Path(run_dir)
        self.is_main = jax.process_index() == 0
        if keep_last is not None and keep_last < 1:
            raise JaxportError(f"keep_last={keep_last}: keep at least 1 checkpoint (or none for all)")
        if keep_every is not None and keep_every < 1:
            raise JaxportError(f"keep_every={keep_every} must be a positive number of steps")
        self.config, self.config_name = config, config_name
        self.total_steps, self.initial_step = total_steps, initial_step
        self._log_options = dict(loggers=tuple(loggers), project=project, name=name, shown=shown, progress=progress)
        self.checkpoints = run_checkpoints(self.dir, keep_last=keep_last, keep_every=keep_every, warn=self.warn)
        self.metrics: MetricsLog | None = None
        self._previous_sigterm = None
        self._import_thread = None

    # ----- lifetime

    def __enter__(self) -> "Run":
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a scheduler's stop) unwinds like Ctrl-C, so the exit path below runs.
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:  # else the error that ended the block is the one to report
                raise
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    def start_logging(self, initial_step: int | None = None) -> None:
        """Write the config snapshot and open the metrics log (after `restore` decided the first step)."""
        if self.metrics is not None:
            return
        if initial_step is not None:
            self.initial_step = initial_step
        if self.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.config is not None and self.config_name:
                (self.dir / self.config_name).write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.metrics = MetricsLog(
            self.dir,
            total_steps=self.total_steps,
            initial_step=self.initial_step,
            config=self.config,
            enabled=self.is_main,
            **self._log_options,
        )

    def close(self):
        """Finish saves in flight, close the loggers, draw the learning curves; returns the PNG path. Each is
        done even if one fails (a full disk), and the first failure is raised."""
        failures, png = [], None
        try:
            self.checkpoints.close()
        except Exception as err:
            failures.append(err)
        try:
            png = self.metrics.close() if self.metrics is not None else None
        except Exception as err:
            failures.append(err)
        if failures:
            raise failures[0]
        return png

    def import_ahead(self, *modules: str) -> None:
        """Import on a thread what the run will need later, so that its first save and its close do not wait
        for it: matplotlib (the learning curves drawn at close) and `modules` (e.g. torch for nanoGPT's ckpt.pt).
        Call it once the first step has compiled: while a step is traced the import's Python holds the GIL the
        tracer needs, while a compiled step runs without it, on cores its small products leave partly idle (the
        steps it overlaps still slow down: docs/performance.md, "Host work around the README run's steps").
        Calls after the first do nothing, so a loop may call it after every step. A module that fails to import
        fails again where it is used."""
        if not self.is_main or self._import_thread is not None:
            return

        def import_all():
            with contextlib.suppress(Exception):
                pyplot()
            for module in modules:
                with contextlib.suppress(Exception):
                    importlib.import_module(module)

        self._import_thread = threading.Thread(target=import_all, name="jaxport-import-ahead", daemon=True)
        self._import_thread.start()

    # ----- checkpoints

    def restore(self, abstract_state):
        """(state, meta) of the newest intact checkpoint, or None when the run has none yet."""
        if self.checkpoints.latest_step() is None:
            return None
        return self.checkpoints.restore(abstract_state)

    def latest_step(self) -> int | None:
        return self.checkpoints.latest_step()

    def save(self, step: int, state, meta: dict | None = None) -> None:
        """Start an asynchronous checkpoint of `state` (every process writes its own shards) with the JSON
        `meta` (data position, RNG state, ...); a step that is already saved is skipped. A state holding a
        NaN or infinity stops the run instead: no checkpoint is ever written with one."""
        if self.checkpoints.latest_step() == step:
            return
        non_finite = int(fetch_replicated(_count_non_finite(state)))
        if non_finite:
            self._stop(step, f"the state to checkpoint holds {non_finite} NaN or infinite weight or optimizer value(s)")
        self.checkpoints.save(step, state, {"step": int(step), **(meta or {})})

    # ----- logging

    def log(self, step: int, metrics: dict) -> None:
        self.start_logging()
        self.metrics.log(step, metrics)

    def write(self, message: str) -> None:
        if not self.is_main:
            return
        if self.metrics is not None:
            self.metrics.write(message)
        else:
            print(message)

    def warn(self, message: str) -> None:
        """A problem the run works around (e.g. an unreadable checkpoint): one line on stderr."""
        if self.is_main:
            tqdm.write(message, file=sys.stderr)

    def check_finite(self, step: int, value, what: str = "loss") -> None:
        """Stop the run if `value` (a host number) is NaN or infinite, naming the step and the newest
        checkpoint, which is intact (saves of later, bad steps never start)."""
        value = float(value)
        if not math.isfinite(value):
            self._stop(step, f"{what} is {value}")

    def _stop(self, step: int, problem: str):
        self.checkpoints.wait()
        last = self.checkpoints.latest_step()
        kept = (
            f"the last good checkpoint is step {last} in {self.checkpoints.directory}"
            if last is not None
            else "no checkpoint had been written yet"
        )
        raise JaxportError(f"{problem} at step {step}; training stopped; {kept}")


@jax.jit
def _count_non_finite(tree) -> jax.Array:
    floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return sum((jnp.sum(~jnp.isfinite(x)) for x in floats), jnp.int32(0))


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
