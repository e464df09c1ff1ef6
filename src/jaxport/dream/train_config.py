"""The settings of a `jaxport dream train` run: `TrainConfig` (a command-line flag for each field), the named
recipes (`PRESETS`: settings and the data and tokenizer they prepare), `make_config`, which layers them, and
`config_and_tokenizer`, the model config and tokenizer the settings name."""

import dataclasses
from pathlib import Path

import jax

from jaxport.dream import tasks
from jaxport.dream.config import DreamConfig
from jaxport.dream.config import preset as model_preset
from jaxport.dream.tokenizer import DreamTokenizer, special_token_ids, train_tokenizer
from jaxport.errors import JaxportError


def _option(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class TrainConfig:
    """Every setting of a run (`jaxport dream train` has a flag for each: `seq_len` is `--seq-len`)."""

    data: str | None = _option(None, "training data: a text file (pretraining-style rows) or JSONL (SFT)")
    out_dir: str = _option("out-dream", "the run folder: checkpoints, metrics.jsonl, learning_curves.png")
    model: str | None = _option(None, "Hugging Face Dream directory to start from")
    config: str | None = _option(None, "or a named size to train from scratch (tiny, task, 40m, 7b); needs --tokenizer")
    tokenizer: str | None = _option(None, "tokenizer directory (default: the --model directory)")
    seq_len: int = _option(512, "tokens per row, prompt and response together (the context)")
    response_len: int | None = _option(None, "SFT: a fixed response span; prompts are left-padded before it")
    chat: bool = _option(False, 'SFT: wrap {"prompt", "completion"} lines in the chat template')
    batch_size: int = _option(8, "rows per micro-batch, over all devices")
    grad_accum: int = _option(1, "micro-batches per optimizer step")
    steps: int = _option(1000, "optimizer steps")
    lr: float = _option(1e-4, "peak learning rate")
    min_lr_ratio: float = _option(0.1, "the cosine decays to lr * min_lr_ratio")
    warmup_steps: int = _option(100, "linear warm-up steps")
    weight_decay: float = _option(0.1, "AdamW weight decay (matrices only)")
    beta1: float = _option(0.9, "AdamW beta1")
    beta2: float = _option(0.95, "AdamW beta2")
    grad_clip: float = _option(1.0, "clip the gradient's global norm to this (0: no clipping)")
    eps: float = _option(1e-3, "the masking rate t is drawn from U(eps, 1)")
    dtype: str | None = _option(
        None,
        "compute dtype, float32 or bfloat16 (default: bfloat16 on GPU/TPU, float32 "
        "on CPU); weights and AdamW moments stay float32",
    )
    mesh: str | None = _option(None, "DATA,FSDP,MODEL device mesh sizes (default: data-parallel over all devices)")
    seed: int = _option(0, "seed of the initial weights, the batch order and the masks")
    log_every: int = _option(1, "steps between metrics.jsonl lines")
    save_every: int = _option(200, "steps between checkpoints")
    keep_last: int = _option(3, "checkpoints kept")
    sample_every: int = _option(0, "steps between sample generations in the log (0: only at the end)")
    samples: int = _option(2, "prompts (of the first rows) to sample, decoded one token per step")
    sample_tokens: int = _option(128, "most new tokens per sample")
    export_dir: str | None = _option(None, "Hugging Face directory written at the end (default: OUT_DIR/hf)")
    export_dtype: str | None = _option(None, "dtype of the exported weights (default: the model's torch_dtype)")
    max_shard_size: str = _option("5GB", "exported weights above this size are split into shards")
    preset: str | None = _option(None, "a named recipe whose settings the other flags override: task-demo")


# Named recipes: settings, and a function that prepares their data and tokenizer in the run folder.
def _prepare_task_demo(cfg: TrainConfig) -> TrainConfig:
    """The synthetic-task model (`jaxport.dream.tasks`): data (no answer of `tasks.held_out_answers()`), its
    test splits, and a byte-level BPE trained on the training problems."""
    folder = Path(cfg.out_dir) / "task"
    train_path = folder / "train.jsonl"
    if not train_path.is_file() and jax.process_index() == 0:
        train = tasks.training_problems(tasks.DEMO_TRAIN_PROBLEMS, seed=cfg.seed)
        for split in tasks.SPLITS:
            tasks.write_problems(tasks.held_out_problems(train, 256, cfg.seed, split), folder / f"test_{split}.jsonl")
        train_tokenizer((text for p in train for text in (p.prompt, p.answer)), folder / "tokenizer", vocab_size=512)
        tasks.write_problems(train, train_path)  # last: its presence means the folder is complete
    return dataclasses.replace(
        cfg, data=cfg.data or str(train_path), tokenizer=cfg.tokenizer or str(folder / "tokenizer")
    )


PRESETS = {
    "task-demo": (
        dict(
            config="task",
            seq_len=144,
            response_len=128,
            batch_size=32,
            steps=3000,
            lr=2e-3,
            warmup_steps=100,
            weight_decay=0.01,
            beta2=0.99,
            save_every=250,
            sample_every=500,
            samples=4,
            out_dir="runs/dream-task-demo",
        ),
        _prepare_task_demo,
    ),
}


def make_config(preset: str | None = None, **options) -> TrainConfig:
    """A `TrainConfig`: the defaults, then the preset's settings, then `options`."""
    if preset is not None and preset not in PRESETS:
        raise JaxportError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise JaxportError(f"unknown training option(s) {unknown}; the options are {', '.join(sorted(fields))}")
    values = {**(PRESETS[preset][0] if preset else {}), **{k: v for k, v in options.items() if v is not None}}
    return TrainConfig(**values, **({"preset": preset} if preset else {}))


def config_and_tokenizer(cfg: TrainConfig) -> tuple[DreamConfig, DreamTokenizer, str]:
    """The model config, tokenizer and tokenizer directory of `--model`, or of `--config` + `--tokenizer`."""
    if bool(cfg.model) == bool(cfg.config):
        raise JaxportError(
            "give --model DIR (a Hugging Face Dream directory) or --config NAME with --tokenizer DIR, not both"
        )
    tokenizer_dir = cfg.tokenizer or cfg.model
    if tokenizer_dir is None:
        raise JaxportError(
            f"--config {cfg.config} trains from scratch and needs --tokenizer DIR "
            "(make one with `jaxport dream tokenizer`)"
        )
    if not Path(tokenizer_dir).is_dir():
        raise JaxportError(f"tokenizer directory {tokenizer_dir}: no such directory")
    if cfg.model:
        config = DreamConfig.from_model_dir(cfg.model)
    else:
        config = dataclasses.replace(
            model_preset(cfg.config), **special_token_ids(tokenizer_dir), torch_dtype="float32"
        )
    return config, DreamTokenizer.from_model_dir(tokenizer_dir, config), tokenizer_dir
