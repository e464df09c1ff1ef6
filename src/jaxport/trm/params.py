"""Upstream TRM checkpoints <-> jaxport TRM.

Upstream saves `torch.save(model.state_dict(), "<run>/step_N")` with keys such as
`_orig_mod.model.inner.L_level.layers.0.self_attn.qkv_proj.weight` (`_orig_mod.` from
torch.compile). The jaxport module tree mirrors upstream's names, so a key maps onto
the module path after `model.inner.`.
"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from jaxport.checkpoint import load_torch_file, save_torch_file
from jaxport.checkpoint.names import NameTable, path_parts
from jaxport.errors import JaxportError
from jaxport.training.run import run_checkpoints
from jaxport.trm.config import TRMConfig, read_all_config
from jaxport.trm.model import TRM, Buffer

COMPILED_PREFIX = "_orig_mod."  # upstream saves torch.compile'd models
# upstream key -> path under `TRM.inner`, with the compiled prefix first: the form upstream writes
NAMES = NameTable([(COMPILED_PREFIX + "model.inner.{rest}", "{rest}"), ("model.inner.{rest}", "{rest}")])


def upstream_keys(config: TRMConfig) -> list[str]:
    """State-dict keys in upstream's order (without `_orig_mod.model.inner.`)."""
    keys = ["H_init", "L_init", "embed_tokens.embedding_weight", "lm_head.weight", "q_head.weight", "q_head.bias"]
    if config.puzzle_emb_ndim > 0:
        keys.append("puzzle_emb.weights")
    if config.pos_encodings == "learned":
        keys.append("embed_pos.embedding_weight")
    mixer = ("mlp_t.gate_up_proj", "mlp_t.down_proj") if config.mlp_t else ("self_attn.qkv_proj", "self_attn.o_proj")
    for i in range(config.L_layers):
        keys += [f"L_level.layers.{i}.{name}.weight" for name in (*mixer, "mlp.gate_up_proj", "mlp.down_proj")]
    return keys


def _variable(model: TRM, key: str) -> nnx.Variable:
    node = model.inner
    for part in path_parts(key):
        node = node[part] if isinstance(part, int) else getattr(node, part)
    return node


def state_dict(model: TRM) -> dict[str, np.ndarray]:
    """Upstream-named numpy arrays: parameters float32, H_init/L_init in the forward dtype."""
    return {
        NAMES.to_checkpoint(path_parts(key)): np.asarray(_variable(model, key)[...])
        for key in upstream_keys(model.config)
    }


def relative_weights(raw: dict) -> dict:
    """An upstream state dict keyed relative to the inner model (`L_level.layers.0...`); keys of other
    models pass through unchanged, so that `check_keys` names them."""
    relative = {}
    for key, value in raw.items():
        path = NAMES.to_module(key)
        relative[".".join(str(p) for p in path) if path else key] = value
    return relative


def _dataset_sizes(config: dict, config_path: Path) -> dict:
    """vocab_size, seq_len, num_puzzle_identifiers from the run's first training dataset, when present."""
    for data_path in config.get("data_paths") or []:
        for base in (Path.cwd(), config_path.parent):
            meta = base / data_path / "train" / "dataset.json"
            if meta.exists():
                m = json.loads(meta.read_text())
                return {k: m[k] for k in ("vocab_size", "seq_len", "num_puzzle_identifiers")}
    return {}


