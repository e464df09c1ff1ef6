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

import collections
import contextlib
import functools
import importlib
import math
import threading
import time
from pathlib import Path

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
from jaxport.distributed import (
    fetch_replicated,
    gather_to_host,
    logical_sharding,
    make_mesh,
    replicate,
    shard_batch,
    tree_shardings,
)
from jaxport.dtypes import float_dtype
from jaxport.errors import JaxportError
from jaxport.gpt import params as gpt_params
from jaxport.gpt.config import GPTConfig
from jaxport.gpt.data import Batches, load_meta
from jaxport.gpt.model import GPT, Checkpoint, estimate_mfu, load_checkpoint
from jaxport.runtime.compile_for import abstract
from jaxport.runtime.topologies import device_peak_flops
from jaxport.training.metrics_log import pyplot
from jaxport.training.optimizers import moment_shardings
from jaxport.training.run import CHECKPOINT_SUBDIR, Run, restore_params, run_checkpoints
from jaxport.training.step import (  # noqa: F401 (LOSS_SCALE_GROWTH_INTERVAL: GPT's public name)
    LOSS_SCALE_GROWTH_INTERVAL,
    accumulate_gradients,
    clip_by_global_norm,
    decay_mask,
    initial_loss_scale,
    next_loss_scale,
    skip_unless_finite,
)
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
# torch.amp.GradScaler's defaults, which nanoGPT uses for float16
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
    """Linear warmup, cosine decay to min_lr at lr_decay_iters, then min_lr (train.py's get_lr)."""
    cfg = train_settings(cfg)
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    decay_ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


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


