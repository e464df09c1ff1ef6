"""A run's own checkpoints, with orbax: the train-state pytree (sharded: every process writes only
its own shards) plus JSON metadata (step, data position, RNG, ...).

Saves are asynchronous: `save` returns once the arrays are copied off the devices, and orbax
writes them in the background to a temporary folder that it renames when complete, so a run
killed at any moment leaves the previous checkpoints intact. On restore, a step that cannot be
read (truncated or missing array files, damaged metadata) is reported in one line and the next
older step is used; a step that is readable but does not fit the model is an error of its own.
"""

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxport.errors import JaxportError, write_error


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


def _shape_mismatch(saved, abstract, partial: bool = False) -> str | None:
    """The first leaf whose path, shape or dtype differs between a checkpoint's tree metadata and the
    abstract state, described for the user; None when they agree."""
    saved_leaves = dict(jax.tree_util.tree_flatten_with_path(saved, is_leaf=lambda x: hasattr(x, "shape"))[0])
    abstract_leaves = dict(jax.tree_util.tree_flatten_with_path(abstract)[0])
    name = lambda path: jax.tree_util.keystr(path, simple=True, separator=".")  # noqa: E731
    saved_by_name = {name(p): v for p, v in saved_leaves.items()}
    for path, want in abstract_leaves.items():
        key = name(path)
        have = saved_by_name.get(key)
        if have is None:
            return f"it has no {key} (the model expects shape {list(want.shape)})"
        if tuple(have.shape) != tuple(want.shape):
            return f"{key} has shape {list(have.shape)}, the model expects {list(want.shape)}"
    extra = sorted(set(saved_by_name) - {name(p) for p in abstract_leaves})
    if extra and not partial:
        return f"it holds {extra[0]}, which this model does not have"
    return None


