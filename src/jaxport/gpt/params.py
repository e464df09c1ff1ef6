"""Checkpoint names and formats: nanoGPT `ckpt.pt` and Hugging Face GPT-2 <-> `jaxport.gpt.GPT`'s parameters.

nanoGPT's state-dict keys (`transformer.h.0.attn.c_attn.weight`, ..., `lm_head.weight`)
are HF's `GPT2LMHeadModel` keys; HF stores the four Conv1D weights as [in, out], nanoGPT
(and jaxport) as [out, in]. The AdamW moments of a ckpt.pt are indexed by parameter
position: first the decayed (2-D) parameters, then the others, each in named_parameters order.
This module maps names and reads files; building a model from them is `jaxport.gpt.model`'s.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxport.checkpoint import load_torch_file, strip_prefix
from jaxport.checkpoint.names import NameTable
from jaxport.errors import JaxportError
from jaxport.gpt.config import GPTConfig

# nanoGPT state-dict key -> path in `nnx.state(GPT)`; the tied lm_head is wte itself (no entry)
NAMES = NameTable(
    [
        ("transformer.wte.weight", "wte"),
        ("transformer.wpe.weight", "wpe"),
        ("transformer.h.{i}.{rest}", "h.{i}.{rest}"),
        ("transformer.ln_f.{name}", "ln_f.{name}"),
    ]
)
# Logical axes of each parameter, by the end of its path (jaxport.distributed's rules put `embed` on the
# mesh's fsdp axis, `heads`/`mlp`/`vocab` on its model axis).
LOGICAL_AXES = (
    ("wte", ("vocab", "embed")),
    ("wpe", (None, "embed")),
    ("attn.c_attn.weight", ("heads", "embed")),
    ("attn.c_attn.bias", ("heads",)),
    ("attn.c_proj.weight", ("embed", "heads")),
    ("mlp.c_fc.weight", ("mlp", "embed")),
    ("mlp.c_fc.bias", ("mlp",)),
    ("mlp.c_proj.weight", ("embed", "mlp")),
    ("c_proj.bias", ("embed",)),
    ("weight", ("embed",)),
    ("bias", ("embed",)),
)  # LayerNorms last
COMPILE_PREFIX = "_orig_mod."  # torch.compile'd models save their keys under this prefix
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GPT2_SIZES = {  # nanoGPT's from_pretrained table
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}


def logical_axes(path: str) -> tuple:
    """The logical axes of the parameter at dotted module path `path` (e.g. `h.0.attn.c_attn.weight`)."""
    return next(axes for suffix, axes in LOGICAL_AXES if path == suffix or path.endswith("." + suffix))


def param_names(config: GPTConfig) -> list[str]:
    """nanoGPT's `named_parameters()` order (the tied lm_head appears once, as wte)."""
    suffixes = ("weight", "bias") if config.bias else ("weight",)
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(config.n_layer):
        for layer in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"transformer.h.{i}.{layer}.{s}" for s in suffixes]
    return names + [f"transformer.ln_f.{s}" for s in suffixes]


def optimizer_param_order(config: GPTConfig) -> tuple[list[str], list[str]]:
    """(decayed, not decayed) parameter names: nanoGPT's AdamW groups (2-D and up are decayed)."""
    names = param_names(config)
    decay = [n for n in names if n.endswith(".weight") and ".ln_" not in n]
    return decay, [n for n in names if n not in decay]


def named_to_tree(named: dict) -> dict:
    """{nanoGPT name: array} -> the nested dict `nnx.merge` takes (a pure state dict)."""
    tree = {}
    for name, value in named.items():
        *parents, leaf = NAMES.to_module(name)
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def tree_to_named(tree: dict, config: GPTConfig) -> dict:
    named = {}
    for name in param_names(config):
        node = tree
        for p in NAMES.to_module(name):
            node = node[p]
        named[name] = node
    return named