class Trainer:
    """Model, optimizer state and the compiled steps of one run (init_from scratch/resume/gpt2*)."""

    def __init__(
        self, cfg: TrainSettings | dict, vocab_size: int | None = None, devices=None, resume_meta: dict | None = None
    ):
        """`resume_meta`: the meta of a jaxport run's orbax checkpoint, whose state `load_state` restores."""
        self.cfg = cfg = train_settings(cfg)
        devices = select_devices(cfg.device) if devices is None else devices
        fsdp = cfg.fsdp
        if fsdp < 1 or len(devices) % fsdp:
            raise JaxportError(f"--fsdp={fsdp} does not divide the {len(devices)} devices")
        self.mesh = make_mesh(fsdp=fsdp, devices=devices)
        self.dtype = compute_dtype(cfg.dtype, devices[0].platform)
        # float16 needs dynamic loss scaling, as nanoGPT's GradScaler: (scale, finite steps in a row)
        self.loss_scale = initial_loss_scale(self.dtype == jnp.float16)
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
        if moments is not None:  # torch's exp_avg, exp_avg_sq and step are optax's mu, nu and count
            mu, nu, step = moments
            adam = self.adam_state()._replace(
                count=jnp.asarray(step, jnp.int32),
                mu=gpt_params.named_to_tree({k: jnp.asarray(v) for k, v in mu.items()}),
                nu=gpt_params.named_to_tree({k: jnp.asarray(v) for k, v in nu.items()}),
            )
            self.opt_state = self.opt_state._replace(inner_state=(adam, *self.opt_state.inner_state[1:]))
        self.opt_state = jax.device_put(
            self.opt_state, moment_shardings(self.optimizer, self.opt_state, param_shardings, self.mesh)
        )
        self.loss_scale = replicate(self.loss_scale, self.mesh)
        state_shardings = jax.tree.map(lambda x: x.sharding, (self.params, self.opt_state, self.loss_scale))
        # batch_size is per device (nanoGPT's DDP rule)
        self.runtime = runtime.for_devices(self.mesh).for_program(self.dtype, cfg.batch_size * cfg.block_size)
        self._step = _make_train_step(
            self.graphdef,
            self.optimizer,
            cfg.grad_clip,
            cfg.dropout > 0,
            state_shardings,
            loss_scaling=self.dtype == jnp.float16,
            step_runtime=self.runtime,
            seed=cfg.seed,
        )
        self._eval = _make_eval_step(self.graphdef, self.runtime, self.mesh)

    @property
    def compiler_options(self) -> dict | None:
        """The XLA options the step and the evaluation compile with (`runtime`)."""
        return self.runtime.compiler_options

    @property
    def model(self) -> GPT:
        return nnx.merge(self.graphdef, self.params)

    # -- the run's own (orbax) checkpoints: the whole train state, sharded as it lives on the devices
    def state(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state, "loss_scale": self.loss_scale}

    def load_state(self, state: dict) -> None:
        self.params, self.opt_state, self.loss_scale = state["params"], state["opt_state"], state["loss_scale"]

    def checkpoint_meta(self, iter_num: int, best_val_loss: float) -> dict:
        """What resuming needs beside the arrays (JSON)."""
        return {
            "iter_num": int(iter_num),
            "best_val_loss": float(best_val_loss),
            "model_args": self.model_config.to_model_args(),
            "config": self.cfg.as_dict(),
            "adamw": [list(self.betas), self.eps, self.weight_decay],
        }

    def _shard(self, *arrays):
        """Rows ([..., B, T]) over the mesh. With several processes, `arrays` are this process's rows."""
        n = self.mesh.devices.size // jax.process_count()
        for a in arrays:
            if a.shape[-2] % n:
                raise JaxportError(f"batch of {a.shape[-2]} rows is not divisible by the {n} devices of the mesh")
        return shard_batch([np.asarray(a, np.int32) for a in arrays], self.mesh, batch_dim=-2)

    def step(self, X, Y, lr: float, draw: int = 0):
        """One iteration on micro-batches X, Y [accum, B, T] with the dropout key of iteration `draw`: returns
        (micro losses, grad norm) as device arrays (reading them waits for the step). The arguments go in as
        numpy values: an eager `jnp` conversion or key would wait for the step before it."""
        args = self.step_args(X, Y, lr, draw)
        self.params, self.opt_state, self.loss_scale, losses, norm = self._step(*args)
        return losses, norm

    def step_args(self, X, Y, lr: float, draw: int = 0) -> tuple:
        """The compiled step's arguments for `step(X, Y, lr, draw)`."""
        return (self.params, self.opt_state, self.loss_scale, *self._shard(X, Y), np.float32(lr), np.int32(draw))

    def eval_losses(self, X, Y):
        """The losses of batches X, Y [n, B, T] (device array, one per batch)."""
        return self._eval(self.params, *self._shard(X, Y))

    def adam_state(self) -> optax.ScaleByAdamState:
        is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
        return next(x for x in jax.tree.leaves(self.opt_state, is_leaf=is_adam) if is_adam(x))

    def checkpoint(self, iter_num: int, best_val_loss: float, lr: float) -> dict:
        """The dict nanoGPT's train.py saves as ckpt.pt."""
        adam = self.adam_state()
        params, mu, nu, step = gather_to_host((self.params, adam.mu, adam.nu, adam.count))
        cfg = self.model_config
        # an OrderedDict, as nanoGPT's model.state_dict() is
        model_sd = collections.OrderedDict(
            (k, np.asarray(v, np.float32)) for k, v in gpt_params.tree_to_named(params, cfg).items()
        )
        model_sd["lm_head.weight"] = model_sd["transformer.wte.weight"]
        optimizer = gpt_params.torch_adamw_state_dict(
            gpt_params.tree_to_named(mu, cfg),
            gpt_params.tree_to_named(nu, cfg),
            int(step),
            cfg,
            lr,
            self.betas,
            self.eps,
            self.weight_decay,
        )
        return {
            "model": model_sd,
            "optimizer": optimizer,
            "model_args": cfg.to_model_args(),
            "iter_num": int(iter_num),
            "best_val_loss": np.asarray(best_val_loss, np.float32),
            "config": self.cfg.as_dict(),
        }


