"""nanoGPT's train.py in JAX: same flags, same checkpoints, one jitted step per iteration.

The step takes all micro-batches of an iteration at once and scans over
them, summing gradients of loss / steps (as nanoGPT's repeated backward does), then
clips the global norm as `clip_grad_norm_` does and applies optax AdamW with nanoGPT's
two groups (2-D parameters decayed, biases and LayerNorm not). The batch axis is
split over the mesh's `data` and `fsdp` axes, so XLA all-reduces the gradients; with
`--fsdp=N` the 2-D parameters and their AdamW moments are also split N ways along their
first dimension (ZeRO-3 style), gathered by XLA where a layer needs them. As under
nanoGPT's DDP, `batch_size` is per device and `gradient_accumulation_steps` is shared
out among the devices, so the tokens per iteration do not depend on the device count.
Several hosts (`jaxport.distributed.initialize`: JAXPORT_COORDINATOR, ... or SLURM/TPU
auto-detection) each load their own rows (seed + process index, nanoGPT's seed_offset) and
the first process writes the checkpoint and logs.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pydantic
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxport import runtime
from jaxport.checkpoint import torch_available
from jaxport.checkpoint.runs import abstract_like
from jaxport.distributed import fetch_replicated, logical_sharding, make_mesh, replicate, shard_batch, tree_shardings
from jaxport.dtypes import float_dtype
from jaxport.errors import JaxportError
from jaxport.gpt import params as gpt_params
from jaxport.gpt.config import GPTConfig
from jaxport.gpt.data import Batches, load_meta
from jaxport.gpt.model import GPT, Checkpoint, estimate_mfu, load_checkpoint
from jaxport.runtime.compile_for import abstract
from jaxport.runtime.topologies import device_peak_flops
from jaxport.training.loop import ImportAhead, fit
from jaxport.training.optimizers import moment_shardings
from jaxport.training.run import CHECKPOINT_SUBDIR, Run, restore_params, run_checkpoints
from jaxport.training.schedules import nanogpt_lr
from jaxport.training.step import accumulate_gradients, apply_gradients, decay_mask, initial_loss_scale
from jaxport.typed_config import validate

# nanoGPT train.py's globals, same names and defaults (GPT-2 124M on OpenWebText).
DEFAULTS = dict(
    out_dir="out",
    eval_interval=2000,
    log_interval=1,
    eval_iters=200,
    eval_only=False,
    always_save_checkpoint=True,
    init_from="scratch",
    wandb_log=False,
    wandb_project="owt",
    wandb_run_name="gpt2",
    dataset="openwebtext",
    gradient_accumulation_steps=5 * 8,
    batch_size=12,
    block_size=1024,
    n_layer=12,
    n_head=12,
    n_embd=768,
    dropout=0.0,
    bias=False,
    learning_rate=6e-4,
    max_iters=600000,
    weight_decay=1e-1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,
    decay_lr=True,
    warmup_iters=2000,
    lr_decay_iters=600000,
    min_lr=6e-5,
    backend="nccl",
    device="cuda",
    dtype="bfloat16",
    compile=True,
)
# jaxport's own: data root, seed, progress bar, FSDP ways (a divisor of the device count), orbax
# checkpoints every N iterations besides nanoGPT's eval-time saves, and how many of them to keep
# (the newest keep_last, plus every keep_every-th iteration).
EXTRA = dict(data_dir="data", seed=1337, progress=True, fsdp=1, checkpoint_interval=None, keep_last=3, keep_every=None)
Rate = pydantic.confloat(ge=0, allow_inf_nan=False)
Fraction = pydantic.confloat(ge=0, lt=1)


class TrainSettings(pydantic.BaseModel):
    """nanoGPT's flags and jaxport's (`DEFAULTS`, `EXTRA`), typed, with the values they may take: outside them
    nanoGPT crashes mid-run or trains nonsense. Read as attributes; `settings["key"]` reads one as nanoGPT's
    globals dict did."""

    model_config = pydantic.ConfigDict(extra="allow", frozen=True)
    out_dir: str = DEFAULTS["out_dir"]
    eval_interval: pydantic.PositiveInt = DEFAULTS["eval_interval"]
    log_interval: pydantic.PositiveInt = DEFAULTS["log_interval"]
    eval_iters: pydantic.PositiveInt = DEFAULTS["eval_iters"]
    eval_only: bool = DEFAULTS["eval_only"]
    always_save_checkpoint: bool = DEFAULTS["always_save_checkpoint"]
    init_from: str = DEFAULTS["init_from"]
    wandb_log: bool = DEFAULTS["wandb_log"]
    wandb_project: str = DEFAULTS["wandb_project"]
    wandb_run_name: str = DEFAULTS["wandb_run_name"]
    dataset: str = DEFAULTS["dataset"]
    gradient_accumulation_steps: pydantic.PositiveInt = DEFAULTS["gradient_accumulation_steps"]
    batch_size: pydantic.PositiveInt = DEFAULTS["batch_size"]
    block_size: pydantic.PositiveInt = DEFAULTS["block_size"]
    n_layer: pydantic.PositiveInt = DEFAULTS["n_layer"]
    n_head: pydantic.PositiveInt = DEFAULTS["n_head"]
    n_embd: pydantic.PositiveInt = DEFAULTS["n_embd"]
    dropout: Fraction = DEFAULTS["dropout"]
    bias: bool = DEFAULTS["bias"]
    learning_rate: Rate = DEFAULTS["learning_rate"]
    max_iters: pydantic.NonNegativeInt = DEFAULTS["max_iters"]
    weight_decay: Rate = DEFAULTS["weight_decay"]
    beta1: Fraction = DEFAULTS["beta1"]
    beta2: Fraction = DEFAULTS["beta2"]
    grad_clip: Rate = DEFAULTS["grad_clip"]
    decay_lr: bool = DEFAULTS["decay_lr"]
    warmup_iters: pydantic.NonNegativeInt = DEFAULTS["warmup_iters"]
    lr_decay_iters: pydantic.NonNegativeInt = DEFAULTS["lr_decay_iters"]
    min_lr: Rate = DEFAULTS["min_lr"]
    backend: str = DEFAULTS["backend"]
    device: str = DEFAULTS["device"]
    dtype: str = DEFAULTS["dtype"]
    compile: bool = DEFAULTS["compile"]
    data_dir: str = EXTRA["data_dir"]
    seed: int = EXTRA["seed"]
    progress: bool = EXTRA["progress"]
    fsdp: pydantic.PositiveInt = EXTRA["fsdp"]
    checkpoint_interval: pydantic.PositiveInt | None = EXTRA["checkpoint_interval"]
    keep_last: pydantic.PositiveInt | None = EXTRA["keep_last"]
    keep_every: pydantic.PositiveInt | None = EXTRA["keep_every"]

    @pydantic.model_validator(mode="after")
    def _decay_after_warmup(self):
        if self.decay_lr and self.lr_decay_iters <= self.warmup_iters:
            raise ValueError(
                f"lr_decay_iters ({self.lr_decay_iters}) must be larger than warmup_iters "
                f"({self.warmup_iters}) for the cosine decay (or --decay_lr=False)"
            )
        return self

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return self.model_dump()


def train_settings(cfg) -> TrainSettings:
    """`cfg` (a dict of flags, or settings already) as `TrainSettings`, or one error naming the flag, its value and
    what is expected."""
    if isinstance(cfg, TrainSettings):
        return cfg
    return validate(TrainSettings, cfg, "the training config (flags and config files)", what="flag")


def compute_dtype(dtype: str, platform: str):
    """nanoGPT autocasts only on GPUs: on the CPU it computes in float32 whatever --dtype says."""
    chosen = float_dtype(dtype, allowed=("float32", "bfloat16", "float16"), what="--dtype")
    return jnp.dtype(jnp.float32) if platform == "cpu" else chosen


def get_lr(it: int, cfg: TrainSettings | dict) -> float:
    """The learning rate of iteration `it`: nanoGPT's `get_lr` with --decay_lr, else --learning_rate."""
    cfg = train_settings(cfg)
    if not cfg.decay_lr:
        return cfg.learning_rate
    return nanogpt_lr(
        it, learning_rate=cfg.learning_rate, warmup_iters=cfg.warmup_iters, lr_decay_iters=cfg.lr_decay_iters,
        min_lr=cfg.min_lr,
    )  # fmt: skip


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


