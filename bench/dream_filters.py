"""Dream's sampler on one `[rows, vocabulary]` batch of logits: the seconds of a jitted call of the filters
(`jaxport.dream.sampling.filters`) with top-p 0.9 on a narrow nucleus (the partial sort holds it) and on a wide one
(the whole vocabulary is searched), and of the categorical draw (`_categorical`, the inverse of the cumulative
distribution) beside a Gumbel draw (`jax.random.categorical`), one JSON line per shape.

    python bench/dream_filters.py                         # the tiny model's 32 x 512, Dream 7B's 8 x 152064
    python bench/dream_filters.py --shapes 32x320 --repeats 200
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from _common import emit, environment, peak_rss_bytes

from jaxport.dream.sampling import _categorical, filters


def seconds(function, *args, repeats: int) -> tuple[float, float]:
    """(first call, compilation included; median of `repeats` calls after it)."""
    start = time.perf_counter()
    jax.block_until_ready(function(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="32x512,8x152064", help="ROWSxVOCAB,...")
    parser.add_argument("--repeats", type=int, default=0, help="timed calls per case (0: 200, or 5 above 100k)")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        rows, vocab = map(int, shape.split("x"))
        repeats = args.repeats or (5 if vocab > 100_000 else 200)
        wide_RV = jax.random.normal(jax.random.key(0), (rows, vocab)) * 0.5  # a nucleus of most of the vocabulary
        narrow_RV = wide_RV * 20  # a few tokens
        top_p, top_k = jnp.full((rows,), 0.9), jnp.zeros((rows,), jnp.int32)
        record = {"rows": rows, "vocab": vocab, "top_p": 0.9, "repeats": repeats}
        for name, logits in (("narrow", narrow_RV), ("wide", wide_RV)):
            first, median = seconds(jax.jit(filters), logits, top_p, top_k, repeats=repeats)
            record[f"{name}_first_call_s"], record[f"{name}_median_s"] = round(first, 4), round(median, 6)
        keys_R, probs_RV = jax.random.split(jax.random.key(1), rows), jax.nn.softmax(wide_RV, axis=-1)
        gumbel = jax.jit(lambda keys, logits: jax.vmap(jax.random.categorical)(keys, logits))
        record["draw_median_s"] = round(seconds(jax.jit(_categorical), keys_R, probs_RV, repeats=repeats)[1], 6)
        record["gumbel_draw_median_s"] = round(seconds(gumbel, keys_R, wide_RV, repeats=repeats)[1], 6)
        emit({**record, "peak_rss_bytes": peak_rss_bytes(), "machine": environment()})


if __name__ == "__main__":
    main()
