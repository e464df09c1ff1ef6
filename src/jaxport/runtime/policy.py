"""`Runtime`: what a compiled program does differently on its devices, decided once per program from the devices it
runs on, its compute dtype and the rows of its matrix products (`for_devices`, `Runtime.for_program`), and applied
where the program is jitted (`jit`): its XLA options go to the compiler, the rest to the layers, which read it from
`current()` while the program is traced. docs/performance.md holds the measurements behind each decision."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxport.distributed.mesh import logical_spec
from jaxport.runtime import host_memory, settings, topologies

# Rows per device from which a float32 product runs faster through XLA:CPU's own dot emitter than as a YNNPACK fusion
# and XLA's windowed long reductions beat plain ones (docs/performance.md, "XLA:CPU compiler options"); also the
# tokens per device up to which transformer blocks pay for row chunks ("Row chunks").
LARGE_MATMUL_ROWS = 8192
YNN_FUSION_TYPES = "xla_cpu_experimental_ynn_fusion_type"
INDIVIDUAL_DOTS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
PLAIN_REDUCTIONS = {"xla_disable_hlo_passes": "tree_reduction_rewriter"}
ROW_CHUNKS = 2  # chunks of independent rows, which XLA:CPU runs side by side on the cores
# Vocabulary-projection weights from which block-wise decoding projects the masked positions alone, packed into
# static buckets: below, the whole window's projection costs less than the sampler's copy per bucket costs to compile
# (docs/performance.md, "Masked positions in buckets").
PACKED_MASKS_FROM_WEIGHTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The decisions for the programs of one set of devices (hashable: part of JAX's cache key while tracing).

    - `attention`: "splash" runs Pallas's splash-attention kernel where it applies (TPUs that run Mosaic kernels,
      `MOSAIC_CHIPS`; elsewhere Pallas's interpreter runs it: tests); "cudnn" tries cuDNN's fused kernel for 16-bit
      attention without mask or dropout (GPUs); "causal_blocks" computes causal self-attention in blocks of queries
      (CPUs: "Attention on the CPU"); "xla" is one masked product.
    - `remat`: what the backward pass computes again instead of keeping. "attention_scores": each layer's
      `[B, H, S, T]` scores (TPUs: docs/tpu.md); "block": each transformer block, from its input alone;
      "save_dots": each block but its products with weights (`remat_block`); "none" keeps everything.
    - `row_major_operands`: reduced-precision operands that are transposed before a product are written out
      row-major, and weight gradients take the orientation XLA:CPU runs faster (CPUs: "Operand layouts").
    - `split_rows`: models compute independent rows in `row_chunks` chunks (CPUs: "Row chunks").
    - `head_in_out`: block-wise decoding reads the vocabulary projection's weight as `[D, V]`, written out once per
      generation, which XLA:CPU's products with a few rows run faster than `[V, D]` (CPUs: "The vocabulary
      projection in block-wise decoding").
    - `xla_options`: `jax.jit`'s compiler options as sorted items (`for_program`: "XLA:CPU compiler options").
    - `mesh`: the mesh of several devices the program runs on, where the caller gave one (`for_devices`): kernels
      that XLA cannot partition run on each device's shards of it (`per_device`).
    """

    platform: str = "cpu"
    devices: int = 1
    attention: str = "causal_blocks"
    remat: str = "none"
    row_major_operands: bool = True
    split_rows: bool = True
    head_in_out: bool = True
    xla_options: tuple[tuple[str, str], ...] = ()
    mesh: Mesh | None = None

    @property
    def compiler_options(self) -> dict | None:
        return dict(self.xla_options) or None

    def for_program(self, dtype, rows: int, *, reduces_leading_axis: bool = False) -> "Runtime":
        """This runtime with the XLA options for a program computing in `dtype` whose matrix products have `rows`
        rows per device. `reduces_leading_axis`: its norms reduce the leading axis of their layout (TRM's
        sequence-major mlp_t), which XLA:CPU's plain reductions run slowly."""
        return dataclasses.replace(self, xla_options=_xla_options(self.platform, dtype, rows, reduces_leading_axis))

    def row_chunks(self, batch: int, *, tokens_per_row: int | None = None, min_rows_per_device: int = 1) -> int:
        """The chunks a model computes the independent rows of a `batch`-row batch in (`nn.in_row_chunks`):
        `ROW_CHUNKS` where rows are split and each device's rows split evenly, else one. With `tokens_per_row`, only
        while a device holds fewer than `LARGE_MATMUL_ROWS` tokens; with `min_rows_per_device`, from that many rows."""
        per_device = batch // self.devices
        if not self.split_rows or batch % (ROW_CHUNKS * self.devices) or per_device < min_rows_per_device:
            return 1
        if tokens_per_row is not None and per_device * tokens_per_row >= LARGE_MATMUL_ROWS:
            return 1
        return ROW_CHUNKS


