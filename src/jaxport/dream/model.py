"""Dream: Qwen2-style decoder blocks run bidirectionally, predicting masked tokens.

Mirrors upstream `DreamModel` (Hugging Face remote code): pre-norm residual blocks,
grouped KV heads with q/k/v biases, RoPE on position ids, float32 RMSNorm, SiLU MLP,
final norm and an untied (or tied) `lm_head`. Parameter paths follow the checkpoint
names (`model.layers.3.self_attn.q_proj.weight` -> `layers[3].self_attn.q_proj.weight`).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxport import runtime
from jaxport.distributed.mesh import logical_sharding
from jaxport.dream.config import DreamConfig
from jaxport.dream.decoding import diffusion_generate
from jaxport.dream.program import padding_inputs
from jaxport.nn import Attention, Embedding, Linear, RMSNorm, SwiGLU, rotary_cos_sin, take_rows


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DreamConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            causal=False,
            qkv_bias=True,
            fused_qkv=False,
            rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, fused=False, rngs=rngs)

    def __call__(self, x_BSD, cos_sin, mask, kv_cache=None, cache_index=0, rows=None):
        """`(output, (k, v))`; see `Attention.attend` for the cache. With `rows` (`[B, Q]`), the output of those
        rows only, `[B, Q, D]`: every row is a key, but a row's output depends on no other row's query."""
        attended, kv = self.self_attn.attend(
            self.input_layernorm(x_BSD), cos_sin, mask, kv_cache=kv_cache, cache_index=cache_index, query_rows=rows
        )
        x_BSD = (x_BSD if rows is None else take_rows(x_BSD, rows)) + attended
        return x_BSD + self.mlp(self.post_attention_layernorm(x_BSD)), kv


class DreamModel(nnx.Module):
    """`DreamModel`: token ids -> logits over the vocabulary at every position (no shift)."""

    def __init__(self, cfg: DreamConfig, *, dtype=jnp.float32, mesh: Mesh | None = None, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = dtype
        self.mesh = mesh
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, init_std=0.02, rngs=rngs, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, rngs=rngs)
        )

    def hidden_states(self, input_ids_BN, mask=None, position_ids_BN=None, *, all_layers: bool = False):
        """Final hidden states `[B, N, D]` (after the last RMSNorm).

        `mask` is boolean, `[B, N]` (key padding) or `[B, 1, N, N]`; `None` attends everywhere.
        With `all_layers`, also the list upstream's `output_hidden_states` gives: the
        embeddings, the output of every layer but the last, then the final normed state.
        """
        h_BND, states, _ = self._decode(input_ids_BN, mask, position_ids_BN)
        return (h_BND, states[:-1] + [h_BND]) if all_layers else h_BND

    def hidden_states_cached(
        self, input_ids_BS, mask=None, position_ids_BS=None, kv_cache=None, cache_index=0, *, rows=None, cos_sin=None
    ):
        """`(hidden states [B, S, D], kv_cache)`, where `kv_cache` holds every layer's rotated keys and
        values `([B, K, T, Dh], [B, K, T, Dh])` over the whole canvas, heads first.

        Without `kv_cache` the `S` tokens are the whole canvas (`T = S`), as `hidden_states`. With one
        (from an earlier call), they are canvas positions `cache_index ..` (one index for the batch, or one per
        row `[B]`): each layer attends over the cached keys/values with this window's fresh ones written in (an
        approximate cache: the other positions keep the states of the canvas they were computed from). `mask`
        then covers the window's queries against all `T` keys (`[B, T]` key padding, or `[B, 1, S, T]`).
        With `rows` (`[B, Q]`, without `kv_cache`), the hidden states of those rows only, `[B, Q, D]`, as
        `hidden_states_at`: the cache still holds every layer's keys and values at every position. `cos_sin`: the
        rotary tables of the positions (`rotary_tables`), in place of `position_ids_BS`.
        """
        h_BSD, _, kv_cache = self._decode(input_ids_BS, mask, position_ids_BS, kv_cache, cache_index, rows, cos_sin)
        return h_BSD, kv_cache

    def hidden_states_at(self, input_ids_BN, mask=None, position_ids_BN=None, *, cos_sin=None):
        """`rows_BQ -> [B, Q, D]`: the final hidden states of `hidden_states(...)` at the rows `rows_BQ`, for a caller
        that needs a few of them (exact decoding scores only its masked positions). Every layer but the last runs
        here, once, on all rows; the last layer's queries, attention output and MLP and the final norm run on the
        rows asked only, since no other row's output depends on them (its keys and values come from every row).
        `cos_sin` as in `hidden_states_cached`."""
        x_BND, cos_sin = self._embed(input_ids_BN, position_ids_BN, cos_sin)
        *layers, last = self.layers
        for layer in layers:
            x_BND = runtime.remat_block(lambda x, layer=layer: layer(x, cos_sin, mask)[0])(x_BND)
        return lambda rows_BQ: self.norm(last(x_BND, cos_sin, mask, rows=rows_BQ)[0])

    def rotary_tables(self, position_ids_BS):
        """The rotary `(cos, sin)` of these positions, `[B, S, head_dim]` each. A decoding loop makes them once,
        before it, and passes them in: made in the loop, XLA recomputes them in every layer's fused products."""
        # Upstream computes cos/sin in float32 and casts them to the activation dtype.
        cos, sin = rotary_cos_sin(self.config.head_dim, position_ids_BS, self.config.rope_theta)
        return cos.astype(self.dtype), sin.astype(self.dtype)

    def _embed(self, input_ids_BS, position_ids_BS, cos_sin=None):
        """The token embeddings and the rotary tables of their positions (`0..S-1` without `position_ids_BS`), or
        `cos_sin` when given."""
        B, S = input_ids_BS.shape
        if cos_sin is None and position_ids_BS is None:
            position_ids_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        return self.embed_tokens(input_ids_BS), self.rotary_tables(position_ids_BS) if cos_sin is None else cos_sin

    def _decode(self, input_ids_BS, mask, position_ids_BS, kv_cache=None, cache_index=0, rows=None, cos_sin=None):
        """`(final hidden states, every layer's input and output, every layer's keys/values)`; with `rows` the last
        layer's queries, output and MLP run at those rows only."""
        x_BSD, cos_sin = self._embed(input_ids_BS, position_ids_BS, cos_sin)
        states, new_cache = [x_BSD], []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cached, layer_rows = None if kv_cache is None else kv_cache[i], rows if i == last else None
            x_BSD, kv = runtime.remat_block(
                lambda x, layer=layer, c=cached, r=layer_rows: layer(x, cos_sin, mask, c, cache_index, rows=r)
            )(x_BSD)
            states.append(x_BSD)
            new_cache.append(kv)
        return self.norm(x_BSD), states, new_cache

    def head(self, h_BND: jax.Array, table_DV: jax.Array | None = None) -> jax.Array:
        """The logits `[B, N, V]`; with `table_DV` (`head_table_DV`'s copy of the weight), read from that layout."""
        if table_DV is not None:  # the same product and rounding as below, the weight read as [D, V]
            accumulate = None if self.lm_head is None else jnp.float32
            logits = jnp.einsum("bnd,dv->bnv", h_BND, table_DV.astype(h_BND.dtype), preferred_element_type=accumulate)
            return logits.astype(h_BND.dtype)
        if self.lm_head is None:
            table = self.embed_tokens.embedding_weight[...].astype(h_BND.dtype)
            return jnp.einsum("bnd,vd->bnv", h_BND, table)
        return self.lm_head(h_BND)

    def head_table_DV(self) -> jax.Array:
        """The vocabulary projection's weight written out as `[D, V]` (compiled; `head`'s `table_DV`)."""
        table_VD = (self.embed_tokens.embedding_weight if self.lm_head is None else self.lm_head.weight)[...]
        return _transposed(table_VD)

    def forward(self, input_ids_BN, attention_mask=None, position_ids_BN=None, *, output_hidden_states=False):
        """Traceable forward. A 2-D `attention_mask` (1 = token, 0 = padding) is expanded as upstream's
        sampler does; a 4-D boolean one is used as given, with `position_ids_BN` or `0..N-1`."""
        B, N = input_ids_BN.shape
        mask = attention_mask
        if attention_mask is not None and attention_mask.ndim == 2:
            mask, derived_positions = padding_inputs(attention_mask, B, N)
            position_ids_BN = derived_positions if position_ids_BN is None else position_ids_BN
        elif attention_mask is not None:
            mask = attention_mask.astype(bool)
        if output_hidden_states:
            h_BND, states = self.hidden_states(input_ids_BN, mask, position_ids_BN, all_layers=True)
            return self.head(h_BND), states
        return self.head(self.hidden_states(input_ids_BN, mask, position_ids_BN))

    def place_batch(self, *arrays):
        """Put `[B, ...]` host arrays on the model's mesh, split over its batch axes when B divides."""
        # one transfer call for all: each call waits for a thread that the running program keeps busy
        if self.mesh is None:
            return jax.device_put(list(arrays))
        return jax.device_put(
            list(arrays), [None if a is None else batch_sharding(self.mesh, np.shape(a)) for a in arrays]
        )

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, output_hidden_states=False):
        """Raw logits `[B, N, V]` in the model dtype, as `DreamModel(...).logits` (compiled; position `j`
        scores the token at `j` from the hidden state at `j`; the sampler shifts by one)."""
        input_ids, attention_mask, position_ids = self.place_batch(
            np.asarray(input_ids, np.int32),
            attention_mask,
            None if position_ids is None else np.asarray(position_ids, np.int32),
        )
        forward = runtime.jit_once(_forward, runtime.for_tokens(input_ids, self.dtype), static_argnums=(0, 5))
        return forward(*nnx.split(self), input_ids, attention_mask, position_ids, output_hidden_states)

    def diffusion_generate(self, input_ids, attention_mask=None, **kwargs):
        """Masked-diffusion generation with upstream's arguments; see `jaxport.dream.decoding.diffusion_generate`."""
        return diffusion_generate(self, input_ids, attention_mask, **kwargs)


def _forward(graphdef, state, input_ids, attention_mask, position_ids, output_hidden_states):
    return nnx.merge(graphdef, state).forward(
        input_ids, attention_mask, position_ids, output_hidden_states=output_hidden_states
    )


@jax.jit
def _transposed(a):
    return a.T


def batch_sharding(mesh: Mesh, shape: tuple) -> NamedSharding:
    sharding = logical_sharding(mesh, "batch", *([None] * (len(shape) - 1)))
    axes = sharding.spec[0]
    devices = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else (axes or ())))
    return sharding if shape[0] % devices == 0 else NamedSharding(mesh, PartitionSpec())