def scratch_config(cfg: TrainSettings | dict, vocab_size: int | None) -> GPTConfig:
    """train.py's model_args for init_from=scratch: the flags' sizes, the dataset's vocabulary (GPT-2's padded
    50304 without a meta.pkl)."""
    cfg = train_settings(cfg)
    return GPTConfig(
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        block_size=cfg.block_size,
        bias=cfg.bias,
        dropout=cfg.dropout,
        vocab_size=vocab_size if vocab_size is not None else 50304,
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


def micro_steps(cfg: TrainSettings | dict, world: int) -> int:
    """Micro-batches each iteration scans over: nanoGPT's DDP rule, batch_size is per device and the accumulation
    steps are shared out among the `world` devices."""
    cfg = train_settings(cfg)
    accum = cfg.gradient_accumulation_steps
    if accum % world:
        raise JaxportError(
            f"gradient_accumulation_steps={accum} must be a multiple of the {world} devices "
            f"(each device takes batch_size={cfg.batch_size} per micro-step)"
        )
    return accum // world


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


def data_folder(cfg: TrainSettings | dict) -> Path:
    cfg = train_settings(cfg)
    return Path(cfg.data_dir) / cfg.dataset


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


def export(out_dir, device: str = "cpu") -> Path:
    """`jaxport gpt export`: nanoGPT's ckpt.pt from a run's newest intact orbax checkpoint (on a multi-host
    run every process calls it: the arrays are gathered and process 0 writes the file)."""
    out_dir = Path(out_dir)
    with run_checkpoints(out_dir) as checkpoints:
        trainer = restore_trainer(
            checkpoints,
            lambda meta: {**DEFAULTS, **EXTRA, **meta["config"], "device": device, "init_from": "resume"},
            select_devices(device),
        )
    if trainer is None:
        raise JaxportError(
            f"{out_dir} has no jaxport checkpoints to export (expected {out_dir / CHECKPOINT_SUBDIR}, "
            f"written by `jaxport gpt train`)"
        )
    lr = get_lr(trainer.iter_num, trainer.cfg)
    gpt_params.write_nanogpt_checkpoint(trainer, out_dir, trainer.iter_num, trainer.best_val_loss, lr)
    return out_dir / "ckpt.pt"


# -- the training loop -------------------------------------------------------------------------


def train(cfg: TrainSettings | dict) -> dict:
    """`jaxport gpt train`: nanoGPT's loop on `jaxport.training.loop.fit`. Returns the last losses.

    Besides nanoGPT's ckpt.pt (single-process runs), the run keeps orbax checkpoints in
    out_dir/jaxport_checkpoints (at every evaluation that nanoGPT would save at, and every
    `checkpoint_interval` iterations) holding the whole train state and the data sampler's
    position, so `--init_from=resume` continues on exactly the batches an uninterrupted run sees."""
    cfg = train_settings(cfg)
    devices = select_devices(cfg.device)
    world, accum = len(devices), micro_steps(cfg, len(devices))
    data_dir = data_folder(cfg)
    local_rows = cfg.batch_size * world // jax.process_count()  # each process loads its own rows
    batches = Batches(data_dir, cfg.block_size, local_rows, seed=cfg.seed + jax.process_index())
    echo = print if jax.process_index() == 0 else (lambda *args, **kwargs: None)  # the first process prints
    meta = load_meta(data_dir / "meta.pkl")
    meta_vocab = int(meta["vocab_size"]) if meta else None
    if meta_vocab is not None:
        echo(f"found vocab_size = {meta_vocab} (inside {data_dir / 'meta.pkl'})")
    echo(f"tokens per iteration will be: {accum * world * cfg.batch_size * cfg.block_size:,}")
    run = Run(
        Path(cfg.out_dir),
        total_steps=cfg.max_iters,
        loggers=["jsonl", "wandb"] if cfg.wandb_log else ["jsonl"],
        keep_last=cfg.keep_last,
        keep_every=cfg.keep_every,
        project=cfg.wandb_project,
        name=cfg.wandb_run_name,
        shown=("loss",),
        progress=cfg.progress,
        read_every=cfg.log_interval,  # read at log and save points, as nanoGPT's loop reads its loss
    )
    with run:
        trainer = _start(cfg, run, devices, meta_vocab, echo)
        loop = _Iterations(cfg, run, trainer, batches)
        if cfg.eval_only and trainer.iter_num == 0:
            loop.top(0, trainer.train_state())
        else:
            draws = range(trainer.iter_num, cfg.max_iters + 1)  # nanoGPT's loop ends after iteration max_iters
            numbered = ((it, batches.get("train", (accum,), draw=it)) for it in draws)
            hyper = lambda it: Hyper(np.float32(get_lr(it, cfg)), np.int32(it))  # noqa: E731
            state = fit(
                run, trainer.run_step, trainer.train_state(), numbered, hyper=hyper, read=loop.read,
                before=[loop.top], after=[loop.after], draw_ahead=True,  # the batches are keyed by iteration
            )  # fmt: skip
            trainer.load(state)
        run.flush()
        return loop.last


def _start(cfg: TrainSettings, run: Run, devices, meta_vocab: int | None, echo) -> Trainer:
    """The run's Trainer (resumed: jaxport's own checkpoints first, a nanoGPT run has only ckpt.pt), announced."""
    out_dir, trainer = Path(cfg.out_dir), None
    if cfg.init_from == "resume":
        echo(f"Resuming training from {out_dir}")
        trainer = restore_trainer(run.checkpoints, lambda meta: cfg, devices, meta_vocab)
    if trainer is None:
        trainer = Trainer(cfg, vocab_size=meta_vocab, devices=devices)
    echo(f"number of parameters: {trainer.model.get_num_params() / 1e6:.2f}M")
    echo(
        f"compute dtype {jnp.dtype(trainer.dtype).name} on {trainer.mesh.devices.size} "
        f"{trainer.mesh.devices.flat[0].platform} device(s); the first step compiles"
    )
    if jax.process_index() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        meta_pkl = data_folder(cfg) / "meta.pkl"
        if meta_pkl.exists():  # so sampling from out_dir needs no data folder
            (out_dir / "meta.pkl").write_bytes(meta_pkl.read_bytes())
    run.start_logging(trainer.iter_num)
    return trainer


class _Iterations:
    """nanoGPT's work around each iteration's step: evaluation and saves at its top, the log line after it."""

    def __init__(self, cfg: TrainSettings, run: Run, trainer: Trainer, batches: Batches):
        self.cfg, self.run, self.trainer, self.batches = cfg, run, trainer, batches
        self.best_val_loss, self.last = trainer.best_val_loss, {}
        self.peak, self.kind = device_peak_flops(trainer.mesh.devices.flat[0])
        self.mfu_params = trainer.model.get_num_params()
        self.loss_scaling = trainer.dtype == jnp.float16  # float16's GradScaler skips steps whose gradients overflow
        saves = cfg.max_iters >= cfg.eval_interval or cfg.checkpoint_interval
        self.import_ahead = ImportAhead(enabled=run.is_main)
        # torch, for ckpt.pt
        self.later_imports = ["torch"] if saves and jax.process_count() == 1 and torch_available() else []
        self.warned_no_torch, self.read_out = False, None
        self.t0, self.steps_timed, self.local_iter_num, self.running_mfu = time.time(), 0, 0, -1.0

    def top(self, it: int, state: TrainState) -> None:
        """Before iteration `it`: evaluate at `eval_interval` (saving if the loss improved, or always), else save
        at `checkpoint_interval`."""
        self.trainer.load(state)
        cfg, lr = self.cfg, get_lr(it, self.cfg)
        if it % cfg.eval_interval == 0:
            losses = self.estimate_loss(it)
            self.run.write(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            for split, value in losses.items():  # checked before the save below
                self.run.check_finite(it, value, what=f"the {split} loss of the evaluation")
            self.run.log(it, {"iter": it, "train_loss": losses["train"], "val_loss": losses["val"], "lr": lr})
            self.last.update(losses)
            if losses["val"] < self.best_val_loss or cfg.always_save_checkpoint:
                self.best_val_loss = losses["val"]
                if it > 0:
                    self.save(it, lr)
        elif cfg.checkpoint_interval and it % cfg.checkpoint_interval == 0:
            self.save(it, lr)

    def estimate_loss(self, it: int) -> dict:
        out = {}
        for split in ("train", "val"):
            X, Y = self.batches.get(split, (self.cfg.eval_iters,), draw=it, purpose="eval")
            out[split] = float(np.mean(fetch_replicated(self.trainer.eval_losses(X, Y))))
        return out

    def save(self, it: int, lr: float) -> None:
        out_dir, trainer = Path(self.cfg.out_dir), self.trainer
        # the batches are keyed by iteration (see Batches), so the iteration is the data position too
        self.run.save(it, trainer.state(), trainer.checkpoint_meta(it, self.best_val_loss))
        self.run.write(f"saving checkpoint to {out_dir}")
        if jax.process_count() > 1:
            return  # ckpt.pt needs every array on one host: `jaxport gpt export` writes it on request
        if torch_available():  # nanoGPT users' ckpt.pt
            gpt_params.write_nanogpt_checkpoint(trainer, out_dir, it, self.best_val_loss, lr)
        elif not self.warned_no_torch:
            self.warned_no_torch = True
            self.run.write(
                "PyTorch is not installed, so nanoGPT's ckpt.pt is not written (jaxport's checkpoints are in "
                f"{out_dir / CHECKPOINT_SUBDIR}); `pip install 'jaxport[torch]'` and `jaxport gpt export` write it"
            )

    def read(self, it: int, metrics: dict) -> None:
        """A step's host values (read at log and save points only, in one transfer: `Run.record`): its micro-steps'
        losses were checked; stop at a non-finite gradient norm too, before any later checkpoint is written."""
        if not self.loss_scaling:
            self.run.check_finite(it, metrics["grad_norm"], what="the gradient norm")
        self.read_out = metrics

    def after(self, it: int, state: TrainState) -> None:
        """Once iteration `it` is started: at `log_interval`, its loss, time per iteration and MFU."""
        self.import_ahead(*self.later_imports)  # the step has compiled: load what the saves and the end import
        self.steps_timed += 1
        self.local_iter_num += 1
        if it % self.cfg.log_interval:
            return
        self.run.flush()
        lossf = float(self.read_out["loss"][-1])  # nanoGPT logs the last micro-step's loss
        t1 = time.time()
        # steps run asynchronously: time per iteration is averaged since the last log
        dt, self.t0, self.steps_timed = (t1 - self.t0) / self.steps_timed, t1, 0
        if self.local_iter_num > 5:  # let the compile and warm-up settle first
            accum = self.read_out["loss"].shape[0]
            mfu = estimate_mfu(self.mfu_params, self.trainer.model_config, self.cfg.batch_size * accum, dt)
            self.running_mfu = mfu if self.running_mfu == -1.0 else 0.9 * self.running_mfu + 0.1 * mfu
        peak, mfu = self.peak, self.running_mfu
        device_mfu = f", {mfu * 312e12 / peak * 100:.2f}% of {self.kind} peak" if peak and mfu > 0 else ""
        self.run.write(f"iter {it}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {mfu * 100:.2f}%{device_mfu}")
        norm = float(self.read_out["grad_norm"])
        metrics = {"iter": it, "loss": lossf, "lr": get_lr(it, self.cfg), "grad_norm": norm, "dt_ms": dt * 1000}
        self.run.log(it, {**metrics, "mfu_a100": self.running_mfu})
        self.last["loss"] = lossf