def packs_masks(vocab_size: int, hidden_size: int) -> bool:
    """Whether a decoder whose vocabulary projection is `[hidden_size, vocab_size]` scores the masked positions of a
    window alone, packed into buckets (`sampling.masked_scores`), rather than the whole window."""
    return vocab_size * hidden_size >= PACKED_MASKS_FROM_WEIGHTS


def _xla_options(platform: str, dtype, rows: int, reduces_leading_axis: bool) -> tuple:
    """XLA's defaults off the CPU. On a CPU, one YNNPACK fusion per dot (XLA:CPU would otherwise fuse a dot's
    producers and consumers into it, where they run slower) and plain reductions; from `LARGE_MATMUL_ROWS` rows on,
    float32 dots leave YNNPACK and reductions keep XLA's windowed form."""
    if platform != "cpu":
        return ()
    if rows >= LARGE_MATMUL_ROWS:
        options = {YNN_FUSION_TYPES: "" if jnp.dtype(dtype) == jnp.float32 else INDIVIDUAL_DOTS}
    else:
        options = {YNN_FUSION_TYPES: INDIVIDUAL_DOTS, **({} if reduces_leading_axis else PLAIN_REDUCTIONS)}
    return tuple(sorted(options.items()))


# The TPUs whose compiler runs Pallas's Mosaic kernels; v2 and v3 keep XLA's attention.
MOSAIC_CHIPS = ("v4", "v5e", "v5p", "v6e")


def for_devices(devices=None) -> Runtime:
    """The runtime of programs on `devices` (a Mesh or any collection of devices; default: the default device's
    platform, all its devices), without XLA options (`Runtime.for_program` adds them): the policy's choices for
    their platform where the process's settings (`settings.chosen`) say auto, the settings' values elsewhere."""
    mesh = devices if isinstance(devices, Mesh) and devices.size > 1 else None
    devices = _device_list(devices)
    platform = devices[0].platform
    automatic = Runtime(
        platform=platform,
        devices=len(devices),
        attention=_automatic_attention(devices[0]),
        mesh=mesh,
        remat="attention_scores" if platform == "tpu" else "none",
        row_major_operands=platform == "cpu",
        split_rows=platform == "cpu",
        head_in_out=platform == "cpu",
    )
    chosen = _with_settings(automatic, settings.chosen())
    settings.announce_once(lambda: effective_settings_of(chosen))
    return chosen


