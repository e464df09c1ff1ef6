"""Tiny Recursive Model (TRM) with ACT halting and its loss head, as upstream's
`TinyRecursiveReasoningModel_ACTV1` wrapped in `ACTLossHead`.

    model = TRM(config, rngs=nnx.Rngs(0))
    carry = model.initial_carry(batch)
    carry, loss, metrics, outputs, all_finish = model(carry, batch)

Shapes: B batch, S = puzzle positions P + seq_len positions, D hidden.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxport import runtime
from jaxport.errors import JaxportError
from jaxport.nn import (
    Attention,
    Embedding,
    Linear,
    SwiGLU,
    rms_norm,
    rotary_cos_sin,
    swiglu_intermediate_size,
    truncated_normal,
)
from jaxport.nn.chunks import in_row_chunks
from jaxport.trm.config import TRMConfig
from jaxport.trm.losses import act_loss_and_metrics

BATCH_KEYS = ("inputs", "labels", "puzzle_identifiers")


class Buffer(nnx.Variable):
    """Persistent state that is not trained by the optimiser (upstream registers these as buffers)."""


@struct.dataclass
class InnerCarry:
    z_H: jax.Array  # [B, S, D] forward dtype
    z_L: jax.Array


@struct.dataclass
class Carry:
    inner_carry: InnerCarry
    steps: jax.Array  # [B] int32
    halted: jax.Array  # [B] bool
    current_data: dict  # BATCH_KEYS -> the rows each carry slot is working on


def sequence_major() -> bool:
    """Whether a recursion with mlp_t runs sequence-major, `[S, B, D]`: on one device, where the token mixing's
    products then take the sequence axis as it lies and the channel products see rows `[S*B, D]`, where `[B, S, D]`
    needs two transposes per block each way (docs/performance.md, "Sequence-major mlp_t"). Across devices the batch
    stays leading: rows `[S*B, D]` interleave the devices' rows, which XLA splits only by gathering the whole batch
    onto every device; each block then turns to `[S, B, D]` for its token mixing alone, whose `[S, B*D]` operand keeps
    each device's rows together."""
    return runtime.current().devices == 1


class Block(nnx.Module):
    """Post-norm block: attention (or an MLP across the sequence, `mlp_t`) then a SwiGLU."""

    def __init__(self, config: TRMConfig, rngs: nnx.Rngs):
        self.eps = config.rms_norm_eps
        if config.mlp_t:
            seq = config.seq_len + config.num_puzzle_positions
            self.mlp_t = SwiGLU(seq, swiglu_intermediate_size(seq, config.expansion), rngs=rngs)
        else:
            self.self_attn = Attention(config.hidden_size, config.num_heads, causal=False, rngs=rngs)
        self.mlp = SwiGLU(config.hidden_size, swiglu_intermediate_size(config.hidden_size, config.expansion), rngs=rngs)

    def __call__(self, h, cos_sin):
        """`h`: [B, S, D], or with mlp_t on one device [S, B, D] (the recursion's layout, see `sequence_major`)."""
        if hasattr(self, "mlp_t"):
            to_SBD = (lambda a: a) if sequence_major() else (lambda a: a.swapaxes(0, 1))  # its own inverse
            h_SBD = to_SBD(h)
            h = to_SBD(rms_norm(h_SBD + self.mlp_t(h_SBD, axis=0), self.eps, axis=0))  # mixed and normalised over S
        else:
            h = rms_norm(h + self.self_attn(h, cos_sin), self.eps)
        return rms_norm(h + self.mlp(h), self.eps)


class ReasoningModule(nnx.Module):
    """`L_level`: add the injection to the state, then run the blocks (in the recursion's layout, see `Block`)."""

    def __init__(self, config: TRMConfig, rngs: nnx.Rngs):
        self.layers = nnx.List([Block(config, rngs) for _ in range(config.L_layers)])

    def __call__(self, h, injection, cos_sin):
        h = h + injection
        for layer in self.layers:
            h = runtime.remat_block(lambda h, layer=layer: layer(h, cos_sin))(h)
        return h


class SparsePuzzleEmbedding(nnx.Module):
    """Per-puzzle embedding table, trained by sign-SGD on the rows in the batch only.

    The table is a Buffer, not a Param: gradients are taken with respect to the rows
    gathered for the batch (upstream's `local_weights`), see `TRM.loss_and_grad`.
    """

    def __init__(self, num: int, dim: int):
        self.weights = Buffer(jnp.zeros((num, dim), jnp.float32))  # upstream init_std=0

    def __call__(self, ids_B):
        return jnp.take(self.weights[...], ids_B, axis=0)


