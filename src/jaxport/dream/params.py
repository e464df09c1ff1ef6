"""Hugging Face safetensors <-> Dream parameters, read tensor by tensor straight onto the devices.

Each device reads only its own piece of each tensor (`safe_open(...).get_slice(name)[index]` inside
`jax.make_array_from_callback`), so the host never holds more than one tensor (a 7B bf16 checkpoint
loads with far less free RAM than its 15 GB).
"""

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

# parse_mesh is jaxport.distributed.parse_mesh; importable from here for one more release
from jaxport.distributed.mesh import logical_sharding, parse_mesh  # noqa: F401
from jaxport.dream.config import DreamConfig
from jaxport.dream.model import DreamModel
from jaxport.dtypes import float_dtype
from jaxport.errors import JaxportError, write_error
from jaxport.training.run import restore_params

# Logical axis names per checkpoint-name suffix (see jaxport.distributed.mesh.LOGICAL_AXIS_RULES).
_LOGICAL_AXES = {
    "embed_tokens.weight": ("vocab", "embed"),
    "q_proj.weight": ("heads", "embed"),
    "q_proj.bias": ("heads",),
    "k_proj.weight": ("kv_heads", "embed"),
    "k_proj.bias": ("kv_heads",),
    "v_proj.weight": ("kv_heads", "embed"),
    "v_proj.bias": ("kv_heads",),
    "o_proj.weight": ("embed", "heads"),
    "gate_proj.weight": ("mlp", "embed"),
    "up_proj.weight": ("mlp", "embed"),
    "down_proj.weight": ("embed", "mlp"),
    "norm.weight": (None,),
    "layernorm.weight": (None,),
    "lm_head.weight": ("vocab", "embed"),
}


def resolve_dtype(dtype) -> jnp.dtype:
    return float_dtype(dtype)


def checkpoint_name(path: tuple) -> str:
    """Parameter path in `DreamModel` -> tensor name in the Hugging Face checkpoint."""
    parts = ["weight" if p == "embedding_weight" else str(p) for p in path]
    name = ".".join(parts)
    return name if name.startswith("lm_head") else "model." + name


def logical_axes(name: str) -> tuple:
    for suffix, axes in _LOGICAL_AXES.items():
        if name.endswith(suffix):
            return axes
    raise KeyError(name)


def param_sharding(mesh: Mesh | None, name: str, shape: tuple) -> jax.sharding.Sharding:
    """Sharding for a parameter: its logical axes on `mesh`, replicated along a dimension that
    does not divide evenly. Without a mesh, the default device."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return logical_sharding(mesh, *logical_axes(name), shape=shape)


def open_safetensors(path: Path):
    """`safe_open` with numpy arrays (bfloat16 included); an unreadable file is one error naming it."""
    try:
        return safe_open(path, framework="numpy")
    except (OSError, SafetensorError) as err:
        raise JaxportError(f"{path} is not a readable safetensors file: {err}") from None


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from `model.safetensors.index.json` or a single `model.safetensors`."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise JaxportError(f"{index} is not a safetensors index (no weight_map): {err}") from None
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise JaxportError(
                f"missing shard {model_dir / missing[0]} (listed in {index.name}"
                + (f", with {len(missing) - 1} more" if len(missing) > 1 else "")
                + ")"
            )
        return {name: model_dir / f for name, f in weight_map.items()}
    if single.is_file():
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    raise JaxportError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


def _put(tensor, shape: tuple, dtype, sharding) -> jax.Array:
    """One tensor (an array, or a safetensors slice read on demand) onto its devices; each device reads
    (and converts) only its own piece."""
    return jax.make_array_from_callback(shape, sharding, lambda index: np.asarray(tensor[index], dtype=dtype))


def abstract_model(cfg: DreamConfig, dtype, mesh: Mesh | None) -> DreamModel:
    """The model's structure with shape-only parameters: nothing is allocated until loading."""
    model = nnx.eval_shape(lambda: DreamModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    model.mesh = mesh
    return model


def placed_abstract_model(cfg: DreamConfig, dtype, mesh: Mesh) -> DreamModel:
    """The model `load_model` builds on `mesh`, its weights as shapes with the shardings they would have there:
    nothing read or allocated (a program compiled ahead of time takes it)."""
    dtype = resolve_dtype(dtype)
    model = abstract_model(cfg, dtype, mesh)
    for name, var in _variables(model):
        shape = tuple(var.get_value().shape)
        var.set_value(jax.ShapeDtypeStruct(shape, dtype, sharding=param_sharding(mesh, name, shape)))
    return model


def _variables(model: DreamModel):
    return [(checkpoint_name(path), var) for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Variable)]


