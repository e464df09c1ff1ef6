"""`jaxport gpt train`: nanoGPT's train.py loop on `jaxport.training.loop.fit`, same flags, same checkpoints, and
`jaxport gpt export`. The settings are in `jaxport.gpt.settings`, the state and the jitted step in
`jaxport.gpt.trainer`.

Several hosts (`jaxport.distributed.initialize`: JAXPORT_COORDINATOR, ... or SLURM/TPU auto-detection) each load
their own rows (seed + process index, nanoGPT's seed_offset) and the first process writes the checkpoint and logs.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxport.checkpoint import torch_available
from jaxport.distributed import fetch_replicated
from jaxport.errors import JaxportError
from jaxport.gpt import params as gpt_params
from jaxport.gpt.data import Batches, load_meta
from jaxport.gpt.model import estimate_mfu
from jaxport.gpt.settings import DEFAULTS, EXTRA, TrainSettings, data_folder, get_lr, micro_steps, train_settings
from jaxport.gpt.trainer import Hyper, Trainer, TrainState, restore_trainer, select_devices
from jaxport.runtime.topologies import device_peak_flops
from jaxport.training.loop import ImportAhead, fit
from jaxport.training.run import CHECKPOINT_SUBDIR, Run, run_checkpoints


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
