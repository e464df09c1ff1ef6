"""`jaxport dream train`: masked-diffusion training of Dream, from a Hugging Face directory or from scratch.

Reads like nanoGPT's train.py: a config (`jaxport.dream.train_config`), the data as fixed-length token rows, one
compiled step (scan over micro-batches, clip, AdamW), and the loop, whose run folder (config snapshot, progress
bar, `metrics.jsonl`, `learning_curves.png`, orbax checkpoints, resume, NaN stop) is a
`jaxport.training.run.Run`. At the end the weights are written as a Hugging Face directory.

Master weights and AdamW moments are float32; the forward and backward pass run in `dtype`
(bfloat16 by default on GPU/TPU, float32 on CPU) on a copy of the weights cast inside the step.
The weights keep the shardings generation uses (`params.param_sharding`: tensor parallel over
`model`, FSDP over `fsdp`) and the rows are split over `data` and `fsdp`.
"""

import dataclasses
import functools
import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxport import runtime
from jaxport.checkpoint.runs import abstract_like
from jaxport.distributed import fetch_replicated, logical_sharding, make_mesh, parse_mesh, shard_batch
from jaxport.dream.data import Batches, Rows, load_rows
from jaxport.dream.decoding import diffusion_generate
from jaxport.dream.params import (
    abstract_model,
    load_model,
    placed_abstract_model,
    random_model,
    resolve_dtype,
    save_pretrained,
)
from jaxport.dream.tokenizer import DreamTokenizer, copy_tokenizer_files
from jaxport.dream.train_config import PRESETS, TrainConfig, config_and_tokenizer, make_config
from jaxport.errors import JaxportError
from jaxport.nn import softmax_cross_entropy
from jaxport.training.loop import every, fit
from jaxport.training.optimizers import moment_shardings
from jaxport.training.run import Run
from jaxport.training.step import accumulate_gradients, clip_by_global_norm, decay_mask

# ----- the objective


def mask_response(key, input_ids_BL, response_BL, eps: float, mask_token_id: int):
    """Dream's forward process: per sequence t ~ U(eps, 1), each response token masked with probability t.
    Returns (noisy ids, masked positions, t)."""
    B, L = input_ids_BL.shape
    t_key, mask_key = jax.random.split(key)
    t_B = jax.random.uniform(t_key, (B,), minval=eps, maxval=1.0)
    masked_BL = response_BL & (jax.random.uniform(mask_key, (B, L)) < t_B[:, None])
    return jnp.where(masked_BL, mask_token_id, input_ids_BL), masked_BL, t_B


def masked_diffusion_loss(logits_BLV, target_BL, masked_BL, response_BL, t_B):
    """Cross-entropy at the masked positions, weighted by 1/t and divided by the number of response
    tokens of each sequence, averaged over the sequences.

    Logits are shifted by one position as Dream predicts: the token at `j` is scored by the logits at
    `j - 1` (position 0 by its own). Dividing each sequence's sum by its response length is the
    normalisation LLaDA gives for SFT (Nie et al. 2025, "Large Language Diffusion Models", Eq. 5 and
    its guidelines), which makes the loss an unbiased estimate of the per-token negative ELBO; for
    pretraining rows every token is a response token.
    """
    shifted_BLV = jnp.concatenate([logits_BLV[:, :1], logits_BLV[:, :-1]], axis=1).astype(jnp.float32)
    ce_BL = softmax_cross_entropy(shifted_BLV, target_BL)
    per_sequence_B = jnp.sum(jnp.where(masked_BL, ce_BL, 0.0), axis=1) / t_B
    return jnp.mean(per_sequence_B / jnp.maximum(jnp.sum(response_BL, axis=1), 1))


def diffusion_loss(model, batch: dict, key, eps: float):
    """The objective on one batch `{input_ids, attention_mask, response_mask}` of `[B, L]` arrays."""
    noisy_BL, masked_BL, t_B = mask_response(
        key, batch["input_ids"], batch["response_mask"], eps, model.config.mask_token_id
    )
    logits_BLV = model.forward(noisy_BL, batch["attention_mask"])
    return masked_diffusion_loss(logits_BLV, batch["input_ids"], masked_BL, batch["response_mask"], t_B)


# ----- the step


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


class Hyper(NamedTuple):
    """What the host gives a step: the random key of its masks (the learning rate is the optimizer's schedule)."""

    key: jax.Array


