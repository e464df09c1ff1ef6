"""`jaxport gpt train`'s settings: nanoGPT train.py's flags and jaxport's own, typed, and what follows from them
alone (the learning rate schedule, the scratch model's sizes, the micro-steps per iteration, the data folder)."""

from __future__ import annotations

from pathlib import Path

import pydantic

from jaxport.errors import JaxportError
from jaxport.gpt.config import GPTConfig
from jaxport.training.schedules import nanogpt_lr
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


def get_lr(it: int, cfg: TrainSettings | dict) -> float:
    """The learning rate of iteration `it`: nanoGPT's `get_lr` with --decay_lr, else --learning_rate."""
    cfg = train_settings(cfg)
    if not cfg.decay_lr:
        return cfg.learning_rate
    return nanogpt_lr(
        it, learning_rate=cfg.learning_rate, warmup_iters=cfg.warmup_iters, lr_decay_iters=cfg.lr_decay_iters,
        min_lr=cfg.min_lr,
    )  # fmt: skip


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


def data_folder(cfg: TrainSettings | dict) -> Path:
    cfg = train_settings(cfg)
    return Path(cfg.data_dir) / cfg.dataset
