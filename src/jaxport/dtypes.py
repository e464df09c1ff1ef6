"""Floating-point dtypes by the names users write (`--dtype bfloat16`, `torch_dtype` in config.json)."""

import jax.numpy as jnp

from jaxport.errors import JaxportError

FLOAT_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def float_dtype(dtype, allowed=("float32", "bfloat16"), what: str = "dtype") -> jnp.dtype:
    """`dtype` (a name or a dtype) as a `jnp.dtype`, if it is one of `allowed`; otherwise one error naming
    `what` was given and what is expected."""
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    if name not in allowed:
        raise JaxportError(f"unsupported {what} {dtype!r}: choose {' or '.join(map(repr, allowed))}")
    return jnp.dtype(FLOAT_DTYPES[name])