class TRMInner(nnx.Module):
    """One ACT step: embed, recurse H_cycles x (L_cycles z_L updates + one z_H update), read out."""

    def __init__(self, config: TRMConfig, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(config.forward_dtype)
        self.num_puzzle_positions = config.num_puzzle_positions
        embed_std = 1.0 / math.sqrt(config.hidden_size)
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, init_std=embed_std, dtype=self.dtype, rngs=rngs
        )
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, rngs=rngs)
        self.q_head = Linear(config.hidden_size, 2, bias=True, rngs=rngs)
        # Upstream starts with "never halt early": zero weights, bias -5.
        self.q_head.weight[...] = jnp.zeros_like(self.q_head.weight[...])
        self.q_head.bias[...] = jnp.full((2,), -5.0, jnp.float32)
        if config.puzzle_emb_ndim > 0:
            self.puzzle_emb = SparsePuzzleEmbedding(config.num_puzzle_identifiers, config.puzzle_emb_ndim)
        if config.pos_encodings == "learned":
            self.embed_pos = Embedding(
                config.seq_len + self.num_puzzle_positions,
                config.hidden_size,
                init_std=embed_std,
                dtype=self.dtype,
                rngs=rngs,
            )
        self.L_level = ReasoningModule(config, rngs)
        self.H_init = Buffer(truncated_normal(1.0)(rngs.params(), (config.hidden_size,), self.dtype))
        self.L_init = Buffer(truncated_normal(1.0)(rngs.params(), (config.hidden_size,), self.dtype))

    def input_embeddings(self, inputs_BL, puzzle_rows_BE):
        config = self.config
        x_BSD = self.embed_tokens(inputs_BL.astype(jnp.int32))
        if puzzle_rows_BE is not None:
            B = inputs_BL.shape[0]
            pad = self.num_puzzle_positions * config.hidden_size - puzzle_rows_BE.shape[-1]
            puzzle_BE = jnp.pad(puzzle_rows_BE.astype(self.dtype), ((0, 0), (0, pad)))
            x_BSD = jnp.concatenate(
                [puzzle_BE.reshape(B, self.num_puzzle_positions, config.hidden_size), x_BSD], axis=1
            )
        if config.pos_encodings == "learned":
            x_BSD = 0.707106781 * (x_BSD + self.embed_pos.embedding_weight[...].astype(self.dtype))
        return math.sqrt(config.hidden_size) * x_BSD

    def cos_sin(self, num_positions: int):
        if self.config.pos_encodings != "rope":
            return None
        return rotary_cos_sin(
            self.config.hidden_size // self.config.num_heads, jnp.arange(num_positions), self.config.rope_theta
        )

    def reset(self, reset_B, carry: InnerCarry) -> InnerCarry:
        reset_B11 = reset_B[:, None, None]
        return InnerCarry(
            z_H=jnp.where(reset_B11, self.H_init[...], carry.z_H), z_L=jnp.where(reset_B11, self.L_init[...], carry.z_L)
        )

    def recurse(self, z_H, z_L, x, cos_sin, unroll: bool):
        """One H cycle: L_cycles updates of z_L from (z_H + input), then z_H from z_L."""

        def l_step(_, z_L):
            return self.L_level(z_L, z_H + x, cos_sin)

        if unroll:
            for _ in range(self.config.L_cycles):
                z_L = l_step(None, z_L)
        else:
            z_L = jax.lax.fori_loop(0, self.config.L_cycles, l_step, z_L)
        return self.L_level(z_H, z_L, cos_sin), z_L

    def reason(self, z_H, z_L, x, cos_sin, unroll: bool):
        # H_cycles - 1 cycles without gradient, then one with: gradients see only the last cycle.
        if unroll:
            for _ in range(self.config.H_cycles - 1):
                z_H, z_L = self.recurse(z_H, z_L, x, cos_sin, unroll)
        else:
            z_H, z_L = jax.lax.fori_loop(
                0, self.config.H_cycles - 1, lambda _, z: self.recurse(*z, x, cos_sin, unroll), (z_H, z_L)
            )
        z_H, z_L = jax.lax.stop_gradient(z_H), jax.lax.stop_gradient(z_L)
        return self.recurse(z_H, z_L, x, cos_sin, unroll)

    def __call__(self, carry: InnerCarry, data: dict, puzzle_rows_BE, unroll: bool = True, row_chunks: int = 1):
        x_BSD = self.input_embeddings(data["inputs"], puzzle_rows_BE)
        cos_sin = self.cos_sin(x_BSD.shape[1])

        swap = self.config.mlp_t and sequence_major()
        layout = (lambda a: a.swapaxes(0, 1)) if swap else (lambda a: a)  # its own inverse

        def reason(z_H, z_L, x):
            z_H, z_L = self.reason(layout(z_H), layout(z_L), layout(x), cos_sin, unroll)
            return layout(z_H), layout(z_L)

        # Rows are independent until the loss, so the recursion may run on row chunks (see TRM.chunks_for).
        z_H, z_L = in_row_chunks(reason, row_chunks, carry.z_H, carry.z_L, x_BSD)
        logits_BLV = self.lm_head(z_H)[:, self.num_puzzle_positions :]
        q_B2 = self.q_head(z_H[:, 0]).astype(jnp.float32)
        new_carry = InnerCarry(z_H=jax.lax.stop_gradient(z_H), z_L=jax.lax.stop_gradient(z_L))
        return new_carry, logits_BLV, q_B2[:, 0], q_B2[:, 1]


