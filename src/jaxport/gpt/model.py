"""nanoGPT's GPT-2 style language model in Flax NNX.

Parameters keep nanoGPT's names and PyTorch layouts (`Linear.weight` is `[out, in]`), so
a `ckpt.pt` state dict maps onto `nnx.state(model)` one to one (see params.py). The
language-model head is tied to `wte`, as in nanoGPT: it is `wte` itself, not a copy.

Dropout is functional: it is applied only when `rng` is passed (nanoGPT's train mode);
without `rng` the model runs as nanoGPT's `model.eval()`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxport import runtime
from jaxport.distributed import logical_constraint
from jaxport.errors import JaxportError
from jaxport.gpt import params
from jaxport.gpt.config import GPTConfig
from jaxport.nn import Linear, add_positions, dot_product_attention, dropout, gelu, label_entries
from jaxport.nn.chunks import in_row_chunks

A100_BF16_PEAK = 312e12  # the figure nanoGPT's estimate_mfu divides by


class LayerNorm(nnx.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False), eps 1e-5, float32 statistics."""

    def __init__(self, ndim: int, bias: bool):
        self.weight = nnx.Param(jnp.ones((ndim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((ndim,), jnp.float32)) if bias else None

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * self.weight[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        C = config.n_embd
        self.c_attn = Linear(C, 3 * C, bias=config.bias, rngs=rngs)  # q, k, v in that order
        self.c_proj = Linear(C, C, bias=config.bias, rngs=rngs)
        self.n_head, self.dropout = config.n_head, config.dropout

    def __call__(self, x_BTC, rng=None, cache=None, pos=None):
        """`cache=(k, v)` of shape [B, block_size, H, D] holds earlier positions; `x_BTC`
        then sits at positions pos..pos+T-1 and the updated cache is returned."""
        B, T, C = x_BTC.shape
        H, D = self.n_head, C // self.n_head
        q, k, v = jnp.split(self.c_attn(x_BTC).reshape(B, T, 3 * H, D), 3, axis=2)
        rngs = jax.random.split(rng, 2) if rng is not None else (None, None)
        if cache is not None:
            k = jax.lax.dynamic_update_slice(cache[0], k, (0, pos, 0, 0))
            v = jax.lax.dynamic_update_slice(cache[1], v, (0, pos, 0, 0))
            cache = (k, v)
            key_pos = jnp.arange(k.shape[1])
            allowed = key_pos[None, :] <= pos + jnp.arange(T)[:, None]  # also hides unfilled slots
            y = dot_product_attention(q, k, v, mask=allowed[None])  # [1, T, block_size]: same for every row
        else:  # nanoGPT's SDPA(is_causal=True, dropout_p=dropout if training)
            y = dot_product_attention(q, k, v, causal=True, dropout_rate=self.dropout, dropout_rng=rngs[0])
        y = dropout(self.c_proj(y.reshape(B, T, C)), self.dropout, rngs[1])
        return y, cache


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias, rngs=rngs)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias, rngs=rngs)
        self.dropout = config.dropout

    def __call__(self, x, rng=None):
        # nanoGPT's nn.GELU() is the exact erf form, not GPT-2's tanh approximation.
        return dropout(self.c_proj(gelu(self.c_fc(x))), self.dropout, rng)


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config, rngs)
        self.ln_2 = LayerNorm(config.n_embd, config.bias)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, rng=None, cache=None, pos=None):
        rngs = jax.random.split(rng, 2) if rng is not None else (None, None)
        y, cache = self.attn(self.ln_1(x), rngs[0], cache, pos)
        x = x + y
        return x + self.mlp(self.ln_2(x), rngs[1]), cache


def _row_chunks(batch: int, length: int) -> int:
    """Row chunks for the blocks without dropout (`nn.in_row_chunks`), as the program's runtime chooses for rows of
    `length` tokens (`runtime.current()`: docs/performance.md, "Row chunks"). Dropout masks depend on a row's place in
    the whole batch, so a run with dropout keeps one chunk."""
    return runtime.current().row_chunks(batch, tokens_per_row=length)


def cross_entropy(logits_BTV, targets_BT):
    """Mean next-token cross-entropy over targets != -1 (nanoGPT's ignore_index=-1)."""
    valid = targets_BT != -1
    logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll = -label_entries(logp, jnp.where(valid, targets_BT, 0))
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.sum(valid)


