"""`jaxport trm train`: upstream `pretrain.py` in JAX.

One jitted, mesh-sharded step does the ACT call, the backward pass of `loss / global_batch_size`,
Adam-atan2 on the weights, sign-SGD on the puzzle-embedding rows of the batch and the EMA update.
The ACT carry lives in the train state, so it persists across batches (and checkpoints) as upstream.
"""

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from jaxport.checkpoint.runs import abstract_like
from jaxport.checkpoint.torch_io import load_torch_file
from jaxport.distributed import fetch_replicated, local_rows, make_mesh, replicate, shard_batch, shard_leading
from jaxport.errors import JaxportError
from jaxport.training import adam_atan2, compute_lr, ema_copy, ema_init, ema_update, sparse_sign_sgd_update
from jaxport.training.run import Run, run_checkpoints
from jaxport.trm import params as trm_params
from jaxport.trm.data import PuzzleDataset
from jaxport.trm.evaluate import reduce_eval_metrics, reduce_train_metrics, run_to_halt
from jaxport.trm.model import TRM, Buffer, Carry, loss_and_grad
from jaxport.trm.run_config import make_model_config


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State        # trained by Adam-atan2
    buffers: nnx.State       # H_init, L_init, the puzzle-embedding table (sign-SGD)
    opt_state: optax.OptState
    ema: nnx.State | None
    carry: Carry