def _make_train_step(
    graphdef, optimizer, grad_clip: float, dropout: bool, state_shardings, loss_scaling: bool, step_runtime, seed
):
    mesh = jax.tree.leaves(state_shardings)[0].mesh

    def loss_fn(params, x, y, rng):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the model places its activations on it
            return nnx.merge(graphdef, params).forward(x, y, rng if dropout else None)[1]

    # outputs keep the inputs' shardings, so the next call reuses this compilation
    @functools.partial(
        runtime.jit_training_step,
        runtime=step_runtime,
        donate_argnums=(0, 1),
        out_shardings=(*state_shardings, None, None),
    )
    def step(params, opt_state, loss_scale, X, Y, lr, draw):
        # the dropout key of iteration `draw`, made here: made on the host, it waited for the step before it
        rng = jax.random.fold_in(jax.random.key(seed), draw)
        accum = X.shape[0]
        scale = loss_scale[0]

        def objective(p, xy, key):  # the gradients of loss / accum add up to the mean's, as in nanoGPT
            loss = loss_fn(p, *xy, key)
            return loss / accum * scale, loss

        grads, losses = accumulate_gradients(objective, params, (X, Y), jax.random.split(rng, accum))
        if loss_scaling:
            grads = jax.tree.map(lambda g: g / scale, grads)
        grads, norm = clip_by_global_norm(grads, grad_clip)
        opt_state.hyperparams["learning_rate"] = lr
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if loss_scaling:  # GradScaler: skip steps with inf/nan gradients, halve or grow the scale
            finite = jnp.isfinite(norm)
            new_params = skip_unless_finite(finite, new_params, params)
            new_opt_state = skip_unless_finite(finite, new_opt_state, opt_state)
            loss_scale = next_loss_scale(loss_scale, finite)
        return new_params, new_opt_state, loss_scale, losses, norm

    return step


def _make_eval_step(graphdef, step_runtime, mesh):
    @functools.partial(runtime.jit, runtime=step_runtime)
    def evaluate(params, X_NBT, Y_NBT):  # all N batches in one compiled call, one batch at a time
        model = nnx.merge(graphdef, params)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the model places its activations on it
            return jax.lax.map(lambda xy: model.forward(*xy)[1], (X_NBT, Y_NBT))

    return evaluate


# -- the training loop -------------------------------------------------------------------------


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


def compile_target(cfg: TrainSettings | dict, devices, vocab_size: int | None = None) -> tuple:
    """`(step, abstract arguments, mesh)`: the iteration `Trainer.step` runs for `cfg` on `devices`, with shapes and
    shardings in place of weights and batches (`jaxport gpt train --compile-for`). The model comes from the flags'
    sizes (init_from=scratch) or a GPT-2 name's."""
    cfg = train_settings(cfg)
    world, fsdp = len(devices), cfg.fsdp
    accum = micro_steps(cfg, world)
    if fsdp < 1 or world % fsdp:
        raise JaxportError(f"--fsdp={fsdp} does not divide the {world} devices")
    mesh = make_mesh(fsdp=fsdp, devices=devices)
    dtype = compute_dtype(cfg.dtype, devices[0].platform)
    init_from = cfg.init_from
    if init_from in gpt_params.GPT2_SIZES:  # GPT-2's own block (cropped as initial_model does), vocabulary, biases
        config = GPTConfig(
            **gpt_params.GPT2_SIZES[init_from], block_size=cfg.block_size, vocab_size=50257, dropout=cfg.dropout
        )
    elif init_from == "scratch":
        config = scratch_config(cfg, vocab_size)
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
    state_shardings = (
        param_shardings,
        moment_shardings(optimizer, opt_state, param_shardings, mesh),
        (replicated, replicated),
    )
    loss_scale = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    state = abstract((params, opt_state, loss_scale), state_shardings)
    rows = logical_sharding(mesh, None, "batch", None)  # as shard_batch places [accum, B, T] micro-batches
    batch = jax.ShapeDtypeStruct((accum, cfg.batch_size * world, cfg.block_size), jnp.int32, sharding=rows)
    step = _make_train_step(
        graphdef,
        optimizer,
        cfg.grad_clip,
        cfg.dropout > 0,
        state_shardings,
        loss_scaling=dtype == jnp.float16,
        step_runtime=runtime.for_devices(mesh).for_program(dtype, cfg.batch_size * cfg.block_size),
        seed=cfg.seed,
    )
    scalars = [jax.ShapeDtypeStruct((), t, sharding=replicated) for t in (jnp.float32, jnp.int32)]
    return step, (*state, batch, batch, *scalars), mesh


def data_folder(cfg: TrainSettings | dict) -> Path:
    cfg = train_settings(cfg)
    return Path(cfg.data_dir) / cfg.dataset