def model_state_dict(model) -> dict[str, np.ndarray]:
    """nanoGPT's `model.state_dict()` of a `GPT`: float32 numpy arrays, lm_head.weight last (= wte)."""
    named = tree_to_named(nnx.to_pure_dict(nnx.state(model, nnx.Param)), model.config)
    sd = {k: np.asarray(v, np.float32) for k, v in named.items()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def nanogpt_weights(state_dict: dict, config: GPTConfig, source: str) -> dict:
    """A nanoGPT-named state dict (`_orig_mod.` keys and nanoGPT's `attn.bias` mask buffers allowed) checked
    against the names `config` implies: {name: array} of exactly the model's parameters."""
    sd = strip_prefix(state_dict, COMPILE_PREFIX)
    # nanoGPT's non-flash path saves (1,1,T,T) causal-mask buffers as h.N.attn.bias.
    sd = {k: v for k, v in sd.items() if not k.endswith(".attn.bias")}
    expected = param_names(config)
    missing = [k for k in expected if k not in sd]
    unexpected = sorted(set(sd) - set(expected) - {"lm_head.weight"})
    if missing or unexpected:
        raise JaxportError(
            f"{source}: state dict does not fit the model (n_layer={config.n_layer}, "
            f"bias={config.bias}): missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
            f"unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}"
        )
    return {k: np.asarray(sd[k]) for k in expected}


# -- nanoGPT ckpt.pt ----------------------------------------------------------------------------


def checkpoint_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.is_dir() or (not path.exists() and not path.suffix):  # a run folder
        path = path / "ckpt.pt"
    if not path.exists():
        hint = "" if path.parent.exists() else f" (folder {path.parent} does not exist either)"
        raise JaxportError(
            f"checkpoint not found: {path}{hint}; train one with `jaxport gpt train` or point to a nanoGPT out_dir"
        )
    return path


def read_checkpoint(path: str | os.PathLike) -> tuple[Path, dict]:
    path = checkpoint_path(path)
    ckpt = load_torch_file(path, what="nanoGPT checkpoint")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        found = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise JaxportError(f"{path} is not a nanoGPT ckpt.pt: expected keys 'model' and 'model_args', found {found}")
    return path, ckpt


# -- Hugging Face GPT-2 -------------------------------------------------------------------------


def resolve_pretrained(name_or_path: str | os.PathLike) -> Path:
    """A local directory as is; a GPT-2 name (`gpt2`, `gpt2-medium`, ...) looked up in
    `$JAXPORT_GPT2_DIR/<name>` and then the Hugging Face hub cache (`$HF_HOME`, ~/.cache/huggingface)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    candidates = []
    if name in GPT2_SIZES:
        if os.environ.get("JAXPORT_GPT2_DIR"):
            candidates.append(Path(os.environ["JAXPORT_GPT2_DIR"]) / name)
        hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
        for repo in (name, f"openai-community/{name}"):
            snapshots = hub / f"models--{repo.replace('/', '--')}" / "snapshots"
            candidates += sorted(snapshots.glob("*")) if snapshots.is_dir() else [snapshots]
        for c in candidates:
            if (c / "config.json").exists():
                return c
    where = "; ".join(str(c) for c in candidates) or str(path)
    raise JaxportError(
        f"GPT-2 weights {name!r} not found (looked in {where}). Put a Hugging Face GPT-2 "
        f"directory (config.json + model.safetensors) there, e.g. `huggingface-cli download "
        f"openai-community/{name if name in GPT2_SIZES else 'gpt2'} --local-dir DIR`, and pass "
        f"DIR or set JAXPORT_GPT2_DIR to its parent folder"
    )


def _read_hf_weights(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        weights = {}
        for shard in shards:
            weights.update(load_file(directory / shard))
        return weights
    if (directory / "model.safetensors").exists():
        return load_file(directory / "model.safetensors")
    if (directory / "pytorch_model.bin").exists():
        return load_torch_file(directory / "pytorch_model.bin", what="GPT-2 weights")
    raise JaxportError(f"{directory} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def hf_to_nanogpt_state_dict(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF GPT2LMHeadModel (save_pretrained: `transformer.*`) or GPT2Model (hub: bare) weights
    -> nanoGPT keys, Conv1D weights transposed, mask buffers dropped."""
    sd = {}
    for key, value in weights.items():
        key = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
        if key.endswith((".attn.masked_bias", ".attn.bias")) and key.startswith("transformer.h."):
            continue
        if key.endswith(CONV1D_WEIGHTS):
            value = value.T
        sd[key] = np.asarray(value, np.float32)
    return sd


def read_pretrained(name_or_path: str | os.PathLike) -> tuple[Path, GPTConfig, dict]:
    """(directory, config, nanoGPT-named weights) of Hugging Face GPT-2 weights (see resolve_pretrained)."""
    directory = resolve_pretrained(name_or_path)
    config_file = directory / "config.json"
    if not config_file.exists():
        raise JaxportError(f"{directory} has no config.json; expected a Hugging Face GPT-2 directory")
    hf = json.loads(config_file.read_text())
    if hf.get("model_type", "gpt2") != "gpt2":
        raise JaxportError(f"{config_file}: model_type {hf.get('model_type')!r} is not gpt2")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise JaxportError(f"{config_file}: n_inner={hf['n_inner']} differs from 4*n_embd, which nanoGPT assumes")
    config = GPTConfig(
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        block_size=hf["n_positions"],
        vocab_size=hf["vocab_size"],
        bias=True,
    )
    return directory, config, hf_to_nanogpt_state_dict(_read_hf_weights(directory))


# -- AdamW moments: torch state_dict <-> optax ---------------------------------------------------


def torch_adamw_to_moments(optimizer: dict, config: GPTConfig, source: str) -> tuple[dict, dict, int, list]:
    """(exp_avg by name, exp_avg_sq by name, step, param_groups) from a torch AdamW state_dict."""
    decay, nodecay = optimizer_param_order(config)
    order = decay + nodecay
    state = optimizer.get("state", {})
    groups = optimizer.get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(decay), len(nodecay)]:
        raise JaxportError(
            f"{source}: optimizer groups hold {[len(g['params']) for g in groups]} parameters, "
            f"the model has {len(decay)} decayed and {len(nodecay)} other ones"
        )
    mu, nu, steps = {}, {}, set()
    for i, name in enumerate(order):
        entry = state.get(i)
        if entry is None:
            raise JaxportError(f"{source}: optimizer state lacks parameter {i} ({name})")
        mu[name], nu[name] = np.asarray(entry["exp_avg"]), np.asarray(entry["exp_avg_sq"])
        steps.add(int(np.asarray(entry["step"])))
    if len(steps) != 1:
        raise JaxportError(f"{source}: AdamW step counts differ between parameters: {sorted(steps)}")
    return mu, nu, steps.pop(), groups


