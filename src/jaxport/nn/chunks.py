"""Independent rows computed in chunks that XLA:CPU runs side by side."""

import jax
import jax.numpy as jnp


def in_row_chunks(fn, chunks: int, *arrays_B):
    """`fn(*arrays_B)` for an `fn` whose rows are independent, computed on `chunks` chunks of the rows and put back in
    row order. Chunk c holds rows c, c + n, ...: a reshape, so every device keeps its own rows of a batch-sharded
    array. On a CPU, XLA runs the chunks' independent chains of ops side by side, where one chain of small ops
    leaves a core idle. Each chunk compiles separately, and products over the rows (weight gradients) add the
    chunks' sums (float rounding)."""
    if chunks == 1:
        return fn(*arrays_B)
    split = [x.reshape(x.shape[0] // chunks, chunks, *x.shape[1:]) for x in arrays_B]
    results = [fn(*(x[:, c] for x in split)) for c in range(chunks)]
    return jax.tree.map(lambda *parts: jnp.stack(parts, axis=1).reshape(-1, *parts[0].shape[1:]), *results)