def write_nanogpt_checkpoint(trainer: Trainer, out_dir: Path, iter_num: int, best_val_loss: float, lr: float) -> None:
    """nanoGPT's ckpt.pt (every array gathered to one host), written atomically by process 0."""
    from jaxport.checkpoint import save_torch_file

    ckpt = trainer.checkpoint(iter_num, best_val_loss, lr)  # a collective: every process
    if jax.process_index() == 0:
        save_torch_file(ckpt, out_dir / "ckpt.pt")


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
    cfg = trainer.cfg
    lr = get_lr(trainer.iter_num, cfg) if cfg.decay_lr else cfg.learning_rate
    write_nanogpt_checkpoint(trainer, out_dir, trainer.iter_num, trainer.best_val_loss, lr)
    return out_dir / "ckpt.pt"


class ImportAhead:
    """Imports on a thread what the run needs later, so that its first save and its close do not wait for it:
    matplotlib (the learning curves drawn at close) and the modules named (torch, for nanoGPT's ckpt.pt).

    Called once the first step has compiled: while a step is traced the import's Python holds the GIL the tracer
    needs, while a compiled step runs without it (docs/performance.md, "Host work around the README run's steps").
    Calls after the first do nothing, so the loop calls it after every step. A module that fails to import fails
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


def train(cfg: TrainSettings | dict) -> dict:
    """`jaxport gpt train`: nanoGPT's loop. Returns the last losses.

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
    master = jax.process_index() == 0  # the one that prints and writes files
    echo = print if master else (lambda *args, **kwargs: None)
    meta = load_meta(data_dir / "meta.pkl")
    meta_vocab = int(meta["vocab_size"]) if meta else None
    if meta_vocab is not None:
        echo(f"found vocab_size = {meta_vocab} (inside {data_dir / 'meta.pkl'})")
    out_dir = Path(cfg.out_dir)
    echo(f"tokens per iteration will be: {accum * world * cfg.batch_size * cfg.block_size:,}")
    loggers = ["jsonl", "wandb"] if cfg.wandb_log else ["jsonl"]
    run = Run(
        out_dir,
        total_steps=cfg.max_iters,
        loggers=loggers,
        keep_last=cfg.keep_last,
        keep_every=cfg.keep_every,
        project=cfg.wandb_project,
        name=cfg.wandb_run_name,
        shown=("loss",),
        progress=cfg.progress,
        read_every=cfg.log_interval,  # read at log and save points, as nanoGPT's loop reads its loss
    )
    with run:
        return _train_loop(cfg, run, batches, devices, meta_vocab, accum, echo)