def optimizer(cfg: TrainConfig):
    """AdamW (decay on matrices only) with linear warm-up and cosine decay; the step clips the gradients before it."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio
    )
    return optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=decay_mask), schedule


def initial_state(params, tx, mesh) -> TrainState:
    """Step 0: the weights and fresh AdamW moments, which take their weight's sharding."""
    replicated = NamedSharding(mesh, P())
    opt_state = jax.tree.map(
        lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated), tx.init(params)
    )
    return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated), params=params, opt_state=opt_state)


def make_train_step(compute_graphdef, tx, compute_dtype, eps: float, grad_clip: float, state_shardings, step_runtime):
    """`step(state, batch [accum, B, L] arrays, hyper) -> (state, metrics)`, jitted under `step_runtime` with the
    state donated. The mean gradient is clipped to global norm `grad_clip` (0: off) by PyTorch's `clip_grad_norm_`
    formula (`jaxport.training.step.clip_by_global_norm`), as GPT's and TRM's steps clip."""

    def loss_fn(params, batch, key):
        model = nnx.merge(compute_graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
        return diffusion_loss(model, batch, key, eps)

    @functools.partial(
        runtime.jit_training_step, runtime=step_runtime, donate_argnums=0, out_shardings=(state_shardings, None)
    )
    def step(state: TrainState, batches: dict, hyper: Hyper):
        accum, key = batches["input_ids"].shape[0], hyper.key

        def objective(params, batch, micro_key):
            loss = loss_fn(params, batch, micro_key)
            return loss, loss

        grads, losses = accumulate_gradients(objective, state.params, batches, jax.random.split(key, accum))
        grads = jax.tree.map(lambda g: g / accum, grads)  # equal micro-batches: the mean over all rows
        grads, grad_norm = clip_by_global_norm(grads, grad_clip)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": jnp.mean(losses), "grad_norm": grad_norm}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


# ----- set-up


def training_mesh(cfg: TrainConfig, devices=None):
    """The run's mesh over `devices` (default: every device): `--mesh`, else data-parallel; the sizes checked."""
    mesh = parse_mesh(cfg.mesh, devices) or make_mesh(data=-1, devices=devices)
    rows_per_device = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.batch_size % rows_per_device:
        raise JaxportError(
            f"--batch-size {cfg.batch_size} is not divisible by the {rows_per_device} devices of "
            f"the mesh's data and fsdp axes"
        )
    for name in ("steps", "batch_size", "grad_accum", "log_every", "save_every"):
        if getattr(cfg, name) < 1:
            raise JaxportError(f"{name}={getattr(cfg, name)} must be at least 1")
    if cfg.grad_clip < 0:
        raise JaxportError(f"grad_clip={cfg.grad_clip} must be 0 (no clipping) or positive")
    return mesh


def compile_target(cfg: TrainConfig, mesh) -> tuple:
    """`(step, abstract arguments)`: the step a run of `cfg` compiles on `mesh` (`training_mesh`), with shapes and
    shardings in place of the weights, AdamW moments and batches (`jaxport dream train --compile-for`): `--model`'s
    config.json or `--config`'s size, and the tokenizer's special ids; no weights or data read."""
    from jaxport.runtime.compile_for import abstract

    config, _, _ = config_and_tokenizer(cfg)
    dtype = compute_dtype(cfg, mesh)
    _, params = nnx.split(placed_abstract_model(config, "float32", mesh))
    compute_graphdef, _ = nnx.split(abstract_model(config, dtype, mesh))
    tx, _ = optimizer(cfg)
    replicated = NamedSharding(mesh, P())
    opt_state = jax.eval_shape(tx.init, params)
    opt_state = abstract(opt_state, moment_shardings(tx, opt_state, jax.tree.map(lambda x: x.sharding, params), mesh))
    step_number = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    state = TrainState(step=step_number, params=params, opt_state=opt_state)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = make_train_step(compute_graphdef, tx, dtype, cfg.eps, cfg.grad_clip, shardings, training_runtime(cfg, mesh))
    shape = (cfg.grad_accum, cfg.batch_size, cfg.seq_len)
    rows = logical_sharding(mesh, None, "batch", None)  # as shard_batch places [accum, B, L] micro-batches
    batch = {
        "input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows),
        "attention_mask": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows),
        "response_mask": jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=rows),
    }
    key = abstract(jax.eval_shape(lambda: jax.random.key(0)), replicated)
    return step, (state, batch, Hyper(key))