def _sizes_from_weights(weights: dict, arch: dict, hidden: int) -> dict:
    sizes = {}
    if "embed_tokens.embedding_weight" in weights:
        sizes["vocab_size"] = weights["embed_tokens.embedding_weight"].shape[0]
    if "puzzle_emb.weights" in weights:
        sizes["num_puzzle_identifiers"] = weights["puzzle_emb.weights"].shape[0]
    puzzle_len = arch.get("puzzle_emb_len", 16) or -(arch.get("puzzle_emb_ndim", hidden) // -hidden)
    for key in ("embed_pos.embedding_weight", "L_level.layers.0.mlp_t.down_proj.weight"):
        if key in weights:
            sizes["seq_len"] = weights[key].shape[0] - puzzle_len
    return sizes


def load_upstream_checkpoint(
    checkpoint_path: str | Path,
    config_path: str | Path,
    *,
    num_puzzle_identifiers: int | None = None,
    seed: int = 0,
    unroll_cycles: bool = True,
) -> TRM:
    """Read an upstream `step_N` file with its `all_config.yaml` into a TRM (ACT model + loss head).

    A `num_puzzle_identifiers` different from the checkpoint's table (e.g. a new dataset)
    replaces the table by its row mean, as upstream's `load_checkpoint` does.
    """
    checkpoint_path, config_path = Path(checkpoint_path), Path(config_path)
    run_config = read_all_config(config_path)
    raw = load_torch_file(checkpoint_path, "TRM checkpoint")
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise JaxportError(f"{checkpoint_path} is not a state dict (expected a mapping of tensor names to tensors)")
    weights = relative_weights(raw)
    arch = run_config["arch"]
    sizes = _sizes_from_weights(weights, arch, arch.get("hidden_size", 512))
    sizes.update(_dataset_sizes(run_config, config_path))
    if num_puzzle_identifiers is not None:
        sizes["num_puzzle_identifiers"] = num_puzzle_identifiers
    config = TRMConfig.from_arch(arch, source=str(config_path), batch_size=run_config.get("global_batch_size"), **sizes)
    check_keys(config, weights, checkpoint_path)
    model = TRM(config, rngs=nnx.Rngs(seed), unroll_cycles=unroll_cycles)
    load_state_dict(model, weights, source=checkpoint_path)
    model.source_config_yaml = yaml.safe_dump(run_config)
    return model


def check_keys(config: TRMConfig, weights: dict, source: Path) -> None:
    expected = upstream_keys(config)
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""))
        raise JaxportError(
            f"checkpoint {source} does not fit the config (arch mlp_t={config.mlp_t}, "
            f"pos_encodings={config.pos_encodings}, L_layers={config.L_layers}): " + "; ".join(parts)
        )


def load_state_dict(model: TRM, weights: dict, source: Path) -> None:
    """Assign upstream-named arrays (prefixes stripped) to the model, checking names and shapes."""
    check_keys(model.config, weights, source)
    for key in upstream_keys(model.config):
        variable = _variable(model, key)
        value = np.asarray(weights[key])
        want = variable[...].shape
        if key == "puzzle_emb.weights" and value.shape != want and value.shape[1:] == want[1:]:
            value = np.broadcast_to(value.astype(np.float32).mean(axis=0, keepdims=True), want)
        if value.shape != want:
            raise JaxportError(
                f"checkpoint {source}: tensor {key} has shape {list(value.shape)}, but the config needs {list(want)}"
            )
        variable[...] = jnp.asarray(value, dtype=variable[...].dtype)


def save_upstream_checkpoint(model: TRM, path: str | Path) -> None:
    """Write `path` as upstream's `torch.save(model.state_dict())` (keys prefixed `_orig_mod.model.inner.`),
    and an `all_config.yaml` beside it when there is none, so upstream and jaxport can both load it."""
    path = Path(path)
    save_torch_file(state_dict(model), path)
    config_path = path.parent / "all_config.yaml"
    if not config_path.exists():
        run_config = yaml.safe_load(getattr(model, "source_config_yaml", "") or "{}")
        run_config["arch"] = model.config.arch_dict()
        if model.config.batch_size is not None:
            run_config["global_batch_size"] = model.config.batch_size
        config_path.write_text(yaml.safe_dump(run_config))


def load_weights(model: TRM, path: Path) -> None:
    """`load_checkpoint=`: an upstream step_N file, or a jaxport run folder (its newest intact checkpoint)."""
    if path.is_dir():
        _, params, buffers, _ = nnx.split(model, nnx.Param, Buffer, ...)
        with run_checkpoints(path) as source:
            restored, _ = source.restore({"params": params, "buffers": buffers}, partial=True)
        nnx.update(model, restored["params"], restored["buffers"])
        return
    load_state_dict(model, relative_weights(load_torch_file(path, "load_checkpoint")), source=path)