class GPT(nnx.Module):
    """nanoGPT's `GPT`. `model(idx, targets)` returns `(logits, loss)` like nanoGPT's forward."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = config
        self.dtype = dtype  # compute dtype; parameters stay float32
        C = config.n_embd
        self.wte = nnx.Param(0.02 * jax.random.normal(rngs.params(), (config.vocab_size, C)))  # = lm_head
        self.wpe = nnx.Param(0.02 * jax.random.normal(rngs.params(), (config.block_size, C)))
        self.h = nnx.List([Block(config, rngs) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(C, config.bias)
        # nanoGPT's init: N(0, 0.02) linears, zero biases, and GPT-2's scaled init of the
        # residual projections, N(0, 0.02/sqrt(2 n_layer)).
        for path, linear in nnx.iter_graph(self):
            if isinstance(linear, Linear):
                std = 0.02 / math.sqrt(2 * config.n_layer) if path[-1] == "c_proj" else 0.02
                linear.weight[...] = std * jax.random.normal(rngs.params(), linear.weight.shape, jnp.float32)

    # -- forward ---------------------------------------------------------------------------
    def _check_length(self, T: int):
        if T > self.config.block_size:
            raise JaxportError(f"cannot forward a sequence of length {T}: block_size is only {self.config.block_size}")

    def hidden_states(self, idx_BT, rng=None, cache=None, pos=0):
        T = idx_BT.shape[1]
        rngs = jax.random.split(rng, self.config.n_layer + 1) if rng is not None else [None] * (self.config.n_layer + 1)
        positions = pos + jnp.arange(T)
        x = add_positions(jnp.take(self.wte[...], idx_BT, axis=0), jnp.take(self.wpe[...], positions, axis=0))
        # rows split over the mesh, each row's embedding whole (the weights' `embed` is what FSDP splits)
        x = logical_constraint(x.astype(self.dtype), "batch", "seq", "activation_embed")
        x = dropout(x, self.config.dropout, rngs[-1])
        if cache is None and rng is None:
            x = in_row_chunks(self._blocks, _row_chunks(*idx_BT.shape), x)
            return self.ln_f(x), None
        new_cache = []
        for i, block in enumerate(self.h):
            layer_cache = None if cache is None else cache[i]
            x, layer_cache = runtime.remat_block(lambda x, b=block, i=i, c=layer_cache: b(x, rngs[i], c, pos))(x)
            new_cache.append(layer_cache)
        return self.ln_f(x), (new_cache if cache is not None else None)

    def _blocks(self, x_BTC):
        for block in self.h:
            x_BTC = runtime.remat_block(lambda x, b=block: b(x)[0])(x_BTC)
        return x_BTC

    def lm_head(self, x_BTC):
        B, T, C = x_BTC.shape
        # logits in the compute dtype, as under nanoGPT's autocast; the loss takes them in float32
        logits = jax.lax.dot_general(
            x_BTC.reshape(B * T, C), self.wte[...].astype(x_BTC.dtype), (((1,), (1,)), ((), ()))
        )
        return logits.reshape(B, T, -1).astype(jnp.float32)

    def __call__(self, idx, targets=None, rng=None):
        idx = jnp.asarray(idx, jnp.int32)
        self._check_length(idx.shape[1])
        targets = None if targets is None else jnp.asarray(targets, jnp.int32)
        graphdef, state = nnx.split(self)
        forward = runtime.jit_once(_forward, runtime.for_tokens(idx, self.dtype), static_argnames=("graphdef",))
        return forward(graphdef, state, idx, targets, rng)

    def forward(self, idx, targets=None, rng=None):
        """`__call__` without its jit, for use inside a traced function (e.g. a train step)."""
        x, _ = self.hidden_states(idx, rng)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None  # inference: only the last position
        logits = self.lm_head(x)
        return logits, cross_entropy(logits, targets)

    @classmethod
    def init(cls, config: GPTConfig, seed: int = 0, dtype=jnp.float32) -> GPT:
        """A freshly initialised model, built in one compiled program (eager init is slow)."""
        return nnx.jit(lambda: cls(config, rngs=nnx.Rngs(seed), dtype=dtype))()

    @classmethod
    def abstract(cls, config: GPTConfig, dtype=jnp.float32) -> GPT:
        """The model's structure with shapes only, for loading weights into (no init cost)."""
        return nnx.eval_shape(lambda: cls(config, dtype=dtype))

    # -- nanoGPT utilities -------------------------------------------------------------------
    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (the tied lm_head counted once); position embeddings are
        subtracted by default, token embeddings count because they are the head too."""
        n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(self, nnx.Param)))
        return n - int(np.prod(self.wpe.shape)) if non_embedding else n

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context, e.g. to fine-tune GPT-2 (1024) with a smaller block."""
        if block_size > self.config.block_size:
            raise JaxportError(
                f"block_size {block_size} is larger than the model's block_size "
                f"{self.config.block_size}; it can only be cropped"
            )
        self.config = dataclasses.replace(self.config, block_size=block_size)
        self.wpe = nnx.Param(self.wpe[...][:block_size])

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float, peak_flops: float = A100_BF16_PEAK) -> float:
        """Model FLOPs utilisation as nanoGPT computes it (PaLM appendix B), against
        `peak_flops` (nanoGPT's A100 bf16 312 TFLOPS by default; see `jaxport.runtime.topologies.device_peak_flops`)."""
        return estimate_mfu(self.get_num_params(), self.config, fwdbwd_per_iter, dt, peak_flops)

    # -- generation ------------------------------------------------------------------------
    def generate(
        self,
        idx,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        rng=None,
        *,
        return_logits: bool = False,
    ):
        """Append `max_new_tokens` sampled ids to `idx` [B, P], as nanoGPT's generate.

        A KV cache serves every step whose context still fits in block_size; past that,
        nanoGPT crops the context to its last block_size ids, which moves every position,
        so those steps recompute the cropped window (same tokens as nanoGPT either way).
        With `return_logits` the last-position logits of each step, [N, B, V], come too.
        """
        idx = jnp.asarray(idx, jnp.int32)
        rng = jax.random.key(0) if rng is None else rng
        top_k = None if top_k is None else min(int(top_k), self.config.vocab_size)
        graphdef, state = nnx.split(self)
        generate = runtime.jit_once(
            _generate, runtime.for_tokens(idx, self.dtype), static_argnames=("graphdef", "max_new_tokens", "top_k")
        )
        tokens, logits = generate(
            graphdef, state, idx, rng, jnp.float32(temperature), max_new_tokens=int(max_new_tokens), top_k=top_k
        )
        return (tokens, logits) if return_logits else tokens

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, config: GPTConfig, state_dict: dict, source: str) -> GPT:
        """A model of `config` holding a nanoGPT-named state dict; every key and shape is checked."""
        model = cls.abstract(config)
        graphdef, abstract = nnx.split(model)
        expected = params.tree_to_named(nnx.to_pure_dict(abstract), config)
        weights = params.nanogpt_weights(state_dict, config, source)
        for name, value in weights.items():
            if value.shape != expected[name].shape:
                raise JaxportError(
                    f"{source}: {name} has shape {list(value.shape)}, the model expects {list(expected[name].shape)}"
                )
        return nnx.merge(graphdef, params.named_to_tree({k: jnp.asarray(v, jnp.float32) for k, v in weights.items()}))

    @classmethod
    def from_checkpoint(cls, path: str | Path, **overrides) -> GPT:
        """A nanoGPT `ckpt.pt` (keys with or without `_orig_mod.`), or a run folder holding one."""
        return load_checkpoint(path, **overrides).model

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, override_args: dict | None = None) -> GPT:
        """GPT-2 weights from a local Hugging Face directory (save_pretrained or hub layout),
        or `gpt2`/`gpt2-medium`/`gpt2-large`/`gpt2-xl` resolved as params.resolve_pretrained says."""
        override_args = dict(override_args or {})
        others = sorted(set(override_args) - {"dropout"})
        if others:
            raise JaxportError(f"only dropout can be overridden for pretrained GPT-2, not {others}")
        directory, config, weights = params.read_pretrained(name_or_path)
        config = dataclasses.replace(config, dropout=float(override_args.get("dropout", 0.0)))
        return cls.from_state_dict(config, weights, str(directory))


