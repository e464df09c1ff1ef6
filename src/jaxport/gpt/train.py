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

import ctypes
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxport.distributed import fsdp_shardings, make_mesh, replicate, shard_batch, to_host
from jaxport.errors import JaxportError
from jaxport.gpt import params as gpt_params
from jaxport.gpt.config import GPTConfig
from jaxport.gpt.data import Batches, load_meta
from jaxport.gpt.model import GPT, device_peak_flops

# nanoGPT train.py's globals, same names and defaults (GPT-2 124M on OpenWebText).
DEFAULTS = dict(
    out_dir="out", eval_interval=2000, log_interval=1, eval_iters=200, eval_only=False,
    always_save_checkpoint=True, init_from="scratch",
    wandb_log=False, wandb_project="owt", wandb_run_name="gpt2",
    dataset="openwebtext", gradient_accumulation_steps=5 * 8, batch_size=12, block_size=1024,
    n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=False,
    learning_rate=6e-4, max_iters=600000, weight_decay=1e-1, beta1=0.9, beta2=0.95, grad_clip=1.0,
    decay_lr=True, warmup_iters=2000, lr_decay_iters=600000, min_lr=6e-5,
    backend="nccl", device="cuda", dtype="bfloat16", compile=True,
)
# jaxport's own: data root, seed, progress bar, FSDP ways (a divisor of the device count).
EXTRA = dict(data_dir="data", seed=1337, progress=True, fsdp=1)
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# torch.amp.GradScaler's defaults, which nanoGPT uses for float16
LOSS_SCALE_INIT, LOSS_SCALE_GROWTH_INTERVAL = 2.0 ** 16, 2000


def compute_dtype(dtype: str, platform: str):
    """nanoGPT autocasts only on GPUs: on the CPU it computes in float32 whatever --dtype says."""
    if dtype not in COMPUTE_DTYPES:
        raise JaxportError(f"--dtype={dtype}: use float32, bfloat16 or float16")
    return jnp.float32 if platform == "cpu" else COMPUTE_DTYPES[dtype]


def get_lr(it: int, cfg: dict) -> float:
    """Linear warmup, cosine decay to min_lr at lr_decay_iters, then min_lr (train.py's get_lr)."""
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it > cfg["lr_decay_iters"]:
        return cfg["min_lr"]
    decay_ratio = (it - cfg["warmup_iters"]) / (cfg["lr_decay_iters"] - cfg["warmup_iters"])
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return cfg["min_lr"] + coeff * (cfg["learning_rate"] - cfg["min_lr"])