def torch_adamw_state_dict(
    mu: dict, nu: dict, step: int, config: GPTConfig, lr: float, betas, eps: float, weight_decay: float
) -> dict:
    """A torch AdamW state_dict nanoGPT's `optimizer.load_state_dict` accepts."""
    decay, nodecay = optimizer_param_order(config)
    state = {
        i: {
            "step": np.asarray(float(step), np.float32),
            "exp_avg": np.asarray(mu[n], np.float32),
            "exp_avg_sq": np.asarray(nu[n], np.float32),
        }
        for i, n in enumerate(decay + nodecay)
    }
    group = dict(
        lr=float(lr),
        betas=tuple(float(b) for b in betas),
        eps=float(eps),
        amsgrad=False,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=True,
    )
    groups = [
        {**group, "weight_decay": float(weight_decay), "params": list(range(len(decay)))},
        {**group, "weight_decay": 0.0, "params": list(range(len(decay), len(decay) + len(nodecay)))},
    ]
    return {"state": state, "param_groups": groups}


def adam_state(opt_state):
    """The `optax.ScaleByAdamState` (mu, nu, count) inside an AdamW state."""
    import optax

    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    return next(x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x))


def with_torch_moments(opt_state, moments: tuple):
    """`opt_state` holding a ckpt.pt's AdamW moments: torch's exp_avg, exp_avg_sq and step are optax's mu, nu and
    count (`moments` as `torch_adamw_to_moments` gives them, without the groups)."""
    mu, nu, step = moments
    adam = adam_state(opt_state)._replace(
        count=jnp.asarray(step, jnp.int32),
        mu=named_to_tree({k: jnp.asarray(v) for k, v in mu.items()}),
        nu=named_to_tree({k: jnp.asarray(v) for k, v in nu.items()}),
    )
    return opt_state._replace(inner_state=(adam, *opt_state.inner_state[1:]))


def nanogpt_checkpoint(params, opt_state, config: GPTConfig, adamw: tuple, train_config: dict, **at) -> dict:
    """The dict nanoGPT's train.py saves as ckpt.pt (every array gathered to this host: a collective). `adamw` is
    (betas, eps, weight_decay); `at` gives iter_num, best_val_loss and lr."""
    from jaxport.distributed import gather_to_host

    adam = adam_state(opt_state)
    params, mu, nu, step = gather_to_host((params, adam.mu, adam.nu, adam.count))
    # an OrderedDict, as nanoGPT's model.state_dict() is
    model_sd = collections.OrderedDict((k, np.asarray(v, np.float32)) for k, v in tree_to_named(params, config).items())
    model_sd["lm_head.weight"] = model_sd["transformer.wte.weight"]
    mu, nu = tree_to_named(mu, config), tree_to_named(nu, config)
    return {
        "model": model_sd,
        "optimizer": torch_adamw_state_dict(mu, nu, int(step), config, at["lr"], *adamw),
        "model_args": config.to_model_args(),
        "iter_num": int(at["iter_num"]),
        "best_val_loss": np.asarray(at["best_val_loss"], np.float32),
        "config": train_config,
    }


def write_nanogpt_checkpoint(trainer, out_dir: Path, iter_num: int, best_val_loss: float, lr: float) -> None:
    """nanoGPT's ckpt.pt of a `jaxport.gpt.trainer.Trainer` (every array gathered to one host), written atomically by
    process 0."""
    from jaxport.checkpoint import save_torch_file

    ckpt = trainer.checkpoint(iter_num, best_val_loss, lr)  # a collective: every process
    if jax.process_index() == 0:
        save_torch_file(ckpt, Path(out_dir) / "ckpt.pt")