@dataclasses.dataclass
class Checkpoint:
    """What a nanoGPT ckpt.pt holds, with the model built and loaded."""

    model: GPT
    path: Path
    iter_num: int
    best_val_loss: float
    config: dict  # the training configuration (train.py's globals)
    optimizer: dict | None  # torch AdamW state_dict, numpy arrays


def load_checkpoint(path: str | Path, **overrides) -> Checkpoint:
    """Read a nanoGPT ckpt.pt (or a run folder holding one). `overrides` replace model_args
    entries, e.g. `dropout=0.1`; a larger block_size than the checkpoint's is refused."""
    path, ckpt = params.read_checkpoint(path)
    block_size = overrides.pop("block_size", None)
    config = GPTConfig.from_model_args({**ckpt["model_args"], **overrides}, where=f"{path} model_args")
    model = GPT.from_state_dict(config, ckpt["model"], str(path))
    if block_size is not None and block_size != config.block_size:
        if block_size > config.block_size:
            raise JaxportError(
                f"block_size={block_size} is larger than the checkpoint's block_size "
                f"{config.block_size} ({path}); use at most {config.block_size}"
            )
        model.crop_block_size(block_size)
    best = ckpt.get("best_val_loss", float("inf"))
    return Checkpoint(
        model=model,
        path=path,
        iter_num=int(ckpt.get("iter_num", 0)),
        best_val_loss=float(np.asarray(best)),
        config=dict(ckpt.get("config") or {}),
        optimizer=ckpt.get("optimizer"),
    )


