"""The runtime policy: decided from a program's devices, dtype and size, applied where the program is jitted, and
read by the layers while it is traced (not from `jax.default_backend()`)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxport import runtime
from jaxport.nn import Linear
from jaxport.runtime import policy

CPU_OPTIONS = {policy.YNN_FUSION_TYPES: policy.INDIVIDUAL_DOTS, **policy.PLAIN_REDUCTIONS}


def test_decisions_follow_the_devices_dtype_and_rows():
    cpu = runtime.for_devices(jax.devices("cpu"))
    assert cpu == runtime.Runtime(platform="cpu", devices=jax.device_count())  # causal blocks, row-major, chunks
    assert cpu.for_program(jnp.float32, 768).compiler_options == CPU_OPTIONS
    assert cpu.for_program(jnp.float32, 768, reduces_leading_axis=True).compiler_options == {
        policy.YNN_FUSION_TYPES: policy.INDIVIDUAL_DOTS
    }
    assert cpu.for_program(jnp.float32, 16384).compiler_options == {policy.YNN_FUSION_TYPES: ""}
    assert cpu.for_program(jnp.bfloat16, 16384).compiler_options == {policy.YNN_FUSION_TYPES: policy.INDIVIDUAL_DOTS}
    gpu = runtime.Runtime(platform="gpu", devices=8, attention="cudnn", row_major_operands=False, split_rows=False)
    assert gpu.for_program(jnp.bfloat16, 768).compiler_options is None
    assert gpu.row_chunks(64) == 1


def test_row_chunks_split_each_device_s_rows_in_two_on_a_cpu():
    cpu = runtime.Runtime(platform="cpu", devices=2)
    assert cpu.row_chunks(12, tokens_per_row=64) == 2  # nanoGPT README's CPU config on each of two devices
    assert cpu.row_chunks(128, tokens_per_row=256) == 1  # 64 rows of 256 tokens per device: a large step
    assert cpu.row_chunks(6, tokens_per_row=64) == 1  # 3 rows per device do not split evenly
    assert cpu.row_chunks(64, min_rows_per_device=16) == 2
    assert cpu.row_chunks(16, min_rows_per_device=16) == 1


def test_layers_read_the_runtime_of_the_program_they_are_traced_in():
    """One function jitted for a CPU and for a GPU runtime in the same process: each trace takes its own layouts
    (the runtime is part of JAX's cache key), whatever the default backend is."""
    layer = Linear(32, 48, bias=False, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(96, 32)), jnp.bfloat16)
    graphdef, state = nnx.split(layer)

    def weight_grad(state, x):
        return jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x).astype(jnp.float32) ** 2))(state)

    gpu = runtime.Runtime(platform="gpu", attention="cudnn", row_major_operands=False, split_rows=False)
    seen = []
    for step_runtime in (runtime.for_devices(jax.devices("cpu")).for_program(jnp.bfloat16, 96), gpu):
        jitted = runtime.jit(lambda s, x: (seen.append(runtime.current()), weight_grad(s, x))[1], step_runtime)
        seen.append(jitted.lower(state, x).as_text())
    cpu_runtime, cpu_text, gpu_runtime, gpu_text = seen
    assert cpu_runtime.platform == "cpu" and gpu_runtime == gpu
    assert "optimization_barrier" in cpu_text and "optimization_barrier" not in gpu_text
    assert runtime.current() == runtime.for_devices()  # outside a program: the default devices'


def test_the_runtime_comes_from_the_program_s_devices_not_the_default_backend():
    """`--device=cpu` on a machine with a GPU: the mesh's devices decide, whatever JAX's default backend is."""
    a_gpu = types.SimpleNamespace(platform="gpu")
    assert runtime.for_devices([a_gpu, a_gpu]).attention == "cudnn"
    assert runtime.for_devices([a_gpu]).for_program(jnp.float32, 768).compiler_options is None
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:1]), ("data",))
    assert runtime.for_devices(mesh) == runtime.Runtime(platform="cpu", devices=1)
    canvas = jax.device_put(np.zeros((4, 4096), np.int32), jax.devices("cpu")[0])  # a decoder's: 16384 token rows
    assert runtime.for_tokens(canvas, jnp.float32).compiler_options == {policy.YNN_FUSION_TYPES: ""}