def keep_freed_memory() -> None:
    """Make glibc keep freed memory in the heap instead of returning it to the OS. XLA:CPU
    frees and reallocates its large temporaries every step, and the page faults of fresh
    mmaps cost up to half the step time of a small GPT (measured ~1.5-2x on the README
    CPU config). A no-op off Linux/glibc."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    # blocks up to glibc's largest mmap threshold come from the heap, which is never trimmed;
    # bigger ones stay mmap'ed (moving those into the heap too made large configs slower)
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.mallopt(M_TOP_PAD, 64 << 20)


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
    return devices[int(device.split(":")[1]):][:1] if ":" in device else devices


def adamw(weight_decay: float, beta1: float, beta2: float, eps: float = 1e-8):
    """torch AdamW (decoupled decay p *= 1 - lr*wd, bias-corrected moments) on 2-D+ params only;
    the learning rate is a hyperparameter set every iteration."""
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(  # a callable mask is no schedule
        learning_rate=0.0, b1=beta1, b2=beta2, eps=eps, weight_decay=weight_decay,
        mask=lambda tree: jax.tree.map(lambda p: p.ndim >= 2, tree))


def initial_model(cfg: dict, vocab_size: int | None) -> tuple[GPT, gpt_params.Checkpoint | None]:
    """train.py's init_from: a new model, the run's ckpt.pt (returned too), or GPT-2 weights."""
    init_from, ckpt = cfg["init_from"], None
    if init_from == "scratch":
        model_args = dict(n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"],
                          block_size=cfg["block_size"], bias=cfg["bias"], dropout=cfg["dropout"],
                          vocab_size=vocab_size if vocab_size is not None else 50304)
        model = GPT.init(GPTConfig(**model_args), seed=cfg["seed"])
    elif init_from == "resume":  # the architecture comes from the checkpoint, dropout from the flags
        ckpt = gpt_params.load_checkpoint(Path(cfg["out_dir"]) / "ckpt.pt", dropout=cfg["dropout"])
        model = ckpt.model
    elif init_from.startswith("gpt2") or Path(init_from).is_dir():
        model = GPT.from_pretrained(init_from, dict(dropout=cfg["dropout"]))
    else:
        raise JaxportError(f"--init_from={init_from}: use scratch, resume, gpt2, gpt2-medium, gpt2-large, "
                           f"gpt2-xl or a Hugging Face GPT-2 folder")
    if cfg["block_size"] > model.config.block_size:
        raise JaxportError(f"--block_size={cfg['block_size']} is larger than the {init_from} model's "
                           f"block_size {model.config.block_size}")
    if init_from not in ("scratch", "resume") and cfg["block_size"] < model.config.block_size:
        model.crop_block_size(cfg["block_size"])
    if vocab_size is not None and vocab_size != model.config.vocab_size:
        raise JaxportError(f"the dataset's meta.pkl says vocab_size {vocab_size} but the {init_from} model "
                           f"has vocab_size {model.config.vocab_size}")
    return model, ckpt


class Trainer:
    """Model, optimizer state and the compiled steps of one run (init_from scratch/resume/gpt2*)."""

    def __init__(self, cfg: dict, vocab_size: int | None = None, devices=None):
        self.cfg = cfg
        devices = select_devices(cfg["device"]) if devices is None else devices
        fsdp = cfg.get("fsdp", 1)
        if fsdp < 1 or len(devices) % fsdp:
            raise JaxportError(f"--fsdp={fsdp} does not divide the {len(devices)} devices")
        self.mesh = make_mesh(fsdp=fsdp, devices=devices)
        self.dtype = compute_dtype(cfg["dtype"], devices[0].platform)
        # float16 needs dynamic loss scaling, as nanoGPT's GradScaler: (scale, finite steps in a row)
        self.loss_scale = (jnp.float32(LOSS_SCALE_INIT if self.dtype == jnp.float16 else 1.0), jnp.int32(0))
        model, ckpt = initial_model(cfg, vocab_size)
        self.iter_num, self.best_val_loss = (ckpt.iter_num, ckpt.best_val_loss) if ckpt else (0, 1e9)
        betas, eps, wd = (cfg["beta1"], cfg["beta2"]), 1e-8, cfg["weight_decay"]
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
        self.params = jax.device_put(params, fsdp_shardings(params, self.mesh))
        self.opt_state = jax.jit(self.optimizer.init)(self.params)
        if moments is not None:  # torch's exp_avg, exp_avg_sq and step are optax's mu, nu and count
            mu, nu, step = moments
            adam = self.adam_state()._replace(
                count=jnp.asarray(step, jnp.int32),
                mu=gpt_params.named_to_tree({k: jnp.asarray(v) for k, v in mu.items()}),
                nu=gpt_params.named_to_tree({k: jnp.asarray(v) for k, v in nu.items()}))
            self.opt_state = self.opt_state._replace(inner_state=(adam, *self.opt_state.inner_state[1:]))
        self.opt_state = jax.device_put(self.opt_state, fsdp_shardings(self.opt_state, self.mesh))
        self.loss_scale = replicate(self.loss_scale, self.mesh)
        state_shardings = jax.tree.map(lambda x: x.sharding, (self.params, self.opt_state, self.loss_scale))
        self._step = _make_train_step(self.graphdef, self.optimizer, cfg["grad_clip"], cfg["dropout"] > 0,
                                      state_shardings, loss_scaling=self.dtype == jnp.float16)
        self._eval = _make_eval_step(self.graphdef)

    @property
    def model(self) -> GPT:
        return nnx.merge(self.graphdef, self.params)

    def _shard(self, *arrays):
        """Rows ([..., B, T]) over the mesh. With several processes, `arrays` are this process's rows."""
        n = self.mesh.devices.size // jax.process_count()
        for a in arrays:
            if a.shape[-2] % n:
                raise JaxportError(f"batch of {a.shape[-2]} rows is not divisible by the {n} devices of the mesh")
        return shard_batch([np.asarray(a, np.int32) for a in arrays], self.mesh, batch_dim=-2)

    def step(self, X, Y, lr: float, rng=None):
        """One iteration on micro-batches X, Y [accum, B, T]: returns (micro losses, grad norm)
        as device arrays (reading them waits for the step)."""
        X, Y = self._shard(X, Y)
        rng = jax.random.key(self.cfg["seed"]) if rng is None else rng
        self.params, self.opt_state, self.loss_scale, losses, norm = self._step(
            self.params, self.opt_state, self.loss_scale, X, Y, jnp.float32(lr), rng)
        return losses, norm

    def eval_loss(self, X, Y):
        return self._eval(self.params, *self._shard(X, Y))

    def adam_state(self) -> optax.ScaleByAdamState:
        is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
        return next(x for x in jax.tree.leaves(self.opt_state, is_leaf=is_adam) if is_adam(x))

    def checkpoint(self, iter_num: int, best_val_loss: float, lr: float) -> dict:
        """The dict nanoGPT's train.py saves as ckpt.pt."""
        adam = self.adam_state()
        params, mu, nu, step = host_copy((self.params, adam.mu, adam.nu, adam.count))
        cfg = self.model_config
        model_sd = {k: np.asarray(v, np.float32) for k, v in gpt_params.tree_to_named(params, cfg).items()}
        model_sd["lm_head.weight"] = model_sd["transformer.wte.weight"]
        optimizer = gpt_params.torch_adamw_state_dict(
            gpt_params.tree_to_named(mu, cfg), gpt_params.tree_to_named(nu, cfg), int(step), cfg, lr,
            self.betas, self.eps, self.weight_decay)
        return {"model": model_sd, "optimizer": optimizer, "model_args": cfg.to_model_args(),
                "iter_num": int(iter_num), "best_val_loss": np.asarray(best_val_loss, np.float32),
                "config": dict(self.cfg)}