def estimate_mfu(
    num_params: int, config: GPTConfig, fwdbwd_per_iter: int, dt: float, peak_flops: float = A100_BF16_PEAK
) -> float:
    """`GPT.estimate_mfu` from a parameter count (`get_num_params()`, counted once per run)."""
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, config.block_size
    flops_per_token = 6 * num_params + 12 * L * H * Q * T
    return flops_per_token * T * fwdbwd_per_iter / dt / peak_flops


def _forward(graphdef, state, idx, targets, rng):
    return nnx.merge(graphdef, state).forward(idx, targets, rng)


def sample_probs(logits_BV, temperature, top_k: int | None):
    """The distribution nanoGPT's generate samples from: softmax(logits / temperature) over
    the top_k largest logits (ties with the k-th kept), zero elsewhere."""
    logits_BV = logits_BV / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    return jax.nn.softmax(logits_BV, axis=-1)


def _sample(logits_BV, temperature, top_k, rng):
    probs = sample_probs(logits_BV, temperature, top_k)
    return jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)


def _generate(graphdef, state, idx_BP, rng, temperature, *, max_new_tokens: int, top_k: int | None):
    model = nnx.merge(graphdef, state)
    B, P = idx_BP.shape
    T, N = model.config.block_size, max_new_tokens
    H, D = model.config.n_head, model.config.n_embd // model.config.n_head
    out = jnp.zeros((B, P + N), jnp.int32).at[:, :P].set(idx_BP)
    step_logits = jnp.zeros((N, B, model.config.vocab_size), jnp.float32)

    def emit(i, logits, out, step_logits, rng):
        rng, key = jax.random.split(rng)
        tok = _sample(logits, temperature, top_k, key)
        out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, P + i))
        return tok, out, step_logits.at[i].set(logits), rng

    # Steps i < n_cached see the whole sequence (P + i <= T): decode with the KV cache.
    n_cached = max(0, min(N, T - P + 1))
    if n_cached:
        cache = [(jnp.zeros((B, T, H, D), model.dtype),) * 2 for _ in range(model.config.n_layer)]
        x, cache = model.hidden_states(idx_BP, cache=cache, pos=0)
        logits = model.lm_head(x[:, -1:])[:, 0]

        def cached_step(i, carry):
            out, step_logits, cache, logits, rng = carry
            tok, out, step_logits, rng = emit(i, logits, out, step_logits, rng)
            # The step after the last cached one is never used; keep its position in range.
            x, cache = model.hidden_states(tok[:, None], cache=cache, pos=jnp.minimum(P + i, T - 1))
            return out, step_logits, cache, model.lm_head(x)[:, 0], rng

        out, step_logits, _, _, rng = jax.lax.fori_loop(
            0, n_cached, cached_step, (out, step_logits, cache, logits, rng)
        )

    # Later steps crop the context to its last T ids, as nanoGPT does.
    def cropped_step(i, carry):
        out, step_logits, rng = carry
        window = jax.lax.dynamic_slice(out, (0, P + i - T), (B, T))
        x, _ = model.hidden_states(window)
        _, out, step_logits, rng = emit(i, model.lm_head(x[:, -1:])[:, 0], out, step_logits, rng)
        return out, step_logits, rng

    if n_cached < N:
        out, step_logits, _ = jax.lax.fori_loop(n_cached, N, cropped_step, (out, step_logits, rng))
    return out, step_logits
