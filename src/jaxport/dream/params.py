"""Hugging Face safetensors <-> Dream parameters, read tensor by tensor straight onto the devices.

Each tensor is memory-mapped and copied piece by piece into the device buffers of its
sharding (`jax.make_array_from_callback`), so the host never holds more than one tensor
(a 7B bf16 checkpoint loads with far less free RAM than its 15 GB).
"""

import functools
import json
import math
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxport.distributed.mesh import logical_sharding
from jaxport.dream.config import DreamConfig
from jaxport.dream.model import DreamModel
from jaxport.errors import JaxportError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# safetensors dtype tags -> numpy; bfloat16 through ml_dtypes (numpy has none).
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}

# Logical axis names per checkpoint-name suffix (see jaxport.distributed.mesh.LOGICAL_AXIS_RULES).
_LOGICAL_AXES = {
    "embed_tokens.weight": ("vocab", "embed"),
    "q_proj.weight": ("heads", "embed"), "q_proj.bias": ("heads",),
    "k_proj.weight": ("kv_heads", "embed"), "k_proj.bias": ("kv_heads",),
    "v_proj.weight": ("kv_heads", "embed"), "v_proj.bias": ("kv_heads",),
    "o_proj.weight": ("embed", "heads"),
    "gate_proj.weight": ("mlp", "embed"), "up_proj.weight": ("mlp", "embed"),
    "down_proj.weight": ("embed", "mlp"),
    "norm.weight": (None,), "layernorm.weight": (None,),
    "lm_head.weight": ("vocab", "embed"),
}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str) and dtype in DTYPES:
        return jnp.dtype(DTYPES[dtype])
    if not isinstance(dtype, str) and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return jnp.dtype(dtype)
    raise JaxportError(f"unsupported dtype {dtype!r}: choose 'float32' or 'bfloat16'")


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
    spec = logical_sharding(mesh, *logical_axes(name)).spec
    fitted = []
    for size, axes in zip(shape, spec):
        names = (axes,) if isinstance(axes, str) else (axes or ())
        fitted.append(axes if size % math.prod(mesh.shape[a] for a in names) == 0 else None)
    return NamedSharding(mesh, P(*fitted))


class SafetensorsFile:
    """Lazy view of one `.safetensors` file: name -> memory-mapped numpy array.

    Written here rather than using `safetensors.safe_open` because its numpy backend has
    no bfloat16 and its flax backend stages every slice on the default accelerator.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                self.header = json.loads(f.read(header_len))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise JaxportError(f"{path} is not a readable safetensors file: {err}") from None
        self.header.pop("__metadata__", None)
        self.data_start = 8 + header_len

    def keys(self):
        return self.header.keys()

    def info(self, name: str) -> tuple[tuple, str]:
        entry = self.header[name]
        return tuple(entry["shape"]), entry["dtype"]

    def tensor(self, name: str) -> np.ndarray:
        entry = self.header[name]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise JaxportError(f"{self.path}: tensor {name} has dtype {entry['dtype']}; "
                               f"expected one of {', '.join(_SAFETENSORS_DTYPES)}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * np.dtype(dtype).itemsize:
            raise JaxportError(f"{self.path}: tensor {name} holds {end - begin} bytes, "
                               f"which does not fit shape {list(shape)} of {entry['dtype']}")
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin, shape=shape)


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
            raise JaxportError(f"missing shard {model_dir / missing[0]} (listed in {index.name}"
                               + (f", with {len(missing) - 1} more" if len(missing) > 1 else "") + ")")
        return {name: model_dir / f for name, f in weight_map.items()}
    if single.is_file():
        return {name: single for name in SafetensorsFile(single).keys()}
    raise JaxportError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


def _put(array: np.ndarray, dtype, sharding) -> jax.Array:
    """One tensor onto its devices; each device reads (and converts) only its own piece."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: np.asarray(array[index], dtype=dtype))


def abstract_model(cfg: DreamConfig, dtype, mesh: Mesh | None) -> DreamModel:
    """The model's structure with shape-only parameters: nothing is allocated until loading."""
    model = nnx.eval_shape(lambda: DreamModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    model.mesh = mesh
    return model


def _variables(model: DreamModel):
    return [(checkpoint_name(path), var) for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Variable)]


def load_model(model_dir: str | Path, cfg: DreamConfig, dtype="float32", mesh: Mesh | None = None) -> DreamModel:
    """Build `DreamModel` from the safetensors in `model_dir`, cast to `dtype`, placed on `mesh`."""
    model_dir = Path(model_dir)
    dtype = resolve_dtype(dtype)
    files = checkpoint_files(model_dir)
    opened: dict[Path, SafetensorsFile] = {}
    model = abstract_model(cfg, dtype, mesh)
    for name, var in _variables(model):
        if name not in files:
            raise JaxportError(f"{model_dir}: checkpoint has no tensor {name} "
                               f"(config: {cfg.num_hidden_layers} layers, tie_word_embeddings="
                               f"{cfg.tie_word_embeddings})")
        path = files[name]
        if path not in opened:
            opened[path] = SafetensorsFile(path)
        if name not in opened[path].keys():
            raise JaxportError(f"{path} has no tensor {name} although the index lists it there")
        shape, _ = opened[path].info(name)
        expected = tuple(var.get_value().shape)
        if shape != expected:
            raise JaxportError(f"{path}: tensor {name} has shape {list(shape)} but config.json implies "
                               f"{list(expected)}")
        var.set_value(_put(opened[path].tensor(name), dtype, param_sharding(mesh, name, shape)))
    return model


def random_model(cfg: DreamConfig, dtype="float32", mesh: Mesh | None = None, seed: int = 0) -> DreamModel:
    """Random weights drawn directly on the devices, one tensor at a time (for benchmarks)."""
    dtype = resolve_dtype(dtype)
    model = abstract_model(cfg, dtype, mesh)
    key = jax.random.key(seed)
    for i, (name, var) in enumerate(_variables(model)):
        shape = tuple(var.get_value().shape)
        init = jax.jit(functools.partial(_random_tensor, shape=shape, dtype=dtype, ones=name.endswith("norm.weight")),
                       out_shardings=param_sharding(mesh, name, shape))
        var.set_value(init(jax.random.fold_in(key, i)))
    return model


def _random_tensor(key, *, shape, dtype, ones: bool):
    return jnp.ones(shape, dtype) if ones else 0.02 * jax.random.normal(key, shape, dtype)