def host_copy(tree):
    """Numpy copies of (possibly sharded, possibly multi-host) arrays; every process must call it."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


def _make_train_step(graphdef, optimizer, grad_clip: float, dropout: bool, state_shardings, loss_scaling: bool):
    def loss_fn(params, x, y, rng):
        return nnx.merge(graphdef, params).forward(x, y, rng if dropout else None)[1]

    # outputs keep the inputs' shardings, so the next call reuses this compilation
    @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=(*state_shardings, None, None))
    def step(params, opt_state, loss_scale, X, Y, lr, rng):
        accum = X.shape[0]
        scale, good_steps = loss_scale

        def micro(grads, inputs):
            x, y, key = inputs

            def scaled_loss(p):  # the gradients of loss / accum add up to the mean's, as in nanoGPT
                loss = loss_fn(p, x, y, key)
                return loss / accum * scale, loss

            (_, loss), g = jax.value_and_grad(scaled_loss, has_aux=True)(params)
            return jax.tree.map(jnp.add, grads, g), loss

        grads0 = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(micro, grads0, (X, Y, jax.random.split(rng, accum)))
        if loss_scaling:
            grads = jax.tree.map(lambda g: g / scale, grads)
        norm = optax.tree.norm(grads)
        if grad_clip != 0.0:  # torch's clip_grad_norm_: scale by min(1, clip / (norm + 1e-6))
            clip = jnp.minimum(1.0, grad_clip / (norm + 1e-6))
            grads = jax.tree.map(lambda g: g * clip, grads)
        opt_state.hyperparams["learning_rate"] = lr
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if loss_scaling:  # GradScaler: skip steps with inf/nan gradients and halve the scale; grow it
            finite = jnp.isfinite(norm)  # after LOSS_SCALE_GROWTH_INTERVAL finite steps in a row
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
            new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
            grown = good_steps + 1 == LOSS_SCALE_GROWTH_INTERVAL
            scale = jnp.where(finite, jnp.where(grown, scale * 2, scale), scale / 2)
            good_steps = jnp.where(finite & ~grown, good_steps + 1, 0)
        return new_params, new_opt_state, (scale, good_steps), losses, norm

    return step


def _make_eval_step(graphdef):
    @jax.jit
    def evaluate(params, X, Y):
        return nnx.merge(graphdef, params).forward(X, Y)[1]
    return evaluate


# -- the training loop -------------------------------------------------------------------------

def data_folder(cfg: dict) -> Path:
    return Path(cfg["data_dir"]) / cfg["dataset"]


def train(cfg: dict) -> dict:
    """`jaxport gpt train`: nanoGPT's loop. Returns the last losses."""
    from tqdm import tqdm
    from jaxport.distributed import initialize
    initialize()  # several hosts only when the environment says so
    devices = select_devices(cfg["device"])
    # nanoGPT's DDP rule: batch_size is per device and the accumulation steps are shared out
    world, accum = len(devices), cfg["gradient_accumulation_steps"]
    if accum % world:
        raise JaxportError(f"gradient_accumulation_steps={accum} must be a multiple of the {world} devices "
                           f"(each device takes batch_size={cfg['batch_size']} per micro-step)")
    accum //= world
    data_dir = data_folder(cfg)
    local_rows = cfg["batch_size"] * world // jax.process_count()  # each process loads its own rows
    batches = Batches(data_dir, cfg["block_size"], local_rows, seed=cfg["seed"] + jax.process_index())
    master = jax.process_index() == 0  # the one that prints and writes files
    echo = print if master else (lambda *args, **kwargs: None)
    meta = load_meta(data_dir / "meta.pkl")
    meta_vocab = int(meta["vocab_size"]) if meta else None
    if meta_vocab is not None:
        echo(f"found vocab_size = {meta_vocab} (inside {data_dir / 'meta.pkl'})")
    out_dir = Path(cfg["out_dir"])
    echo(f"tokens per iteration will be: {accum * world * cfg['batch_size'] * cfg['block_size']:,}")
    if cfg["init_from"] == "resume":
        echo(f"Resuming training from {out_dir}")
    trainer = Trainer(cfg, vocab_size=meta_vocab, devices=devices)
    if trainer.mesh.devices.flat[0].platform == "cpu":
        keep_freed_memory()  # process-wide, so only for runs, not for library users of Trainer
    model = trainer.model
    echo(f"number of parameters: {model.get_num_params() / 1e6:.2f}M")
    echo(f"compute dtype {jnp.dtype(trainer.dtype).name} on {trainer.mesh.devices.size} "
          f"{trainer.mesh.devices.flat[0].platform} device(s); the first step compiles")
    peak, kind = device_peak_flops(trainer.mesh.devices.flat[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    if meta is not None and master:  # so sampling from out_dir needs no data folder
        (out_dir / "meta.pkl").write_bytes((data_dir / "meta.pkl").read_bytes())
    wandb = None
    if cfg["wandb_log"] and master:
        try:
            import wandb
            wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"], config=cfg)
        except ImportError:
            echo("wandb_log=True but wandb is not installed (pip install wandb); metrics go to metrics.jsonl only")
    metrics = open(out_dir / "metrics.jsonl", "a") if master else None

    def log(record):
        if metrics is None:
            return
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        if wandb is not None:
            wandb.log(record)

    def estimate_loss():
        out = {}
        for split in ("train", "val"):
            X, Y = batches.get(split, (cfg["eval_iters"],))
            losses = [trainer.eval_loss(X[k], Y[k]) for k in range(cfg["eval_iters"])]  # dispatched, then read
            out[split] = float(np.mean([to_host(loss) for loss in losses]))
        return out

    iter_num, best_val_loss = trainer.iter_num, trainer.best_val_loss
    X, Y = batches.get("train", (accum,))
    t0, steps_timed, local_iter_num, running_mfu, last = time.time(), 0, 0, -1.0, {}
    bar = tqdm(total=cfg["max_iters"], initial=iter_num, disable=not (cfg["progress"] and master),
               dynamic_ncols=True)
    say = bar.write if cfg["progress"] and master else echo
    base_key = jax.random.key(cfg["seed"])
    while True:
        lr = get_lr(iter_num, cfg) if cfg["decay_lr"] else cfg["learning_rate"]
        if iter_num % cfg["eval_interval"] == 0:
            losses = estimate_loss()
            say(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            log({"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"], "lr": lr})
            last.update(losses)
            if losses["val"] < best_val_loss or cfg["always_save_checkpoint"]:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    say(f"saving checkpoint to {out_dir}")
                    from jaxport.checkpoint import save_torch_file
                    ckpt = trainer.checkpoint(iter_num, best_val_loss, lr)  # a collective: every process
                    if master:
                        save_torch_file(ckpt, out_dir / "ckpt.pt")
        if iter_num == 0 and cfg["eval_only"]:
            break
        micro_losses, norm = trainer.step(X, Y, lr, jax.random.fold_in(base_key, iter_num))
        X, Y = batches.get("train", (accum,))  # prepared while the step runs
        steps_timed += 1
        if iter_num % cfg["log_interval"] == 0:
            lossf = float(to_host(micro_losses)[-1])  # waits for the step; nanoGPT logs the last micro-step's loss
            t1 = time.time()
            # steps run asynchronously: time per iteration is averaged since the last log
            dt, t0, steps_timed = (t1 - t0) / steps_timed, t1, 0
            if local_iter_num >= 5:  # let the compile and warm-up settle first
                mfu = model.estimate_mfu(cfg["batch_size"] * accum, dt)  # per device, as nanoGPT's
                running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
            device_mfu = (f", {running_mfu * 312e12 / peak * 100:.2f}% of {kind} peak" if peak and running_mfu > 0
                          else "")
            say(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {running_mfu * 100:.2f}%{device_mfu}")
            log({"iter": iter_num, "loss": lossf, "lr": lr, "grad_norm": float(to_host(norm)), "dt_ms": dt * 1000,
                 "mfu_a100": running_mfu})
            last["loss"] = lossf
        iter_num += 1
        local_iter_num += 1
        bar.update(1)
        if iter_num > cfg["max_iters"]:
            break
    bar.close()
    if metrics is not None:
        metrics.close()
    return last
