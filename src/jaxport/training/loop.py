"""The training loop every family runs: steps, deferred metrics, the NaN stop and hooks at intervals.

A family brings its state, its compiled step `step(state, batch, hyper) -> (state, metrics)`, its batches
numbered by step and its hooks (evaluation, checkpoints, samples, log lines):

    with Run(run_dir, ...) as run:
        restored = run.restore(abstract_like(state))              # resume: None on a fresh run
        state = fit(run, step, state, batches, hyper=lambda n: Hyper(lr=lr(n)), read=read,
                    after=[every(save_every, save)])

`hyper(n)` holds what the host computes for step n (a learning rate in float64 as upstream computes it, passed
as a float32 scalar; a random key). `metrics` stay on the devices: `Run.record` reads them several steps late in
one transfer, checks their "loss" (a non-finite one stops the run naming the last good checkpoint) and logs what
`read(n, host_metrics)` returns. Hooks are `hook(n, state)`: `before` ones run before step n is started (nanoGPT
evaluates and saves at the top of an iteration), `after` ones once it is started.
"""

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterable

from jaxport.training.metrics_log import pyplot
from jaxport.training.run import Run


def fit(
    run: Run,
    step: Callable,
    state,
    batches: Iterable,
    *,
    hyper: Callable | None = None,
    read: Callable | None = None,
    before: Iterable[Callable] = (),
    after: Iterable[Callable] = (),
    draw_ahead: bool = False,
):
    """Run `step` on each `(n, batch)` of `batches`; returns the last state (its metrics not read yet: `run.flush`).

    With `draw_ahead` the next batch is drawn while step n runs, before the `after` hooks: for batches keyed by the
    step number, whose position no checkpoint holds (a hook that saves a loader's position needs it unmoved)."""
    checked = _checked_read(run, read)
    batches = iter(batches)
    upcoming = next(batches, None)
    while upcoming is not None:
        n, batch = upcoming
        for hook in before:
            hook(n, state)
        state, metrics = step(state, batch, hyper(n) if hyper is not None else None)
        run.record(n, metrics, checked)
        if draw_ahead:
            upcoming = next(batches, None)
        for hook in after:
            hook(n, state)
        if not draw_ahead:
            upcoming = next(batches, None)
    return state


def _checked_read(run: Run, read: Callable | None) -> Callable:
    def checked(n: int, metrics: dict):
        run.check_finite(n, metrics["loss"])  # every micro-step's, where the step reports them all
        return read(n, metrics) if read is not None else None

    return checked


def every(interval: int | None, hook: Callable, last: int | None = None) -> Callable:
    """`hook(n, state)` at steps that are multiples of `interval` (None or 0: never), and at step `last`."""

    def at_interval(n: int, state) -> None:
        if (interval and n % interval == 0) or n == last:
            hook(n, state)

    return at_interval


class ImportAhead:
    """Imports on a thread what the run needs later, so that its first save and its close do not wait for it:
    matplotlib (the learning curves drawn at close) and the modules named (torch, for nanoGPT's ckpt.pt).

    Called once the first step has compiled: while a step is traced the import's Python holds the GIL the tracer
    needs, while a compiled step runs without it (docs/performance.md, "Host work around the README run's steps").
    Calls after the first do nothing, so a loop calls it after every step. A module that fails to import fails
    again where it is used. Only the process that writes files imports (`enabled`)."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.thread = enabled, None

    def __call__(self, *modules: str) -> None:
        if not self.enabled or self.thread is not None:
            return

        def import_all():
            with contextlib.suppress(Exception):
                pyplot()
            for module in modules:
                with contextlib.suppress(Exception):
                    importlib.import_module(module)

        self.thread = threading.Thread(target=import_all, name="jaxport-import-ahead", daemon=True)
        self.thread.start()