def _train_loop(cfg, run, batches, devices, meta_vocab, accum, echo) -> dict:
    out_dir, master = Path(cfg.out_dir), jax.process_index() == 0
    trainer = None
    if cfg.init_from == "resume":
        echo(f"Resuming training from {out_dir}")
        # jaxport's own checkpoints first; a nanoGPT run has only ckpt.pt
        trainer = restore_trainer(run.checkpoints, lambda meta: cfg, devices, meta_vocab)
    if trainer is None:
        trainer = Trainer(cfg, vocab_size=meta_vocab, devices=devices)
    model = trainer.model
    echo(f"number of parameters: {model.get_num_params() / 1e6:.2f}M")
    echo(
        f"compute dtype {jnp.dtype(trainer.dtype).name} on {trainer.mesh.devices.size} "
        f"{trainer.mesh.devices.flat[0].platform} device(s); the first step compiles"
    )
    peak, kind = device_peak_flops(trainer.mesh.devices.flat[0])
    mfu_params = model.get_num_params()
    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        meta_pkl = data_folder(cfg) / "meta.pkl"
        if meta_pkl.exists():  # so sampling from out_dir needs no data folder
            (out_dir / "meta.pkl").write_bytes(meta_pkl.read_bytes())
    iter_num, best_val_loss = trainer.iter_num, trainer.best_val_loss
    run.start_logging(iter_num)
    say = run.write

    def estimate_loss():
        out = {}
        for split in ("train", "val"):
            X, Y = batches.get(split, (cfg.eval_iters,), draw=iter_num, purpose="eval")
            out[split] = float(np.mean(fetch_replicated(trainer.eval_losses(X, Y))))
        return out

    loss_scaling = trainer.dtype == jnp.float16  # float16's GradScaler skips steps whose gradients overflow

    def check_step(it, outputs):
        """Stop at the first non-finite loss or gradient norm, before any later checkpoint is written (read at
        log and save points only, in one transfer: `Run.record`)."""
        losses, norm = outputs
        run.check_finite(it, losses)  # every micro-step's
        if not loss_scaling:
            run.check_finite(it, norm, what="the gradient norm")

    warned_no_torch = []

    def save(lr):
        # the batches are keyed by iteration (see Batches), so iter_num is the data position too
        run.save(iter_num, trainer.state(), trainer.checkpoint_meta(iter_num, best_val_loss))
        say(f"saving checkpoint to {out_dir}")
        if jax.process_count() > 1:
            return  # ckpt.pt needs every array on one host: `jaxport gpt export` writes it on request
        if torch_available():  # nanoGPT users' ckpt.pt
            write_nanogpt_checkpoint(trainer, out_dir, iter_num, best_val_loss, lr)
        elif not warned_no_torch:
            warned_no_torch.append(True)
            say(
                "PyTorch is not installed, so nanoGPT's ckpt.pt is not written (jaxport's checkpoints are in "
                f"{out_dir / CHECKPOINT_SUBDIR}); `pip install 'jaxport[torch]'` and `jaxport gpt export` write it"
            )

    saves = cfg.max_iters >= cfg.eval_interval or cfg.checkpoint_interval
    import_ahead = ImportAhead(enabled=master)
    later_imports = ["torch"] if saves and jax.process_count() == 1 and torch_available() else []  # for ckpt.pt
    X, Y = batches.get("train", (accum,), draw=iter_num)
    t0, steps_timed, local_iter_num, running_mfu, last = time.time(), 0, 0, -1.0, {}
    interval = cfg.checkpoint_interval
    while True:
        lr = get_lr(iter_num, cfg) if cfg.decay_lr else cfg.learning_rate
        if iter_num % cfg.eval_interval == 0:
            losses = estimate_loss()
            say(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            for split, value in losses.items():  # checked before the save below
                run.check_finite(iter_num, value, what=f"the {split} loss of the evaluation")
            run.log(iter_num, {"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"], "lr": lr})
            last.update(losses)
            if losses["val"] < best_val_loss or cfg.always_save_checkpoint:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    save(lr)
        elif interval and iter_num % interval == 0:
            save(lr)
        if iter_num == 0 and cfg.eval_only:
            break
        micro_losses, norm = trainer.step(X, Y, lr, iter_num)
        import_ahead(*later_imports)  # the step has compiled: load what the saves and the end import
        run.record(iter_num, (micro_losses, norm), check_step)
        X, Y = batches.get("train", (accum,), draw=iter_num + 1)  # drawn while the step runs (an accelerator's)
        steps_timed += 1
        if iter_num % cfg.log_interval == 0:
            run.flush()
            lossf = float(fetch_replicated(micro_losses)[-1])  # nanoGPT logs the last micro-step's loss
            t1 = time.time()
            # steps run asynchronously: time per iteration is averaged since the last log
            dt, t0, steps_timed = (t1 - t0) / steps_timed, t1, 0
            if local_iter_num >= 5:  # let the compile and warm-up settle first
                mfu = estimate_mfu(mfu_params, trainer.model_config, cfg.batch_size * accum, dt)
                running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
            device_mfu = (
                f", {running_mfu * 312e12 / peak * 100:.2f}% of {kind} peak" if peak and running_mfu > 0 else ""
            )
            say(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {running_mfu * 100:.2f}%{device_mfu}")
            run.log(
                iter_num,
                {
                    "iter": iter_num,
                    "loss": lossf,
                    "lr": lr,
                    "grad_norm": float(fetch_replicated(norm)),
                    "dt_ms": dt * 1000,
                    "mfu_a100": running_mfu,
                },
            )
            last["loss"] = lossf
        iter_num += 1
        local_iter_num += 1
        if iter_num > cfg.max_iters:
            break
    run.flush()
    return last
