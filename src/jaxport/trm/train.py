"""`jaxport trm train`: upstream `pretrain.py` in JAX.

One jitted, mesh-sharded step does the ACT call, the backward pass of `loss / global_batch_size`,
Adam-atan2 on the weights, sign-SGD on the puzzle-embedding rows of the batch and the EMA update.
The ACT carry lives in the train state, so it persists across batches (and checkpoints) as upstream.
The loop is `jaxport.training.loop.fit`: the host never waits for a step (the step number and learning
rates are computed on the host), and the metrics of several steps are read in one transfer, which also
stops the run at the first non-finite loss before any later checkpoint is written.
"""

import dataclasses
import json
import math
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxport import runtime
from jaxport.checkpoint.runs import abstract_like
from jaxport.checkpoint.torch_io import save_torch_file
from jaxport.distributed import (
    local_rows,
    logical_sharding,
    make_mesh,
    replicate,
    shard_batch,
    shard_leading,
)
from jaxport.errors import JaxportError
from jaxport.training import adam_atan2, compute_lr, ema_copy, ema_init, ema_update, sparse_sign_sgd_update
from jaxport.training.loop import every, fit
from jaxport.training.run import Run
from jaxport.training.step import apply_gradients
from jaxport.trm import params as trm_params
from jaxport.trm.config import RunConfig, TRMConfig
from jaxport.trm.data import PuzzleDataset, PuzzleDatasetMetadata
from jaxport.trm.evaluate import evaluate, make_evaluators, reduce_train_metrics
from jaxport.trm.model import TRM, Buffer, Carry, loss_and_grad

READ_EVERY = 32  # steps whose metrics are read from the devices in one transfer


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State  # trained by Adam-atan2
    buffers: nnx.State  # H_init, L_init, the puzzle-embedding table (sign-SGD)
    opt_state: optax.OptState
    ema: nnx.State | None
    carry: Carry


class Rates(NamedTuple):
    """A step's learning rates, computed on the host in float64 as upstream's `compute_lr` (float32 scalars)."""

    lr: np.float32
    puzzle_lr: np.float32


