"""nanoGPT's training state and step in JAX: one jitted step per iteration.

The step takes all micro-batches of an iteration at once and scans over
them, summing gradients of loss / steps (as nanoGPT's repeated backward does), then
clips the global norm as `clip_grad_norm_` does and applies optax AdamW with nanoGPT's
two groups (2-D parameters decayed, biases and LayerNorm not). The batch axis is
split over the mesh's `data` and `fsdp` axes, so XLA all-reduces the gradients; with
`--fsdp=N` the 2-D parameters and their AdamW moments are also split N ways along their
first dimension (ZeRO-3 style), gathered by XLA where a layer needs them. As under
nanoGPT's DDP, `batch_size` is per device and `gradient_accumulation_steps` is shared
out among the devices, so the tokens per iteration do not depend on the device count.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxport import runtime
from jaxport.checkpoint.runs import abstract_like
from jaxport.distributed import logical_sharding, make_mesh, replicate, shard_batch, tree_shardings
from jaxport.dtypes import float_dtype
from jaxport.errors import JaxportError
from jaxport.gpt import params as gpt_params
from jaxport.gpt.config import GPTConfig
from jaxport.gpt.data import load_meta
from jaxport.gpt.model import GPT, Checkpoint, load_checkpoint
from jaxport.gpt.settings import TrainSettings, data_folder, micro_steps, scratch_config, train_settings
from jaxport.runtime.compile_for import abstract
from jaxport.training.optimizers import moment_shardings
from jaxport.training.run import restore_params
from jaxport.training.step import accumulate_gradients, apply_gradients, decay_mask, initial_loss_scale


def compute_dtype(dtype: str, platform: str):
    """nanoGPT autocasts only on GPUs: on the CPU it computes in float32 whatever --dtype says."""
    chosen = float_dtype(dtype, allowed=("float32", "bfloat16", "float16"), what="--dtype")
    return jnp.dtype(jnp.float32) if platform == "cpu" else chosen


def select_devices(device: str) -> list:
    """nanoGPT's --device (cpu, cuda, cuda:1, mps, tpu) -> JAX devices of that platform."""
    platform = {"cuda": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu", "mps": "METAL"}.get(device.split(":")[0])
    if platform is None:
        raise JaxportError(f"--device={device}: use cpu, cuda, cuda:N or tpu")
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        fallback = jax.devices()
        print(f"--device={device}: no {platform} devices here, using {fallback[0].platform}")
        return fallback
    return devices[int(device.split(":")[1]) :][:1] if ":" in device else devices


def adamw(weight_decay: float, beta1: float, beta2: float, eps: float = 1e-8):
    """torch AdamW (decoupled decay p *= 1 - lr*wd, bias-corrected moments) on 2-D+ params only;
    the learning rate is a hyperparameter set every iteration."""
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(  # a callable mask is no schedule
        learning_rate=0.0,
        b1=beta1,
        b2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        mask=decay_mask,
    )


def initial_model(
    cfg: TrainSettings | dict, vocab_size: int | None, model_args: dict | None = None
) -> tuple[GPT, Checkpoint | None]:
    """train.py's init_from: a new model, the run's ckpt.pt (returned too), or GPT-2 weights. With
    `model_args` (a jaxport run's own checkpoint, restored afterwards) a model of that size."""
    cfg = train_settings(cfg)
    init_from, ckpt = cfg.init_from, None
    if model_args is not None:
        model = GPT.init(GPTConfig(**{**model_args, "dropout": cfg.dropout}), seed=cfg.seed)
    elif init_from == "scratch":
        model = GPT.init(scratch_config(cfg, vocab_size), seed=cfg.seed)
    elif init_from == "resume":  # the architecture comes from the checkpoint, dropout from the flags
        ckpt = load_checkpoint(Path(cfg.out_dir) / "ckpt.pt", dropout=cfg.dropout)
        model = ckpt.model
    elif init_from.startswith("gpt2") or Path(init_from).is_dir():
        model = GPT.from_pretrained(init_from, dict(dropout=cfg.dropout))
    else:
        raise JaxportError(
            f"--init_from={init_from}: use scratch, resume, gpt2, gpt2-medium, gpt2-large, "
            f"gpt2-xl or a Hugging Face GPT-2 folder"
        )
    if cfg.block_size > model.config.block_size:
        raise JaxportError(
            f"--block_size={cfg.block_size} is larger than the {init_from} model's block_size {model.config.block_size}"
        )
    if init_from not in ("scratch", "resume") and cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    if vocab_size is not None and vocab_size != model.config.vocab_size:
        raise JaxportError(
            f"the dataset's meta.pkl says vocab_size {vocab_size} but the {init_from} model "
            f"has vocab_size {model.config.vocab_size}"
        )
    return model, ckpt


class TrainState(NamedTuple):
    """What a step updates: the weights, the AdamW state and float16's loss scale (scale, finite steps in a row)."""

    params: dict
    opt_state: optax.OptState
    loss_scale: tuple


class Hyper(NamedTuple):
    """What the host computes for an iteration: its learning rate (nanoGPT's float64 `get_lr`, as float32) and the
    iteration number its dropout key is drawn for."""

    lr: np.float32
    draw: np.int32


def training_mesh(cfg: TrainSettings | dict, devices):
    """The run's mesh over `devices`: the batch split over all of them, the 2-D weights over `--fsdp` of them."""
    fsdp = train_settings(cfg).fsdp
    if fsdp < 1 or len(devices) % fsdp:
        raise JaxportError(f"--fsdp={fsdp} does not divide the {len(devices)} devices")
    return make_mesh(fsdp=fsdp, devices=devices)


class Trainer:
    """Model, optimizer state and the compiled steps of one run (init_from scratch/resume/gpt2*)."""

    def __init__(
        self, cfg: TrainSettings | dict, vocab_size: int | None = None, devices=None, resume_meta: dict | None = None
    ):
        """`resume_meta`: the meta of a jaxport run's orbax checkpoint, whose state `load_state` restores."""
        self.cfg = cfg = train_settings(cfg)
        self.mesh = training_mesh(cfg, select_devices(cfg.device) if devices is None else devices)
        self.dtype = compute_dtype(cfg.dtype, self.mesh.devices.flat[0].platform)
        model, ckpt = initial_model(cfg, vocab_size, resume_meta and resume_meta["model_args"])
        self.iter_num, self.best_val_loss = (ckpt.iter_num, ckpt.best_val_loss) if ckpt else (0, 1e9)
        betas, eps, wd = (cfg.beta1, cfg.beta2), 1e-8, cfg.weight_decay
        if resume_meta is not None:  # as torch's optimizer.load_state_dict, the saved hyperparameters
            (betas, eps, wd), self.iter_num = resume_meta["adamw"], resume_meta["iter_num"]
            self.best_val_loss = resume_meta["best_val_loss"]
        moments = None
        if ckpt is not None and ckpt.optimizer is not None:
            *moments, groups = gpt_params.torch_adamw_to_moments(ckpt.optimizer, model.config, str(ckpt.path))
            # torch's optimizer.load_state_dict restores the groups' hyperparameters too
            betas, eps, wd = tuple(groups[0]["betas"]), groups[0]["eps"], groups[0]["weight_decay"]
        model.dtype = self.dtype
        self.model_config = model.config
        self.graphdef, state = nnx.split(model)
        self.optimizer = adamw(wd, *betas, eps)
        self.betas, self.eps, self.weight_decay = betas, eps, wd
        params = nnx.to_pure_dict(state)
        param_shardings = tree_shardings(params, self.mesh, gpt_params.logical_axes)
        self.params = jax.device_put(params, param_shardings)
        self.opt_state = jax.jit(self.optimizer.init)(self.params)
        if moments is not None:
            self.opt_state = gpt_params.with_torch_moments(self.opt_state, moments)
        self.opt_state = jax.device_put(
            self.opt_state, moment_shardings(self.optimizer, self.opt_state, param_shardings, self.mesh)
        )
        # float16 needs dynamic loss scaling, as nanoGPT's GradScaler: (scale, finite steps in a row)
        self.loss_scale = replicate(initial_loss_scale(self.dtype == jnp.float16), self.mesh)
        state_shardings = jax.tree.map(lambda x: x.sharding, self.train_state())
        # batch_size is per device (nanoGPT's DDP rule)
        self.runtime = runtime.for_devices(self.mesh).for_program(self.dtype, cfg.batch_size * cfg.block_size)
        self._step = _make_train_step(self.graphdef, self.optimizer, cfg, state_shardings, self.dtype, self.runtime)
        self._eval = _make_eval_step(self.graphdef, self.runtime, self.mesh)

    @property
    def compiler_options(self) -> dict | None:
        """The XLA options the step and the evaluation compile with (`runtime`)."""
        return self.runtime.compiler_options

    @property
    def model(self) -> GPT:
        return nnx.merge(self.graphdef, self.params)

    def train_state(self) -> TrainState:
        return TrainState(self.params, self.opt_state, self.loss_scale)

    def load(self, state: TrainState) -> None:
        self.params, self.opt_state, self.loss_scale = state

    # -- the run's own (orbax) checkpoints: the whole train state, sharded as it lives on the devices
    def state(self) -> dict:
        return self.train_state()._asdict()

    def load_state(self, state: dict) -> None:
        self.load(TrainState(**state))

    def checkpoint_meta(self, iter_num: int, best_val_loss: float) -> dict:
        """What resuming needs beside the arrays (JSON)."""
        return {
            "iter_num": int(iter_num),
            "best_val_loss": float(best_val_loss),
            "model_args": self.model_config.to_model_args(),
            "config": self.cfg.as_dict(),
            "adamw": [list(self.betas), self.eps, self.weight_decay],
        }

    def _shard(self, *arrays) -> tuple:
        """Rows ([..., B, T]) over the mesh. With several processes, `arrays` are this process's rows."""
        n = self.mesh.devices.size // jax.process_count()
        for a in arrays:
            if a.shape[-2] % n:
                raise JaxportError(f"batch of {a.shape[-2]} rows is not divisible by the {n} devices of the mesh")
        return tuple(shard_batch([np.asarray(a, np.int32) for a in arrays], self.mesh, batch_dim=-2))

    def run_step(self, state: TrainState, batch: tuple, hyper: Hyper) -> tuple:
        """The compiled step on host micro-batches `batch` = (X, Y) [accum, B, T]: (state, metrics), device arrays."""
        return self._step(state, self._shard(*batch), hyper)

    def step(self, X, Y, lr: float, draw: int = 0):
        """One iteration on micro-batches X, Y [accum, B, T] with the dropout key of iteration `draw`: returns
        (micro losses, grad norm) as device arrays (reading them waits for the step). The arguments go in as
        numpy values: an eager `jnp` conversion or key would wait for the step before it."""
        state, metrics = self._step(*self.step_args(X, Y, lr, draw))
        self.load(state)
        return metrics["loss"], metrics["grad_norm"]

    def step_args(self, X, Y, lr: float, draw: int = 0) -> tuple:
        """The compiled step's arguments `(state, batch, hyper)` for `step(X, Y, lr, draw)`."""
        return self.train_state(), self._shard(X, Y), Hyper(np.float32(lr), np.int32(draw))

    def eval_losses(self, X, Y):
        """The losses of batches X, Y [n, B, T] (device array, one per batch)."""
        return self._eval(self.params, *self._shard(X, Y))

    def adam_state(self) -> optax.ScaleByAdamState:
        return gpt_params.adam_state(self.opt_state)

    def checkpoint(self, iter_num: int, best_val_loss: float, lr: float) -> dict:
        """The dict nanoGPT's train.py saves as ckpt.pt."""
        adamw_hyper = (self.betas, self.eps, self.weight_decay)
        return gpt_params.nanogpt_checkpoint(
            self.params, self.opt_state, self.model_config, adamw_hyper, self.cfg.as_dict(),
            iter_num=iter_num, best_val_loss=best_val_loss, lr=lr,
        )  # fmt: skip


def _make_train_step(graphdef, optimizer, cfg: TrainSettings, state_shardings, dtype, step_runtime):
    """`step(state, batch, hyper) -> (state, metrics)`: all micro-batches of an iteration, jitted under
    `step_runtime` with the state donated."""
    mesh = jax.tree.leaves(state_shardings)[0].mesh
    dropout, loss_scaling, seed = cfg.dropout > 0, dtype == jnp.float16, cfg.seed

    def loss_fn(params, x, y, rng):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the model places its activations on it
            return nnx.merge(graphdef, params).forward(x, y, rng if dropout else None)[1]

    # outputs keep the inputs' shardings, so the next call reuses this compilation
    @functools.partial(
        runtime.jit_training_step, runtime=step_runtime, donate_argnums=0, out_shardings=(state_shardings, None)
    )
    def step(state: TrainState, batch: tuple, hyper: Hyper):
        params, opt_state, loss_scale = state
        X, Y = batch
        # the dropout key of iteration `draw`, made here: made on the host, it waited for the step before it
        rng = jax.random.fold_in(jax.random.key(seed), hyper.draw)
        accum = X.shape[0]
        scale = loss_scale[0]

        def objective(p, xy, key):  # the gradients of loss / accum add up to the mean's, as in nanoGPT
            loss = loss_fn(p, *xy, key)
            return loss / accum * scale, loss

        grads, losses = accumulate_gradients(objective, params, (X, Y), jax.random.split(rng, accum))
        scaled = loss_scale if loss_scaling else None  # float16's GradScaler skips steps whose gradients overflow
        params, opt_state, scaled, norm = apply_gradients(
            optimizer, grads, opt_state, params, lr=hyper.lr, grad_clip=cfg.grad_clip, loss_scale=scaled
        )
        state = TrainState(params, opt_state, scaled if loss_scaling else loss_scale)
        return state, {"loss": losses, "grad_norm": norm}

    return step


def _make_eval_step(graphdef, step_runtime, mesh):
    @functools.partial(runtime.jit, runtime=step_runtime)
    def evaluate(params, X_NBT, Y_NBT):  # all N batches in one compiled call, one batch at a time
        model = nnx.merge(graphdef, params)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the model places its activations on it
            return jax.lax.map(lambda xy: model.forward(*xy)[1], (X_NBT, Y_NBT))

    return evaluate


def compile_target(cfg: TrainSettings | dict, mesh) -> tuple:
    """`(step, abstract arguments)`: the iteration `Trainer.step` runs for `cfg` on `mesh` (`training_mesh`), with
    shapes and shardings in place of weights and batches (`jaxport gpt train --compile-for`). The model comes from
    the flags' sizes (init_from=scratch, the dataset's meta.pkl giving the vocabulary) or a GPT-2 name's."""
    cfg = train_settings(cfg)
    world = mesh.devices.size
    accum = micro_steps(cfg, world)
    dtype = compute_dtype(cfg.dtype, mesh.devices.flat[0].platform)
    init_from = cfg.init_from
    if init_from in gpt_params.GPT2_SIZES:  # GPT-2's own block (cropped as initial_model does), vocabulary, biases
        config = GPTConfig(
            **gpt_params.GPT2_SIZES[init_from], block_size=cfg.block_size, vocab_size=50257, dropout=cfg.dropout
        )
    elif init_from == "scratch":
        meta = load_meta(data_folder(cfg) / "meta.pkl")
        config = scratch_config(cfg, int(meta["vocab_size"]) if meta else None)
    else:
        raise JaxportError(
            f"--init_from={init_from}: --compile-for builds the model from its sizes; use --init_from=scratch with "
            f"the run's --n_layer, --n_head, --n_embd, or a GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl)"
        )
    model = GPT.abstract(config)
    model.dtype = dtype
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    optimizer = adamw(cfg.weight_decay, cfg.beta1, cfg.beta2)
    opt_state = jax.eval_shape(optimizer.init, params)
    param_shardings = tree_shardings(params, mesh, gpt_params.logical_axes)
    replicated = NamedSharding(mesh, PartitionSpec())
    moments = moment_shardings(optimizer, opt_state, param_shardings, mesh)
    state_shardings = TrainState(param_shardings, moments, (replicated, replicated))
    loss_scale = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    state = abstract(TrainState(params, opt_state, loss_scale), state_shardings)
    rows = logical_sharding(mesh, None, "batch", None)  # as shard_batch places [accum, B, T] micro-batches
    batch = jax.ShapeDtypeStruct((accum, cfg.batch_size * world, cfg.block_size), jnp.int32, sharding=rows)
    step_runtime = runtime.for_devices(mesh).for_program(dtype, cfg.batch_size * cfg.block_size)
    step = _make_train_step(graphdef, optimizer, cfg, state_shardings, dtype, step_runtime)
    hyper = Hyper(*[jax.ShapeDtypeStruct((), t, sharding=replicated) for t in (jnp.float32, jnp.int32)])
    return step, (state, (batch, batch), hyper)


def restore_trainer(checkpoints, run_config, devices, vocab_size: int | None = None) -> Trainer | None:
    """A Trainer holding the newest intact orbax checkpoint of a jaxport run, or None if it has none.
    `run_config(meta)` gives the training config given the checkpoint's meta."""
    if checkpoints.latest_step() is None:
        return None
    trainer = None

    def abstract_state(meta):  # the model's size is in the checkpoint's meta
        nonlocal trainer
        trainer = Trainer(run_config(meta), vocab_size=vocab_size, devices=devices, resume_meta=meta)
        return abstract_like(trainer.state())

    state, _ = checkpoints.restore(abstract_state)
    trainer.load_state(state)
    return trainer


def load_trained_model(out_dir) -> tuple[GPT, dict]:
    """(model, training config) of a run: from its newest intact jaxport checkpoint, else from its
    ckpt.pt (a nanoGPT run, or nanoGPT's file written beside jaxport's)."""
    out_dir = Path(out_dir)
    graphdef = None

    def abstract_params(meta):  # the model's size is in the checkpoint's meta
        nonlocal graphdef
        graphdef, state = nnx.split(GPT.abstract(GPTConfig(**meta["model_args"])))
        return nnx.to_pure_dict(state)

    restored = restore_params(out_dir, abstract_params)
    if restored is not None:
        params, meta = restored
        return nnx.merge(graphdef, params), meta["config"]
    ckpt = load_checkpoint(out_dir)
    return ckpt.model, ckpt.config