class Trainer:
    def __init__(self, config: dict, mesh=None):
        self.config = config
        self.mesh = mesh if mesh is not None else make_mesh(data=-1)
        self.rank, self.world = jax.process_index(), jax.process_count()
        if not config.get("data_paths"):
            raise JaxportError("data_paths is empty: give the dataset folder(s), e.g. data_paths=[data/sudoku]")
        for path in config["data_paths"]:
            if not Path(path).exists():
                raise JaxportError(f"data path not found: {path} (build it with `jaxport trm build ...`)")
        epochs_per_iter = config["eval_interval"] or config["epochs"]
        if config["epochs"] % epochs_per_iter:
            raise JaxportError(f"epochs ({config['epochs']}) must be a multiple of eval_interval ({epochs_per_iter})")
        self.total_iters = config["epochs"] // epochs_per_iter
        self.gbs = config["global_batch_size"]
        self.train_loader = PuzzleDataset(config["data_paths"], "train", global_batch_size=self.gbs,
                                          test_set_mode=False, epochs_per_iter=epochs_per_iter, seed=config["seed"],
                                          rank=self.rank, num_replicas=self.world)
        meta = self.train_loader.metadata
        eval_paths = config.get("data_paths_test") or config["data_paths"]
        self.eval_loader = None
        if all((Path(p) / "test" / "dataset.json").exists() for p in eval_paths):
            self.eval_loader = PuzzleDataset(eval_paths, "test", global_batch_size=self.gbs, test_set_mode=True,
                                             seed=config["seed"], rank=self.rank, num_replicas=self.world)
        self.total_steps = int(config["epochs"] * meta.total_groups * meta.mean_puzzle_examples / self.gbs)
        self.model_config = make_model_config(config, meta.vocab_size, meta.seq_len, meta.num_puzzle_identifiers)
        self.run_dir = Path(config["checkpoint_path"])
        self.model = TRM(self.model_config, rngs=nnx.Rngs(config["seed"]))
        if config.get("load_checkpoint"):
            self._load_weights(Path(config["load_checkpoint"]))
        self.model.train()
        self.graphdef, params, buffers, self.rest = nnx.split(self.model, nnx.Param, Buffer, ...)
        self.use_puzzle_emb = self.model_config.puzzle_emb_ndim > 0
        self.tx = optax.inject_hyperparams(adam_atan2)(learning_rate=config["lr"], b1=config["beta1"],
                                                        b2=config["beta2"], weight_decay=config["weight_decay"])
        self.evaluators = self._make_evaluators()
        self._train_step = jax.jit(self._step, donate_argnums=0)
        self.state = self._init_state(params, buffers)
        self.run = Run(self.run_dir, config=config, config_name="all_config.yaml", total_steps=self.total_steps,
                       loggers=config.get("loggers") or ["jsonl"], keep_last=config.get("keep_last", 3),
                       keep_every=config.get("keep_every"), project=config.get("project_name"),
                       name=config.get("run_name"), shown=("lm_loss", "accuracy"))

    # ----- set-up

    def _load_weights(self, path: Path) -> None:
        """`load_checkpoint=`: an upstream step_N file, or a jaxport run folder (its latest checkpoint)."""
        if path.is_dir():
            source = run_checkpoints(path)
            _, params, buffers, _ = nnx.split(self.model, nnx.Param, Buffer, ...)
            restored, _ = source.restore({"params": params, "buffers": buffers}, partial=True)
            nnx.update(self.model, restored["params"], restored["buffers"])
            source.close()
            return
        weights = load_torch_file(path, "load_checkpoint")
        weights = trm_params.strip_prefix(trm_params.strip_prefix(weights, trm_params.COMPILED_PREFIX),
                                          trm_params.INNER_PREFIX)
        trm_params.load_state_dict(self.model, weights, source=path)

    def _make_evaluators(self):
        evaluators = []
        for spec in self.config.get("evaluators") or []:
            name = spec["name"] if isinstance(spec, dict) else spec
            if name.split("@")[-1] != "ARC":
                raise JaxportError(f"unknown evaluator {name!r} (jaxport has arc@ARC)")
            from jaxport.trm.arc_eval import ARCEvaluator
            data_path = (self.config.get("data_paths_test") or self.config["data_paths"])[0]
            kwargs = {k: v for k, v in spec.items() if k != "name"} if isinstance(spec, dict) else {}
            evaluators.append(ARCEvaluator(data_path, blank_identifier_id=self.train_loader.metadata.blank_identifier_id,
                                           **kwargs))
        return evaluators

    def _init_state(self, params, buffers) -> TrainState:
        meta = self.train_loader.metadata
        global_shape = {"inputs": (self.gbs, meta.seq_len), "labels": (self.gbs, meta.seq_len),
                        "puzzle_identifiers": (self.gbs,)}
        carry = self.model.initial_carry({k: np.zeros(s, np.int32) for k, s in global_shape.items()})
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, buffers=buffers,
                           opt_state=self.tx.init(params), ema=ema_init(params) if self.config["ema"] else None,
                           carry=None)
        state = replicate(state, self.mesh)
        return dataclasses.replace(state, carry=shard_leading(carry, self.mesh))

    # ----- the step

    def _step(self, state: TrainState, batch: dict, lr, puzzle_lr, halt_key):
        model = nnx.merge(self.graphdef, state.params, state.buffers, self.rest)
        (carry, loss, metrics, _), (param_grads, row_grads) = loss_and_grad(model, state.carry, batch, self.gbs,
                                                                            halt_key)
        params, opt_state, buffers = state.params, state.opt_state, state.buffers
        if not self.config["freeze_weights"]:
            opt_state.hyperparams["learning_rate"] = lr
            updates, opt_state = self.tx.update(param_grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        if self.use_puzzle_emb:
            table = buffers["inner"]["puzzle_emb"]["weights"]
            table.value = sparse_sign_sgd_update(table.value, carry.current_data["puzzle_identifiers"], row_grads,
                                                 puzzle_lr, self.config["puzzle_emb_weight_decay"])
        ema = ema_update(state.ema, params, self.config["ema_rate"]) if state.ema is not None else None
        new_state = TrainState(step=state.step + 1, params=params, buffers=buffers, opt_state=opt_state, ema=ema,
                               carry=carry)
        weights_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((params, buffers))]))
        return new_state, loss, metrics, weights_finite

    def halt_key(self, step: int):
        return jax.random.fold_in(jax.random.key(self.config["seed"]), step)

    def train_batch(self, batch: dict) -> dict | None:
        step = int(fetch_replicated(self.state.step)) + 1  # upstream increments before computing the LR
        if step > self.total_steps:
            return None
        lr_args = dict(step=step, total_steps=self.total_steps, lr_warmup_steps=self.config["lr_warmup_steps"],
                       lr_min_ratio=self.config["lr_min_ratio"])
        lr = compute_lr(self.config["lr"], **lr_args)
        puzzle_lr = compute_lr(self.config["puzzle_emb_lr"], **lr_args)
        self.state, loss, metrics, weights_finite = self._train_step(
            self.state, shard_batch(batch, self.mesh), jnp.float32(lr), jnp.float32(puzzle_lr), self.halt_key(step))
        self.run.check_finite(step, fetch_replicated(loss))
        if not bool(fetch_replicated(weights_finite)):
            self.run.check_finite(step, math.nan, what=f"the update (lr {lr:.3g}) made the weights non-finite: a weight")
        reduced = reduce_train_metrics({k: fetch_replicated(v) for k, v in metrics.items()}, self.gbs)
        return {f"train/{k}": v for k, v in reduced.items()} | {"train/lr": lr}

    # ----- evaluation

    def eval_model(self) -> TRM:
        params = self.state.params
        if self.state.ema is not None:
            params = ema_copy(self.state.ema, params)
        model = nnx.merge(self.graphdef, params, self.state.buffers, self.rest)
        model.eval()
        return model

    def evaluate(self) -> dict[str, float]:
        if self.eval_loader is None:
            return {}
        model = self.eval_model()
        for evaluator in self.evaluators:
            evaluator.begin_eval()
        sums: dict[str, dict[str, np.float32]] = {}
        for set_name, batch, _ in self.eval_loader:
            (_, _, metrics, outputs), _ = run_to_halt(model, shard_batch(batch, self.mesh))
            set_sums = sums.setdefault(set_name, {})
            for k, v in metrics.items():
                set_sums[k] = np.float32(set_sums.get(k, 0)) + np.float32(fetch_replicated(v))
            if self.evaluators:
                local = {k: local_rows(v, self.mesh) for k, v in outputs.items() if k in ("q_halt_logits", "preds")}
                local |= {k: batch[k] for k in ("inputs", "puzzle_identifiers")}
                for evaluator in self.evaluators:
                    evaluator.update_batch(local, local)
        flat = {f"{s}/{k}": float(v) for s, m in reduce_eval_metrics(sums).items() for k, v in m.items()}
        save_dir = self.run_dir / f"evaluator_step_{int(fetch_replicated(self.state.step))}"
        for evaluator in self.evaluators:
            result = evaluator.result(save_dir if self.rank == 0 else None)
            if result:
                flat |= result
        return flat

    # ----- checkpoints

    def save(self) -> int:
        step = int(fetch_replicated(self.state.step))
        self.run.save(step, self.state, {"data": self.train_loader.state_dict(), "iteration": self.iteration})
        if self.config.get("export_upstream") and self.rank == 0:
            model = nnx.merge(self.graphdef, self.state.params, self.state.buffers, self.rest)
            trm_params.save_upstream_checkpoint(model, self.run_dir / f"step_{step}")
        return step

    def resume(self) -> bool:
        restored = self.run.restore(abstract_like(self.state))
        if restored is None:
            return False
        self.state, meta = restored
        self.train_loader.load_state_dict(meta["data"])
        self.iteration = meta["iteration"]
        return True

    # ----- the loop

    def train(self) -> dict:
        with self.run:
            return self._train_loop()

    def _train_loop(self) -> dict:
        config, run = self.config, self.run
        self.iteration = 0
        resumed = self.resume()
        start_step = int(fetch_replicated(self.state.step))
        max_steps = min(self.total_steps, config.get("max_steps") or self.total_steps)
        run.total_steps = max_steps
        run.start_logging(start_step)
        if resumed:
            run.write(f"resumed from step {start_step} ({run.checkpoints.directory})")
        every = config.get("checkpoint_every_steps")
        last_eval: dict = {}
        stopped = False
        while self.iteration < self.total_iters and not stopped:
            for _, batch, _ in self.train_loader:
                metrics = self.train_batch(batch)
                if metrics is None:
                    break
                step = int(fetch_replicated(self.state.step))
                run.log(step, metrics)
                if every and step % every == 0:
                    self.save()
                if step >= max_steps:
                    stopped = True
                    break
            if self.iteration >= config["min_eval_interval"] or stopped:
                last_eval = self.evaluate()
                if last_eval:
                    step = int(fetch_replicated(self.state.step))
                    run.log(step, {f"eval/{k}": v for k, v in last_eval.items()})
                    run.write(f"step {step} eval: " + json.dumps({k: round(v, 4) for k, v in last_eval.items()}))
            self.iteration += 1
            if config["checkpoint_every_eval"] or stopped or self.iteration == self.total_iters:
                self.save()
        png = run.close()
        return {"step": int(fetch_replicated(self.state.step)), "eval": last_eval, "run_dir": str(self.run_dir),
                "learning_curves": str(png) if png else None}


def default_run_paths(config: dict) -> dict:
    """Upstream's defaults: project from the first dataset's folder name, run from the arch name."""
    config = dict(config)
    data_name = Path(config["data_paths"][0]).name if config.get("data_paths") else "data"
    config["project_name"] = config.get("project_name") or f"{data_name.capitalize()}-ACT-jax"
    arch_name = config["arch"].get("name", "trm").split("@")[-1]
    config["run_name"] = config.get("run_name") or f"{arch_name}-seed{config['seed']}"
    config["checkpoint_path"] = config.get("checkpoint_path") or str(
        Path("checkpoints") / config["project_name"] / config["run_name"])
    return config


def train(config: dict, mesh=None) -> dict:
    return Trainer(default_run_paths(config), mesh=mesh).train()