class Trainer:
    def __init__(self, config: RunConfig, mesh=None):
        self.config = config
        self.mesh = mesh if mesh is not None else make_mesh(data=-1)
        self.rank, self.world = jax.process_index(), jax.process_count()
        if not config.data_paths:
            raise JaxportError("data_paths is empty: give the dataset folder(s), e.g. data_paths=[data/sudoku]")
        for path in config.data_paths:
            if not Path(path).exists():
                raise JaxportError(f"data path not found: {path} (build it with `jaxport trm build ...`)")
        if config.global_batch_size % self.mesh.devices.size:
            raise JaxportError(
                f"global_batch_size={config.global_batch_size} is not divisible by the "
                f"{self.mesh.devices.size} devices; use a multiple of {self.mesh.devices.size}"
            )
        epochs_per_iter = config.eval_interval or config.epochs
        self.total_iters = config.epochs // epochs_per_iter
        self.gbs = config.global_batch_size
        self.train_loader = PuzzleDataset(
            config.data_paths,
            "train",
            global_batch_size=self.gbs,
            test_set_mode=False,
            epochs_per_iter=epochs_per_iter,
            seed=config.seed,
            rank=self.rank,
            num_replicas=self.world,
        )
        meta = self.train_loader.metadata
        eval_paths = config.data_paths_test or config.data_paths
        self.eval_loader = None
        if all((Path(p) / "test" / "dataset.json").exists() for p in eval_paths):
            self.eval_loader = PuzzleDataset(
                eval_paths,
                "test",
                global_batch_size=self.gbs,
                test_set_mode=True,
                seed=config.seed,
                rank=self.rank,
                num_replicas=self.world,
            )
        # the arrays are read now: a truncated or mismatched one stops the run before its folder is touched
        for loader in filter(None, (self.train_loader, self.eval_loader)):
            loader.load()
        self.total_steps = int(config.epochs * meta.total_groups * meta.mean_puzzle_examples / self.gbs)
        self.model_config = model_config(config, meta)
        self.run_dir = Path(config.checkpoint_path)
        self.model = TRM(self.model_config, rngs=nnx.Rngs(config.seed))
        if config.load_checkpoint:
            trm_params.load_weights(self.model, Path(config.load_checkpoint))
        self.model.train()
        self.graphdef, params, buffers, self.rest = nnx.split(self.model, nnx.Param, Buffer, ...)
        self.use_puzzle_emb = self.model_config.puzzle_emb_ndim > 0
        self.tx = optimizer(config)
        self.evaluators = make_evaluators(config, self.train_loader.metadata.blank_identifier_id)
        self._train_step = runtime.jit_training_step(
            self._step, self.model.runtime_for((self.gbs, self.model_config.seq_len), self.mesh), donate_argnums=0
        )
        self.state = self._init_state(params, buffers)
        self.step = 0  # = state.step, kept on the host so that no step waits for the one before
        self.iteration = 0
        self.run = Run(
            self.run_dir,
            config=config.model_dump(),
            config_name="all_config.yaml",
            total_steps=self.total_steps,
            loggers=config.loggers,
            keep_last=config.keep_last,
            keep_every=config.keep_every,
            project=config.project_name,
            name=config.run_name,
            shown=("lm_loss", "accuracy", "exact_accuracy"),
            read_every=READ_EVERY,
        )

    # ----- set-up

    def _fresh_state(self, params, buffers) -> TrainState:
        """Step 0's state, on no particular device: fresh optimizer moments and EMA, every carry row halted."""
        global_shape = {"inputs": (self.gbs, self.model_config.seq_len), "puzzle_identifiers": (self.gbs,)}
        global_shape["labels"] = global_shape["inputs"]
        carry = self.model.initial_carry({k: np.zeros(s, np.int32) for k, s in global_shape.items()})
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            buffers=buffers,
            opt_state=self.tx.init(params),
            ema=ema_init(params) if self.config.ema else None,
            carry=carry,
        )

    def _init_state(self, params, buffers) -> TrainState:
        state = self._fresh_state(params, buffers)
        placed = replicate(dataclasses.replace(state, carry=None), self.mesh)
        return dataclasses.replace(placed, carry=shard_leading(state.carry, self.mesh))

    # ----- the step

    def _step(self, state: TrainState, batch: dict, hyper: Rates):
        model = nnx.merge(self.graphdef, state.params, state.buffers, self.rest)
        # the halting exploration's key for upstream's step number (counted before the update), made here: made on
        # the host, each key waited for the step before it, and no step overlapped the host's work for the next
        halt_key = jax.random.fold_in(jax.random.key(self.config.seed), state.step + 1)
        (carry, loss, metrics, _), (param_grads, row_grads) = loss_and_grad(
            model, state.carry, batch, self.gbs, halt_key
        )
        params, opt_state, buffers = state.params, state.opt_state, state.buffers
        if not self.config.freeze_weights:  # upstream clips nothing: the clip is off
            params, opt_state, _, _ = apply_gradients(
                self.tx, param_grads, opt_state, params, lr=hyper.lr, grad_clip=0.0
            )
        if self.use_puzzle_emb:
            table = buffers["inner"]["puzzle_emb"]["weights"]
            table.value = sparse_sign_sgd_update(
                table.value,
                carry.current_data["puzzle_identifiers"],
                row_grads,
                hyper.puzzle_lr,
                self.config.puzzle_emb_weight_decay,
            )
        ema = ema_update(state.ema, params, self.config.ema_rate) if state.ema is not None else None
        new_state = TrainState(
            step=state.step + 1, params=params, buffers=buffers, opt_state=opt_state, ema=ema, carry=carry
        )
        weights_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((params, buffers))]))
        return new_state, {"loss": loss, "metrics": metrics, "weights_finite": weights_finite}

    def lr(self, base_lr: float, step: int) -> float:
        """Upstream's `compute_lr` for `step` (1-based: upstream increments the step before computing the rate)."""
        config = self.config
        return compute_lr(
            base_lr, step=step, total_steps=self.total_steps, lr_warmup_steps=config.lr_warmup_steps,
            lr_min_ratio=config.lr_min_ratio,
        )  # fmt: skip

    def rates(self, step: int) -> Rates:
        # numpy scalars: jnp.float32(lr) runs a conversion that waits for the step before it, as a key made here did
        return Rates(np.float32(self.lr(self.config.lr, step)), np.float32(self.lr(self.config.puzzle_emb_lr, step)))

    def run_step(self, state: TrainState, batch: dict, hyper: Rates) -> tuple:
        """The compiled step on a host batch (this process's rows): (state, metrics), device arrays."""
        return self._train_step(state, shard_batch(batch, self.mesh), hyper)

    def batches(self, max_steps: int):
        """(step, batch) of this iteration (upstream's train_batch calls) until the schedule or `max_steps` ends."""
        for _, batch, _ in self.train_loader:
            if self.step + 1 > self.total_steps:
                return
            yield self.step + 1, batch
            if self.step >= max_steps:
                self.stopped = True
                return

    def _stepped(self, step: int, state: TrainState) -> None:
        self.step, self.state = step, state

    def _read_step(self, step: int, out: dict) -> dict:
        """A step's metrics, read from the devices (its loss checked): stop at a non-finite weight, else to log."""
        lr, bad = self.lr(self.config.lr, step), "made the weights non-finite: a weight"
        if not out["weights_finite"]:
            self.run.check_finite(step, math.nan, what=f"the update (lr {lr:.3g}) {bad}")
        reduced = reduce_train_metrics(out["metrics"], self.gbs)
        return {f"train/{k}": v for k, v in reduced.items()} | {"train/lr": lr}

    # ----- evaluation

    def eval_model(self) -> TRM:
        params = self.state.params if self.state.ema is None else ema_copy(self.state.ema, self.state.params)
        model = nnx.merge(self.graphdef, params, self.state.buffers, self.rest)
        model.eval()
        return model

    def evaluate(self) -> dict[str, float]:
        if self.eval_loader is None:
            return {}
        saved = self.config.eval_save_outputs
        batches = ((set_name, shard_batch(batch, self.mesh), batch) for set_name, batch, _ in self.eval_loader)
        result, outputs = evaluate(
            self.eval_model(),
            batches,
            self.evaluators,
            lambda x: local_rows(x, self.mesh),
            save_keys=saved,
            save_dir=self.run_dir / f"evaluator_step_{self.step}",
            is_main=self.rank == 0,
        )
        if saved and outputs:  # upstream: every process saves its own rows, step_N_all_preds.RANK
            save_torch_file(outputs, self.run_dir / f"step_{self.step}_all_preds.{self.rank}")
        return result

    # ----- checkpoints

    def save(self) -> int:
        self.run.flush()  # a run that went non-finite stops here, before writing a bad checkpoint
        self.run.save(self.step, self.state, {"data": self.train_loader.state_dict(), "iteration": self.iteration})
        if self.config.export_upstream and self.rank == 0:
            model = nnx.merge(self.graphdef, self.state.params, self.state.buffers, self.rest)
            trm_params.save_upstream_checkpoint(model, self.run_dir / f"step_{self.step}")
        return self.step

    def resume(self) -> bool:
        restored = self.run.restore(abstract_like(self.state))
        if restored is None:
            return False
        self.state, meta = restored
        self.step = meta["step"]
        self.train_loader.load_state_dict(meta["data"])
        self.iteration = meta["iteration"]
        return True

    # ----- the loop

    def train(self) -> dict:
        with self.run:
            return self._train_loop()

    def _train_loop(self) -> dict:
        config, run = self.config, self.run
        resumed = self.resume()
        max_steps = min(self.total_steps, config.max_steps or self.total_steps)
        run.total_steps = max_steps
        run.start_logging(self.step)
        if resumed:
            run.write(f"resumed from step {self.step} ({run.checkpoints.directory})")
        last_eval: dict = {}
        self.stopped = False
        if self.step >= max_steps:  # the run is complete: evaluate its final weights, train nothing
            last_eval = self.evaluate()
            self.stopped = True
        while self.iteration < self.total_iters and not self.stopped:
            save = every(config.checkpoint_every_steps, lambda step, state: self.save())
            self.state = fit(
                run, self.run_step, self.state, self.batches(max_steps), hyper=self.rates, read=self._read_step,
                after=[self._stepped, save],
            )  # fmt: skip
            self.run.flush()
            if self.iteration >= (config.min_eval_interval or 0) or self.stopped:
                last_eval = self.evaluate()
                if last_eval:
                    run.log(self.step, {f"eval/{k}": v for k, v in last_eval.items()})
                    run.write(f"step {self.step} eval: " + json.dumps({k: round(v, 4) for k, v in last_eval.items()}))
            self.iteration += 1
            if config.checkpoint_every_eval or self.stopped or self.iteration == self.total_iters:
                self.save()
        self.run.flush()
        png = run.close()
        return {
            "step": self.step,
            "eval": last_eval,
            "run_dir": str(self.run_dir),
            "learning_curves": str(png) if png else None,
        }