def training_runtime(cfg: TrainConfig, mesh) -> runtime.Runtime:
    """The runtime the step compiles under: the mesh's devices, the rows each one's products have."""
    batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
    return runtime.for_devices(mesh).for_program(
        compute_dtype(cfg, mesh), cfg.batch_size // batch_devices * cfg.seq_len
    )


def compute_dtype(cfg: TrainConfig, mesh):
    name = cfg.dtype or ("float32" if mesh.devices.flat[0].platform == "cpu" else "bfloat16")
    return resolve_dtype(name)


def sample_prompts(rows: Rows, count: int) -> list[list[int]]:
    """Prompts of the first `count` rows: the tokens before the response (text rows: the first quarter)."""
    prompts = []
    for ids, attention, response in zip(
        rows.input_ids[:count], rows.attention_mask[:count], rows.response_mask[:count]
    ):
        start = int(np.argmax(response)) if not response.all() else len(ids) // 4
        prompts.append([int(t) for t, a in zip(ids[:start], attention[:start]) if a])
    return prompts


def generate_samples(model, tokenizer: DreamTokenizer, prompts: list[list[int]], seq_len: int, max_new: int):
    """Exact decoding (one token per step, entropy order) of each prompt, left-padded into one batch."""
    width = max(len(p) for p in prompts)
    new_tokens = min(max_new, seq_len - width)
    ids = np.full((len(prompts), width), tokenizer.pad_token_id, np.int32)
    attention = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], attention[row, width - len(prompt) :] = prompt, 1
    out = diffusion_generate(model, ids, attention, max_new_tokens=new_tokens, steps=new_tokens, alg="entropy")
    completions = tokenizer.decode_generation(jax.device_get(out.sequences), width)
    return [{"prompt": tokenizer.decode(p), "completion": c} for p, c in zip(prompts, completions)]


def log_samples(run: Run, step: int, samples: list[dict]) -> None:
    """Show the samples under the progress bar and append them to the run's `samples.jsonl`."""
    for sample in samples:
        run.write(f"sample at step {step}: {json.dumps(sample, ensure_ascii=False)}")
    if run.is_main:
        with open(run.dir / "samples.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n" for sample in samples)


# ----- the loop