def load_model(model_dir: str | Path, cfg: DreamConfig, dtype="float32", mesh: Mesh | None = None) -> DreamModel:
    """Build `DreamModel` from the safetensors in `model_dir`, cast to `dtype`, placed on `mesh`."""
    model_dir = Path(model_dir)
    dtype = resolve_dtype(dtype)
    files = checkpoint_files(model_dir)
    opened: dict[Path, object] = {}
    model = abstract_model(cfg, dtype, mesh)
    for name, var in _variables(model):
        if name not in files:
            raise JaxportError(
                f"{model_dir}: checkpoint has no tensor {name} "
                f"(config: {cfg.num_hidden_layers} layers, tie_word_embeddings="
                f"{cfg.tie_word_embeddings})"
            )
        path = files[name]
        if path not in opened:
            opened[path] = open_safetensors(path)
        if name not in opened[path].keys():
            raise JaxportError(f"{path} has no tensor {name} although the index lists it there")
        tensor = opened[path].get_slice(name)
        shape = tuple(tensor.get_shape())
        expected = tuple(var.get_value().shape)
        if shape != expected:
            raise JaxportError(
                f"{path}: tensor {name} has shape {list(shape)} but config.json implies {list(expected)}"
            )
        try:
            var.set_value(_put(tensor, shape, dtype, param_sharding(mesh, name, shape)))
        except (SafetensorError, TypeError, ValueError) as err:
            raise JaxportError(
                f"{path}: tensor {name} ({tensor.get_dtype()} {list(shape)}) cannot be read: {err}"
            ) from None
    return model


def random_model(cfg: DreamConfig, dtype="float32", mesh: Mesh | None = None, seed: int = 0) -> DreamModel:
    """Random weights as upstream's `_init_weights` draws them (normal with std `initializer_range`, zero
    biases, unit norms), directly on the devices, one tensor at a time (for benchmarks and training from
    scratch)."""
    dtype = resolve_dtype(dtype)
    model = abstract_model(cfg, dtype, mesh)
    key = jax.random.key(seed)
    for i, (name, var) in enumerate(_variables(model)):
        shape = tuple(var.get_value().shape)
        fill = 1.0 if name.endswith("norm.weight") else 0.0 if name.endswith("bias") else None
        init = _initializer(shape, dtype, fill, cfg.initializer_range, param_sharding(mesh, name, shape))
        var.set_value(init(jax.random.fold_in(key, i)))
    return model


@functools.lru_cache
def _initializer(shape: tuple, dtype, fill: float | None, std: float, sharding):
    """One compiled initializer per kind of tensor (the layers repeat the same few)."""

    def init(key):
        return jnp.full(shape, fill, dtype) if fill is not None else std * jax.random.normal(key, shape, dtype)

    return jax.jit(init, out_shardings=sharding)


def save_pretrained(
    model: DreamModel,
    output_dir: str | Path,
    *,
    dtype="float32",
    max_shard_size: int | str = "5GB",
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write `model` as a Hugging Face Dream directory that `load_model` (and upstream's remote code) reads:
    `config.json`, `generation_config.json`, `model.safetensors` (or `model-0000i-of-0000n.safetensors` with
    `model.safetensors.index.json` above `max_shard_size`, e.g. "5GB", "200MB" or bytes) and, from
    `tokenizer_dir`, the tokenizer files. Sharded weights are gathered one shard file at a time; in a
    multi-host run every process must call this and process 0 writes."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.numpy import save_file

    from jaxport.distributed import gather_to_host
    from jaxport.dream.tokenizer import copy_tokenizer_files

    dtype = resolve_dtype(dtype)
    output_dir = Path(output_dir)
    writer = jax.process_index() == 0
    variables = dict(_variables(model))
    split = split_state_dict_into_shards_factory(
        {name: var.get_value() for name, var in variables.items()},
        filename_pattern="model{suffix}.safetensors",
        get_storage_size=lambda x: math.prod(x.shape) * dtype.itemsize,
        max_shard_size=max_shard_size,
    )
    if writer:
        output_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*output_dir.glob("model*.safetensors"), output_dir / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)
    for filename, names in split.filename_to_tensors.items():
        tensors = gather_to_host({name: variables[name].get_value() for name in names})
        if writer:
            try:
                save_file(
                    {name: np.asarray(t).astype(dtype) for name, t in tensors.items()},
                    output_dir / filename,
                    metadata={"format": "pt"},
                )
            except Exception as err:  # safetensors reports a full disk as its own SafetensorError
                raise write_error(err, output_dir / filename) from None
    if not writer:
        return output_dir
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (output_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    cfg = model.config
    (output_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict(dtype.name), indent=2) + "\n")
    generation = {
        "alg": "origin",
        "alg_temp": None,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "eps": 0.001,
        "mask_token_id": cfg.mask_token_id,
        "output_history": False,
        "pad_token_id": cfg.pad_token_id,
        "steps": 512,
        "temperature": 0.0,
        "top_k": None,
        "top_p": None,
    }
    (output_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, output_dir)
    return output_dir


def export_run(
    source: str | Path,
    output_dir: str | Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """A Hugging Face directory from a training run folder (its newest intact checkpoint, or `step`) or from
    another Hugging Face directory (to change the dtype or the shard size)."""
    source = Path(source)
    config = DreamConfig.from_model_dir(source)
    model = abstract_model(config, jnp.float32, None)
    restored = restore_params(source, nnx.state(model), step=step)
    if restored is None:  # a Hugging Face directory
        model = load_model(source, config, dtype="float32")
    else:
        nnx.update(model, restored[0])
    return save_pretrained(
        model, output_dir, dtype=dtype or config.torch_dtype, max_shard_size=max_shard_size, tokenizer_dir=source
    )