def model_config(config: RunConfig, meta: PuzzleDatasetMetadata) -> TRMConfig:
    """The model's config: the run's arch with the training set's sizes."""
    return TRMConfig.from_arch(
        config.arch.model_dump(),
        source="the run config's arch",
        vocab_size=meta.vocab_size,
        seq_len=meta.seq_len,
        num_puzzle_identifiers=meta.num_puzzle_identifiers,
        batch_size=config.global_batch_size,
    )


def optimizer(config: RunConfig) -> optax.GradientTransformation:
    """Adam-atan2 on the dense weights, its learning rate set every step."""
    return optax.inject_hyperparams(adam_atan2)(
        learning_rate=config.lr, b1=config.beta1, b2=config.beta2, weight_decay=config.weight_decay
    )


class StepBuilder(Trainer):
    """The parts of a `Trainer` its step reads, from a config and the training set's metadata alone: no arrays
    read, no run folder, the model's weights as shapes. `compile_target` compiles its (the trainer's) step."""

    def __init__(self, config: RunConfig, mesh):
        self.config, self.mesh, self.gbs = config, mesh, config.global_batch_size
        if config.global_batch_size % mesh.devices.size:
            raise JaxportError(
                f"global_batch_size={config.global_batch_size} is not divisible by the {mesh.devices.size} devices; "
                f"use a multiple of {mesh.devices.size}"
            )
        meta = PuzzleDataset(config.data_paths, "train", global_batch_size=self.gbs, test_set_mode=False).metadata
        self.model_config = model_config(config, meta)
        self.model = nnx.eval_shape(lambda: TRM(self.model_config, rngs=nnx.Rngs(config.seed)))
        self.model.train()
        self.graphdef, self.params, self.buffers, self.rest = nnx.split(self.model, nnx.Param, Buffer, ...)
        self.use_puzzle_emb = self.model_config.puzzle_emb_ndim > 0
        self.tx = optimizer(config)