class TRM(nnx.Module):
    """ACT wrapper and loss head. `train()` / `eval()` switch halting modes as in PyTorch."""

    def __init__(self, config: TRMConfig, *, rngs: nnx.Rngs, unroll_cycles: bool = True, row_chunks: int | None = None):
        if config.seq_len is None and (config.mlp_t or config.pos_encodings == "learned"):
            raise JaxportError(
                "arch.mlp_t and learned positions have the sequence length in their weights: "
                "give seq_len (it comes from the dataset's dataset.json)"
            )
        self.config = config
        self.inner = TRMInner(config, rngs)
        self.halt_rng = nnx.Rngs(halt=rngs.params())
        self.unroll_cycles = unroll_cycles
        self.row_chunks = row_chunks
        self.deterministic = False  # nnx's train()/eval() flag: True in eval mode

    def chunks_for(self, batch_size: int, step_runtime: runtime.Runtime | None = None) -> int:
        """Row chunks the recursion runs in (`nn.in_row_chunks`): `row_chunks` if given, else what the runtime of the
        program (`runtime.current()`) chooses for devices that hold 16 or more rows each. Each chunk compiles
        separately."""
        if self.row_chunks is not None:
            if batch_size % self.row_chunks:
                raise JaxportError(f"row_chunks={self.row_chunks} does not divide the batch of {batch_size} rows")
            return self.row_chunks
        return (step_runtime or runtime.current()).row_chunks(batch_size, min_rows_per_device=16)

    def runtime_for(self, inputs_shape: tuple[int, int], devices=None) -> runtime.Runtime:
        """The runtime of a program that runs this model on a batch of `inputs_shape` ([B, L]) across `devices`
        (default: the default devices): its products have the rows of one chunk of one device's batch, puzzle
        positions included, and with mlp_t its norms reduce the sequence, the leading axis of the recursion's
        layout (`TRMInner.__call__`)."""
        devices_runtime = runtime.for_devices(devices)
        batch_size, length = inputs_shape
        per_chunk = batch_size // devices_runtime.devices // self.chunks_for(batch_size, devices_runtime)
        rows = per_chunk * (length + self.config.num_puzzle_positions)
        return devices_runtime.for_program(self.config.forward_dtype, rows, reduces_leading_axis=self.config.mlp_t)

    @property
    def training(self) -> bool:
        return not self.deterministic

    def initial_carry(self, batch: dict) -> Carry:
        """All rows halted, so the first call loads every row of its batch and resets the state."""
        inputs = jnp.asarray(batch["inputs"])
        B, L = inputs.shape
        shape = (
            B,
            L + (self.inner.num_puzzle_positions if self.config.puzzle_emb_ndim > 0 else 0),
            self.config.hidden_size,
        )
        return Carry(
            inner_carry=InnerCarry(z_H=jnp.zeros(shape, self.inner.dtype), z_L=jnp.zeros(shape, self.inner.dtype)),
            steps=jnp.zeros((B,), jnp.int32),
            halted=jnp.ones((B,), bool),
            current_data={k: jnp.zeros_like(jnp.asarray(batch[k])) for k in BATCH_KEYS},
        )

    def load_rows(self, carry: Carry, batch: dict):
        """Rows that halted take the new batch's data and the initial state; the others continue."""
        halted = carry.halted
        data = {
            k: jnp.where(halted.reshape((-1,) + (1,) * (jnp.ndim(batch[k]) - 1)), jnp.asarray(batch[k]), v)
            for k, v in carry.current_data.items()
        }
        return self.inner.reset(halted, carry.inner_carry), jnp.where(halted, 0, carry.steps), data

    def puzzle_rows(self, data: dict):
        """The puzzle-embedding rows of the batch (upstream's `local_weights`)."""
        return self.inner.puzzle_emb(data["puzzle_identifiers"]) if hasattr(self.inner, "puzzle_emb") else None

    def step(self, inner_carry, steps, data, puzzle_rows_BE, halt_key=None):
        """The ACT step after `load_rows`: run the inner model and decide which rows halt."""
        config = self.config
        row_chunks = self.chunks_for(steps.shape[0])
        inner_carry, logits, q_halt, q_continue = self.inner(
            inner_carry, data, puzzle_rows_BE, self.unroll_cycles, row_chunks
        )
        outputs = {"logits": logits, "q_halt_logits": q_halt, "q_continue_logits": q_continue}
        steps = steps + 1
        is_last_step = steps >= config.halt_max_steps
        halted = is_last_step
        if self.training and config.halt_max_steps > 1:
            halted = halted | (q_halt > 0 if config.no_ACT_continue else q_halt > q_continue)
            # Exploration: each row independently gets a random minimum number of steps.
            explore_key, steps_key = jax.random.split(halt_key)
            explore = jax.random.uniform(explore_key, q_halt.shape) < config.halt_exploration_prob
            min_halt_steps = explore * jax.random.randint(steps_key, steps.shape, 2, config.halt_max_steps + 1)
            halted = halted & (steps >= min_halt_steps)
            if not config.no_ACT_continue:
                # Q-learning target from the next step, as the paper describes.
                _, _, next_q_halt, next_q_continue = self.inner(
                    inner_carry, data, puzzle_rows_BE, self.unroll_cycles, row_chunks
                )
                target = jnp.where(is_last_step, next_q_halt, jnp.maximum(next_q_halt, next_q_continue))
                outputs["target_q_continue"] = jax.lax.stop_gradient(jax.nn.sigmoid(target))
        return Carry(inner_carry, steps, halted, data), outputs

    def forward(self, carry: Carry, batch: dict, halt_key=None):
        """Pure ACT call with the loss head; `__call__` is its jitted form."""
        if halt_key is None and self.training:
            halt_key = self.halt_rng.halt()
        inner_carry, steps, data = self.load_rows(carry, batch)
        carry, outputs = self.step(inner_carry, steps, data, self.puzzle_rows(data), halt_key)
        loss, metrics, outputs = act_loss_and_metrics(carry, outputs, self.config.loss_type)
        return carry, loss, metrics, outputs, jnp.all(carry.halted)

    def __call__(self, carry: Carry, batch: dict):
        """`forward`, compiled; the halting RNG's new state is written back to the module."""
        batch = {k: jnp.asarray(batch[k]) for k in BATCH_KEYS}
        graphdef, state = nnx.split(self)
        forward = runtime.jit_once(
            _forward, self.runtime_for(batch["inputs"].shape, runtime.devices_of(state)), static_argnames="graphdef"
        )
        outputs, state = forward(graphdef, state, carry, batch)
        nnx.update(self, state)
        return outputs


def _forward(graphdef, state, carry: Carry, batch: dict):
    model = nnx.merge(graphdef, state)
    return model.forward(carry, batch), nnx.state(model)


def loss_and_grad(model: TRM, carry: Carry, batch: dict, global_batch_size: int, halt_key=None):
    """One training-mode ACT call and the gradient of `loss / global_batch_size` (upstream's
    backward) with respect to the Params and to the batch's puzzle-embedding rows.

    Returns `(carry, loss, metrics, outputs), (param_grads, puzzle_row_grads)`.
    """
    if halt_key is None and model.training:
        halt_key = model.halt_rng.halt()
    inner_carry, steps, data = model.load_rows(carry, batch)
    rows = model.puzzle_rows(data)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def scaled_loss(params, rows):
        m = nnx.merge(graphdef, params, rest)
        new_carry, outputs = m.step(inner_carry, steps, data, rows, halt_key)
        loss, metrics, outputs = act_loss_and_metrics(new_carry, outputs, m.config.loss_type)
        return loss / global_batch_size, (new_carry, loss, metrics, outputs)

    (_, aux), grads = jax.value_and_grad(scaled_loss, argnums=(0, 1), has_aux=True)(params, rows)
    return aux, grads