def train(preset: str | None = None, **options) -> dict:
    """Train Dream with its masked-diffusion objective (see `masked_diffusion_loss`) and export the result.

    `options` are `TrainConfig` fields (a `preset` fills in its own first). Resumes from the newest intact
    checkpoint in `out_dir` if there is one. Returns the last step, loss, the export directory and the
    learning-curve PNG.
    """
    cfg = make_config(preset, **options)
    if cfg.preset:
        cfg = PRESETS[cfg.preset][1](cfg)
    if cfg.data is None:
        raise JaxportError("give the training data: --data FILE (a text file or JSONL)")
    mesh = training_mesh(cfg)
    config, tokenizer, tokenizer_dir = config_and_tokenizer(cfg)
    rows = load_rows(cfg.data, tokenizer, seq_len=cfg.seq_len, response_len=cfg.response_len, chat=cfg.chat)
    dtype = compute_dtype(cfg, mesh)
    # float32 master weights, with the shardings generation uses
    model = (
        load_model(cfg.model, config, dtype="float32", mesh=mesh)
        if cfg.model
        else random_model(config, dtype="float32", mesh=mesh, seed=cfg.seed)
    )
    graphdef, params = nnx.split(model)
    compute_graphdef, _ = nnx.split(abstract_model(model.config, dtype, mesh))
    tx, schedule = optimizer(cfg)
    state = initial_state(params, tx, mesh)
    train_step = make_train_step(
        compute_graphdef,
        tx,
        dtype,
        cfg.eps,
        cfg.grad_clip,
        jax.tree.map(lambda x: x.sharding, state),
        training_runtime(cfg, mesh),
    )
    batches = Batches(len(rows), cfg.batch_size * cfg.grad_accum, cfg.seed)
    with Run(
        cfg.out_dir,
        config=dataclasses.asdict(cfg),
        config_name="train_config.yaml",
        total_steps=cfg.steps,
        keep_last=cfg.keep_last,
        shown=("loss",),
    ) as run:
        restored = run.restore(abstract_like(state))
        if restored is not None:
            state, meta = restored
            batches.load_state_dict(meta["data"])
        first = int(fetch_replicated(state.step))
        run.start_logging(first)
        if run.is_main:
            (run.dir / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
            copy_tokenizer_files(tokenizer_dir, run.dir)
        n_params = sum(x.size for x in jax.tree.leaves(params))
        run.write(
            ("resumed at" if restored else "starting at") + f" step {first}: {n_params / 1e6:.2f}M parameters, "
            f"{len(rows)} rows of {cfg.seq_len} tokens, {jnp.dtype(dtype).name} compute on "
            f"{mesh.devices.size} {mesh.devices.flat[0].platform} device(s) {dict(mesh.shape)}; "
            f"the first step compiles"
        )
        steps = _Steps(cfg, run, graphdef, batches, schedule, tokenizer, sample_prompts(rows, cfg.samples))
        state = fit(
            run,
            lambda state, batch, hyper: train_step(state, shard_batch(batch, mesh, batch_dim=-2), hyper),
            state,
            steps.batches_of(rows, first),
            hyper=lambda step: Hyper(jax.random.fold_in(steps.base_key, step)),
            read=steps.read,
            after=steps.hooks(),
        )
        run.flush()
        export_dir = _export(cfg, run, nnx.merge(graphdef, state.params), state, tokenizer_dir)
    png = Path(cfg.out_dir) / "learning_curves.png"
    return {
        "step": int(fetch_replicated(state.step)),
        "loss": steps.last_loss,
        "export_dir": str(export_dir),
        "learning_curves": str(png) if png.is_file() else None,
    }


def _export(cfg: TrainConfig, run: Run, model, state: TrainState, tokenizer_dir) -> Path:
    """The trained weights as a Hugging Face directory (`--export-dir`)."""
    export_dir = Path(cfg.export_dir or Path(cfg.out_dir) / "hf")
    dtype = cfg.export_dtype or model.config.torch_dtype
    save_pretrained(model, export_dir, dtype=dtype, max_shard_size=cfg.max_shard_size, tokenizer_dir=tokenizer_dir)
    run.write(f"exported step {int(fetch_replicated(state.step))} to {export_dir}")
    return export_dir


class _Steps:
    """A run's batches and the work around its steps: the metrics logged, checkpoints and samples."""

    def __init__(self, cfg: TrainConfig, run: Run, graphdef, batches: Batches, schedule, tokenizer, prompts):
        self.cfg, self.run, self.graphdef, self.batches, self.schedule = cfg, run, graphdef, batches, schedule
        self.tokenizer, self.prompts = tokenizer, prompts
        self.base_key, self.last_loss = jax.random.key(cfg.seed), None

    def batches_of(self, rows: Rows, first: int):
        """(step, this process's rows of its micro-batches [accum, B / processes, L]) from step `first + 1` on."""
        cfg, process = self.cfg, jax.process_index()
        local_rows = cfg.batch_size // jax.process_count()  # each process feeds its own rows of every micro-batch
        for step in range(first + 1, cfg.steps + 1):
            index = self.batches.next().reshape(cfg.grad_accum, cfg.batch_size)
            yield step, rows.take(index[:, process * local_rows : (process + 1) * local_rows])

    def read(self, step: int, metrics: dict) -> dict | None:
        """A step's metrics, read while the next step runs (its loss checked): what to log at `log_every`."""
        self.last_loss = float(metrics["loss"])
        if step % self.cfg.log_every == 0 or step == self.cfg.steps:
            return {
                "train/loss": self.last_loss,
                "train/grad_norm": float(metrics["grad_norm"]),
                "train/lr": float(self.schedule(step - 1)),
            }
        return None

    def hooks(self) -> list:
        cfg = self.cfg
        save = every(cfg.save_every, self.save, last=cfg.steps)
        return [save, every(cfg.sample_every, self.sample, last=cfg.steps)] if self.prompts else [save]

    def save(self, step: int, state: TrainState) -> None:
        self.run.save(step, state, {"data": self.batches.state_dict(), "seed": self.cfg.seed})

    def sample(self, step: int, state: TrainState) -> None:
        self.run.flush()  # this step's metrics come before its samples
        model, cfg = nnx.merge(self.graphdef, state.params), self.cfg
        samples = generate_samples(model, self.tokenizer, self.prompts, cfg.seq_len, cfg.sample_tokens)
        log_samples(self.run, step, samples)