def compile_target(config: RunConfig, mesh) -> tuple:
    """`(step, abstract arguments)`: the train step a run of `config` compiles on `mesh`, with shapes and shardings
    in place of its state and batch, from the training set's `dataset.json` alone (`jaxport trm train
    --compile-for`). Placed as `Trainer` places them: the state replicated, the ACT carry's and batch's rows split."""
    from jaxport.runtime.compile_for import abstract

    if not config.data_paths:
        raise JaxportError("data_paths is empty: give the dataset folder(s), e.g. data_paths=[data/sudoku]")
    parts = StepBuilder(config, mesh)
    state = jax.eval_shape(parts._fresh_state, parts.params, parts.buffers)
    rows = lambda x: logical_sharding(mesh, "batch", *[None] * (len(x.shape) - 1))  # noqa: E731
    state = dataclasses.replace(
        abstract(dataclasses.replace(state, carry=None), NamedSharding(mesh, PartitionSpec())),
        carry=abstract(state.carry, jax.tree.map(rows, state.carry)),
    )
    seq_len = parts.model_config.seq_len
    batch = {
        "inputs": jax.ShapeDtypeStruct((parts.gbs, seq_len), jnp.int32),
        "labels": jax.ShapeDtypeStruct((parts.gbs, seq_len), jnp.int32),
        "puzzle_identifiers": jax.ShapeDtypeStruct((parts.gbs,), jnp.int32),
    }
    batch = abstract(batch, jax.tree.map(rows, batch))
    rates = Rates(*[jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))] * 2)
    step = runtime.jit(parts._step, parts.model.runtime_for((parts.gbs, seq_len), mesh), donate_argnums=0)
    return step, (state, batch, rates)


def default_run_paths(config: RunConfig) -> RunConfig:
    """Upstream's defaults: project from the first dataset's folder name, run from the arch name."""
    data_name = Path(config.data_paths[0]).name if config.data_paths else "data"
    project = config.project_name or f"{data_name.capitalize()}-ACT-jax"
    run_name = config.run_name or f"{config.arch.name.split('@')[-1]}-seed{config.seed}"
    return config.replace(
        project_name=project,
        run_name=run_name,
        checkpoint_path=config.checkpoint_path or str(Path("checkpoints") / project / run_name),
    )


def train(config: RunConfig, mesh=None) -> dict:
    return Trainer(default_run_paths(config), mesh=mesh).train()
