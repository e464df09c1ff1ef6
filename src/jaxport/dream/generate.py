"""Deprecated: this module was split by concept and will be removed in the next release. Import from
`jaxport.dream.decoding` (`diffusion_generate`), `jaxport.dream.program` (`prepare_generation`,
`GenerationOutput`, `padding_inputs`, `decoding_program`), `jaxport.dream.sampling` (`sample_tokens`, `unmask`,
`timesteps`, ...) and `jaxport.dream.settings` (`ALGORITHMS`, `CACHES`, `GenerationSettings`).

`jaxport.dream.generate` is the text API (`jaxport.dream.text.generate`); importing this module rebinds that
package attribute to the module, so the module stays callable as that function while the alias lives.
"""

import sys
import types
import warnings

import jax.numpy as jnp

from jaxport.dream import sampling, text
from jaxport.dream.decoding import diffusion_generate
from jaxport.dream.program import (
    GenerationOutput,
    decoding_program,
    padding_inputs,
    prepare_generation,
)
from jaxport.dream.sampling import bucket_sizes, masked_scores, sample_tokens, timesteps, transfer_ratios, unmask
from jaxport.dream.settings import ALGORITHMS, CACHES

warnings.warn(
    "jaxport.dream.generate (the module) is deprecated: import from jaxport.dream.decoding, .program, .sampling "
    "or .settings; jaxport.dream.generate is the text API",
    DeprecationWarning,
    stacklevel=2,
)


def top_p_filter(logits, top_p: float):
    """One top-p for every row of `logits [..., V]` (the sampler now takes one per row: `sampling.filters`)."""
    rows = logits.reshape(-1, logits.shape[-1])
    R = rows.shape[0]
    kept = sampling.filters(rows, jnp.full((R,), top_p, jnp.float32), jnp.zeros((R,), jnp.int32))
    return kept.reshape(logits.shape)


def top_k_filter(logits, top_k: int):
    """One top-k for every row of `logits [..., V]` (the sampler now takes one per row)."""
    rows = logits.reshape(-1, logits.shape[-1])
    R = rows.shape[0]
    kept = sampling.filters(rows, jnp.ones((R,), jnp.float32), jnp.full((R,), top_k, jnp.int32))
    return kept.reshape(logits.shape)


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return text.generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "ALGORITHMS",
    "CACHES",
    "GenerationOutput",
    "bucket_sizes",
    "decoding_program",
    "diffusion_generate",
    "masked_scores",
    "padding_inputs",
    "prepare_generation",
    "sample_tokens",
    "timesteps",
    "top_k_filter",
    "top_p_filter",
    "transfer_ratios",
    "unmask",
]
