"""One training run's folder and everything it owns, for every family.

    def read(step, out):                                  # host values of one step, one step late
        run.check_finite(step, out["loss"])               # NaN/Inf: stop, naming the last good checkpoint
        return {"train/loss": out["loss"]}                # process 0: bar, metrics.jsonl, wandb, tensorboard

    with Run(run_dir, config=cfg, config_name="all_config.yaml", total_steps=n) as run:
        restored = run.restore(abstract_like(state))      # None on a fresh run
        for step ...:
            state, outputs = train_step(state, batch)     # device arrays: the host does not wait for them
            run.record(step, outputs, read)
            run.save(step, state, meta={"data": loader.state_dict()})   # asynchronous, atomic, sharded

The run folder holds the config snapshot, `metrics.jsonl`, `learning_curves.png` (written at close) and
`jaxport_checkpoints/<step>` (orbax). A step's outputs are read from the devices once the next step is
under way (`record`), so the host never waits for the step it has just started; every recorded step is
read, checked and logged in order before a checkpoint is written, a metric is logged directly, or the
run closes. Leaving the `with` block, by any path (an error, Ctrl-C, SIGTERM), waits for saves in flight
and stops orbax's threads, so no half-written checkpoint or stray traceback is left behind.
"""

import math
import signal
import sys
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from etils import epath
from tqdm import tqdm

from jaxport.checkpoint.runs import RunCheckpoints
from jaxport.distributed import fetch_replicated
from jaxport.errors import JaxportError
from jaxport.training.metrics_log import MetricsLog

CHECKPOINT_SUBDIR = "jaxport_checkpoints"


def run_checkpoints(run_dir, **kwargs) -> RunCheckpoints:
    """The orbax checkpoints of the run in `run_dir` (e.g. to load a finished run's weights)."""
    return RunCheckpoints(epath.Path(run_dir) / CHECKPOINT_SUBDIR, **kwargs)


def restore_params(run_dir, params, step: int | None = None):
    """(params, meta) of a run's checkpoint (the newest intact one, or `step`) on the first device, whatever mesh
    the run trained on: the weights alone, to sample, evaluate or export them. `params` gives their structure,
    shapes and dtypes (arrays or `jax.ShapeDtypeStruct`s), or is a function of the checkpoint's meta that returns
    them. None when the run folder holds no checkpoint."""
    if not (epath.Path(run_dir) / CHECKPOINT_SUBDIR).is_dir():
        return None
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def wanted(meta):
        tree = params(meta) if callable(params) else params
        return {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)}

    with run_checkpoints(run_dir, keep_last=None) as checkpoints:
        if checkpoints.latest_step() is None:
            return None
        state, meta = checkpoints.restore(wanted, step=step, partial=True)
    return state["params"], meta


class Run:
    """The run folder, its config snapshot, process-0 logging, checkpoints and the finite-loss check.

    `keep_last` newest checkpoints are kept (None: all) plus every `keep_every`-th step. `loggers` is any of
    jsonl, wandb, tensorboard. `shown` names the training metrics the progress bar displays (`lm_loss` shows
    `train/lm_loss`); without `progress` there is no bar and messages go to stdout. Recorded steps are read
    `read_every` at a time (`record`)."""

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
        shown=(),
        progress: bool = True,
        read_every: int = 1,
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
        self.read_every = read_every
        self._recorded: list[tuple[int, object, Callable]] = []  # (step, device outputs, read) not read yet
        self._previous_sigterm = None
        self._closed, self._png = False, None

    # ----- lifetime

    def __enter__(self) -> "Run":
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a scheduler's stop) unwinds like Ctrl-C, so the exit path below runs.
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            try:
                if exc_type is None:
                    self.flush()  # a step that went non-finite still stops the run, before its end is reported
            finally:
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
        done even if one fails (a full disk), and the first failure is raised. Closing again does nothing."""
        if self._closed:
            return self._png
        self._closed = True
        failures = []
        try:
            self.checkpoints.close()
        except Exception as err:
            failures.append(err)
        try:
            self._png = self.metrics.close() if self.metrics is not None else None
        except Exception as err:
            failures.append(err)
        if failures:
            raise failures[0]
        return self._png

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
        self.flush()
        if self.checkpoints.latest_step() == step:
            return
        non_finite = int(fetch_replicated(_count_non_finite(state)))
        if non_finite:
            self._stop(step, f"the state to checkpoint holds {non_finite} NaN or infinite weight or optimizer value(s)")
        self.checkpoints.save(step, state, {"step": int(step), **(meta or {})})

    # ----- logging

    def record(self, step: int, outputs, read: Callable[[int, object], dict | None]) -> None:
        """Queue a step's `outputs` (device arrays, or trees of them) without waiting for them. Once `read_every`
        later steps are queued they are read from the devices in one transfer (`fetch_replicated`), oldest first:
        `read(step, host_outputs)` checks them (`check_finite`) and returns the metrics to log, or None."""
        self._recorded.append((step, outputs, read))
        if len(self._recorded) > self.read_every:
            self._read(self._recorded[:-1])
            del self._recorded[:-1]

    def flush(self) -> None:
        """Read every recorded step now (before an evaluation, a save, or the end of training)."""
        recorded, self._recorded = self._recorded, []
        self._read(recorded)

    def _read(self, recorded: list) -> None:
        if not recorded:
            return
        values = fetch_replicated([outputs for _, outputs, _ in recorded])
        for (step, _, read), host in zip(recorded, values):
            metrics = read(step, host)
            if metrics is not None:
                self.start_logging()
                self.metrics.log(step, metrics)

    def log(self, step: int, metrics: dict) -> None:
        self.flush()  # the steps recorded before come first
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
        """Stop the run if `value` (a host number, or numbers) is NaN or infinite, naming the step and the newest
        checkpoint, which is intact (saves of later, bad steps never start)."""
        for number in np.ravel(value):
            if not math.isfinite(number):
                self._stop(step, f"{what} is {float(number)}")

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
