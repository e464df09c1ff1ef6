"""A run's own checkpoints, with orbax: the train-state pytree plus JSON metadata (step, data
position, ...). Orbax writes each checkpoint to a temporary folder and renames it when complete,
so a run killed at any moment leaves the previous checkpoint intact and loadable."""

from pathlib import Path

import orbax.checkpoint as ocp

from jaxport.errors import JaxportError


class RunCheckpoints:
    def __init__(self, directory: str | Path, max_to_keep: int | None = 3):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def restore(self, abstract_state, step: int | None = None):
        """(state, meta) of `step` (default: the latest complete checkpoint). `abstract_state`
        gives structure, shapes, dtypes and shardings (e.g. from `jax.eval_shape`)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise JaxportError(f"no complete checkpoint in {self.directory}")
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as err:
            raise JaxportError(f"checkpoint {self.directory / str(step)} does not fit this model/config: "
                               f"{str(err).splitlines()[0][:300]}") from None
        return restored["state"], restored["meta"]

    def restore_partial(self, abstract_subtree, step: int | None = None):
        """Only the leaves named in `abstract_subtree` (e.g. a run's weights, to fine-tune from them)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise JaxportError(f"no complete checkpoint in {self.directory}")
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(abstract_subtree, partial_restore=True)))
        return restored["state"]

    def close(self) -> None:
        self.manager.close()