# What the backward pass keeps of a whole transformer block under each `remat` (jax.checkpoint's policies): nothing
# but its input, or also the products with weights (no batch dimensions: the attention's own products are computed
# again). The other values leave blocks whole; attention_scores checkpoints the attention alone (`nn.attention`).
BLOCK_REMAT_POLICIES = {
    "block": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_block(block_of_input):
    """`block_of_input` (a transformer block applied to its input: arrays in, arrays out; anything else it reads
    closed over) as the program's runtime (`current()`) has the backward pass treat it: under `jax.checkpoint` with
    the policy of `BLOCK_REMAT_POLICIES` for its `remat`, else as it is. A forward pass alone computes the same."""
    policy = BLOCK_REMAT_POLICIES.get(current().remat)
    return block_of_input if policy is None else jax.checkpoint(block_of_input, policy=policy)


def _automatic_attention(device) -> str:
    """causal_blocks on CPUs, cudnn on GPUs, splash on the TPUs of `MOSAIC_CHIPS`, xla elsewhere."""
    if device.platform == "tpu":
        chip = topologies.chip_of(device.device_kind)
        return "splash" if chip is not None and chip.name in MOSAIC_CHIPS else "xla"
    return {"cpu": "causal_blocks", "gpu": "cudnn"}.get(device.platform, "xla")


SWITCHES = ("row_major_operands", "head_in_out", "split_rows")


def _with_settings(automatic: Runtime, chosen: settings.RuntimeSettings) -> Runtime:
    explicit = {key: value for key, value in chosen.explicit().items() if key not in settings.HOST_SETTINGS}
    return dataclasses.replace(
        automatic, **{key: value == "on" if key in SWITCHES else value for key, value in explicit.items()}
    )


def effective_settings_of(program_runtime: Runtime) -> dict:
    """Every runtime setting's value in effect for `program_runtime` and this process (none of them auto)."""
    values = {key: getattr(program_runtime, key) for key in settings.CHOICES if key not in settings.HOST_SETTINGS}
    return {**{k: ("on" if v else "off") if k in SWITCHES else v for k, v in values.items()}, **settings.host()}


def effective_settings(devices=None) -> dict:
    """`effective_settings_of` the runtime of `devices` (default: the default devices): what a run records."""
    return effective_settings_of(for_devices(devices))


def for_tokens(x_BN, dtype) -> Runtime:
    """The runtime of a program computing in `dtype` whose matrix products have a row per element of the token array
    `x_BN` (a decoder's canvas), over the devices `x_BN` is on."""
    devices_runtime = for_devices(devices_of(x_BN))
    return devices_runtime.for_program(dtype, x_BN.size // devices_runtime.devices)


def devices_of(tree):
    """The devices of the first array in `tree` committed to devices, as the Mesh it is placed on where it has one
    (None where none is: JAX then computes on the default devices)."""
    for leaf in jax.tree.leaves(tree):
        placed = isinstance(leaf, jax.Array) and leaf.committed
        if placed or (isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None):  # or compiled ahead
            sharding = leaf.sharding
            if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
                return sharding.mesh
            return sharding.device_set
    return None


def _device_list(devices) -> list:
    if devices is None:
        default = jax.config.jax_default_device
        if default is None:
            return jax.devices()
        return jax.devices(default) if isinstance(default, str) else [default]
    if isinstance(devices, jax.sharding.Mesh):
        devices = devices.devices
    return list(devices.flat) if isinstance(devices, np.ndarray) else list(devices)


# The runtime of the program being traced; JAX keys its caches on it, so one function traced under two runtimes
# compiles twice rather than reusing the first trace.
_ACTIVE = jax.make_user_context(None)


def current() -> Runtime:
    """The runtime of the program being traced under `jit` or `use`; elsewhere, that of the default devices."""
    return _ACTIVE.value or for_devices()


def use(runtime: Runtime):
    """`with use(runtime):` the layers called inside read `runtime` (`current`)."""
    return _ACTIVE(runtime)


def jit(function, runtime: Runtime, **jit_kwargs):
    """`jax.jit(function, **jit_kwargs)`, compiled with `runtime`'s XLA options and traced under `runtime`."""

    @functools.wraps(function)
    def traced(*args, **kwargs):
        with _ACTIVE(runtime):
            return function(*args, **kwargs)

    return jax.jit(traced, compiler_options=runtime.compiler_options, **jit_kwargs)


@functools.cache
def jit_once(function, runtime: Runtime, **jit_kwargs):
    """`jit(function, runtime, ...)`, made once per distinct arguments: for a module-level function jitted where it is
    called (a model's forward, a decoding program), so that JAX's cache of its compilations is kept."""
    return jit(function, runtime, **jit_kwargs)


def jit_training_step(function, runtime: Runtime, **jit_kwargs):
    """`jit(function, runtime, ...)` for a training step, called again and again. In a process tuned for training
    (`host_memory.tune_process`), its first call on a CPU compiles it ahead and has the heap keep the program's
    temporaries between calls (`host_memory.keep_temporaries`); the call that follows does not compile again."""
    return _TrainingStep(jit(function, runtime, **jit_kwargs), runtime.platform == "cpu")


class _TrainingStep:
    def __init__(self, jitted, on_cpu: bool):
        self._jitted, self._size_memory = jitted, on_cpu

    def __call__(self, *args):
        if self._size_memory:
            self._size_memory = False
            if host_memory.tuned_for_training():
                host_memory.keep_temporaries(self._jitted.lower(*args).compile())
        return self._jitted(*args)

    def __getattr__(self, name):  # lower, trace, eval_shape, ... of the jitted step
        return getattr(self._jitted, name)


def program_mesh():
    """The mesh the program being traced (`current()`) runs on: the runtime's, else the one the program sets
    (`jax.sharding.use_abstract_mesh`); None where neither is known."""
    mesh = current().mesh
    if mesh is None:
        context = jax.sharding.get_abstract_mesh()
        mesh = None if context.empty else context
    return mesh


def runs_per_device() -> bool:
    """Whether `per_device` can run a function in the program being traced: one device, or a known mesh."""
    return current().devices == 1 or program_mesh() is not None


def per_device(function, args: tuple, logical_axes: tuple):
    """`function(*args)`, run on each device's shards where the program (`current()`) runs on a mesh of several
    devices (`program_mesh`; `runs_per_device` says whether it can): a Mosaic kernel, which XLA cannot partition,
    then sees one device's rows and heads. Each argument is split by the logical names of its dimensions
    (`logical_axes`, one tuple per argument: `logical_spec`), a mesh axis left whole in every argument where it does
    not divide one of them; the result is split as the first argument."""
    if not runs_per_device():
        raise ValueError("per_device: the program runs on several devices and its mesh is not known")
    mesh = program_mesh()
    if mesh is None or mesh.size == 1:
        return function(*args)
    wanted = [logical_spec(mesh, *axes) for axes in logical_axes]
    uneven = {
        axis
        for spec, x in zip(wanted, args)
        for dim, axes in zip(x.shape, spec)
        for axis in ((axes,) if isinstance(axes, str) else axes or ())
        if dim % math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
    }
    specs = tuple(_without_axes(spec, uneven) for spec in wanted)
    sharded = jax.shard_map(function, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)
    return sharded(*args)


def _without_axes(spec, axes: set):
    """`spec` with the mesh axes `axes` taken out (those dimensions left whole over them)."""
    kept = []
    for entry in spec:
        names = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in axes)
        kept.append(None if not names else names[0] if len(names) == 1 else names)
    return jax.sharding.PartitionSpec(*kept)