def _from_orbax(exc: BaseException | None) -> bool:
    """`exc` was raised in orbax's code: its traceback passes through one of orbax's files."""
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _quiet_orbax_leftovers() -> None:
    """Work orbax leaves in flight after a failure it raised, which would print tracebacks after jaxport has reported
    the failure in one line. A failed save (a full disk) leaves writes that fail too: a completion callback that finds
    orbax's event loop closed (an unraisable exception), a task or future whose exception nobody retrieves (logged by
    asyncio when it is collected) and a coroutine never awaited (a RuntimeWarning at exit). A failed read (a truncated
    array file) leaves the other reads in flight: their gathered futures' exceptions, and their coroutines, closed once
    orbax's event loop is gone, which turn the closing into orbax's "Encountered error while reading array index"
    (an unraisable exception). Only orbax's own leftovers are silenced."""
    previous = sys.unraisablehook
    if getattr(previous, "ignores_orbax_leftovers", False):
        return

    def hook(unraisable):
        exc, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
        loop_closed = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
        orbax_coroutine = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
        if not (loop_closed or orbax_coroutine or _from_orbax(exc)):
            previous(unraisable)

    hook.ignores_orbax_leftovers = True
    sys.unraisablehook = hook

    def keep(record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in record.getMessage():
            return True
        return not ("orbax" in record.getMessage() or (record.exc_info and _from_orbax(record.exc_info[1])))

    logging.getLogger("asyncio").addFilter(keep)
    warnings.filterwarnings("ignore", message="coroutine 'async_serialize", category=RuntimeWarning)


class RunCheckpoints:
    """Orbax checkpoints of one run in `directory` (a local path or any `etils.epath` path, e.g. gs://).

    Retention: the newest `keep_last` steps are kept (None: all), and with `keep_every=K` also every
    step divisible by K. `warn` receives one-line reports of unreadable steps."""

    def __init__(
        self,
        directory,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        warn: Callable[[str], None] | None = None,
    ):
        self.directory = epath.Path(directory)
        if not str(self.directory).startswith(("gs://", "s3://")):
            self.directory = self.directory.absolute()
        self.warn = warn or (lambda message: print(message, file=sys.stderr))
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep_last, keep_period=keep_every, create=True, enable_async_checkpointing=True
            ),
        )
        self._step_in_flight = None
        _quiet_orbax_leftovers()  # installed now: orbax's threads may fail before `save` or `wait` sees it

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` and `meta` as `step`; returns once the arrays are off the devices. A save that
        fails (a full disk) is an error here or at the next `save`/`wait`, naming the step."""
        self.wait()  # orbax would wait for the previous save anyway; its failure is that step's
        self._step_in_flight = step
        with self._saving():
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
                force=True,
            )

    def wait(self) -> None:
        """Block until every save in flight is complete on disk."""
        with self._saving():
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _saving(self):
        """Turn a failed save (orbax raises tensorstore's errors, from its background threads) into one line."""
        try:
            yield
        except Exception as err:
            step, intact = self._step_in_flight, self.all_steps()
            kept = (
                f"the checkpoints already in {self.directory} are intact (newest: step {intact[-1]})"
                if intact
                else f"{self.directory} holds no complete checkpoint"
            )
            raise JaxportError(
                f"saving checkpoint step {step} failed: {write_error(err, self.directory / str(step))}; {kept}"
            ) from None

    def _restore_step(self, step: int, abstract_state, partial: bool):
        """One step's `(state, meta)`, or None (after a one-line report) when the step cannot be read.
        `abstract_state` may be a function of the step's meta (e.g. the model config saved in it)."""
        where = f"checkpoint step {step} in {self.directory}"
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            saved = self.manager.item_metadata(step)["state"]
            if saved is None or meta is None:
                raise FileNotFoundError("state/_METADATA" if saved is None else "meta/metadata")
        except Exception as err:  # orbax raises many types for missing or damaged metadata
            self.warn(f"{where} cannot be read (its metadata is missing or damaged: {_first_line(err)})")
            return None
        if callable(abstract_state):
            abstract_state = abstract_state(meta)
        state_args = ocp.args.PyTreeRestore(
            abstract_state,
            partial_restore=partial,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
        )
        mismatch = _shape_mismatch(saved, abstract_state, partial) if saved is not None else None
        if mismatch:
            raise JaxportError(f"{where} does not fit this model/config: {mismatch}")
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(state=state_args))["state"]
        except Exception as err:  # truncated/missing array files surface from tensorstore as many types
            self.warn(f"{where} cannot be read ({_describe_read_error(err)})")
            return None
        return state, meta

    def restore(self, abstract_state, step: int | None = None, partial: bool = False):
        """(state, meta) of `step`, by default of the newest intact step. `abstract_state` gives structure,
        shapes, dtypes and shardings (e.g. `abstract_like(state)`), or is a function of the checkpoint's
        meta that returns them (when the model's size is recorded in the meta). With `partial`, only the
        leaves `abstract_state` names are read (e.g. a run's weights, to fine-tune or sample from them)."""
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps:
            raise JaxportError(f"no complete checkpoint in {self.directory}")
        for i, candidate in enumerate(steps):
            restored = self._restore_step(candidate, abstract_state, partial)
            if restored is not None:
                if i:
                    self.warn(f"using step {candidate} instead, the newest intact checkpoint in {self.directory}")
                return restored
        raise JaxportError(
            f"no intact checkpoint left in {self.directory}: steps {steps} all failed to read "
            f"(see the lines above); delete the folder to start afresh"
        )

    def __enter__(self) -> "RunCheckpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Finish the saves in flight and stop orbax's background threads (also after a failed save)."""
        try:
            self.wait()
        finally:
            self.manager.close()


def _describe_read_error(err: BaseException) -> str:
    """tensorstore's messages are long and nested: name the array and what is wrong with its file."""
    while err.__cause__ is not None or err.__context__ is not None:  # the innermost error names the cause
        err = err.__cause__ or err.__context__
    text = _first_line(err)
    array = re.search(r'reading "([^"/]+)', text)
    where = f" (array {array.group(1)})" if array else ""
    for code, meaning in (
        ("OUT_OF_RANGE", "is truncated"),
        ("NOT_FOUND", "is missing"),
        ("DATA_LOSS", "is damaged"),
        ("FAILED_PRECONDITION", "is damaged"),
    ):
        if code in text:
            detail = text.rsplit(": ", 1)[-1]
            return f"an array file {meaning}{where}: {detail}"
    return text


def abstract_like(tree):
    """ShapeDtypeStructs with the shardings of `tree`'s arrays: what `restore` needs."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)), tree
    )
