"""One block call of a continuous batch (`jaxport.dream.serving.batches.RunningBatch`: blocks of 32, the dual
cache, greedy entropy ranking, one step per token) at each batch size and canvas: the seconds of a call with every
slot decoding a fresh block, and per row. What a block boundary costs the server, and what bounds continuous
batching's gain over static batching on a host whose time grows with the rows. One JSON line per canvas and batch
size.

    python bench/dream_running_batch.py                                  # the 40M config's random weights
    python bench/dream_running_batch.py --new-tokens 64,256 --sizes 1,8,16
"""

import argparse
import statistics
import time

import jax
import numpy as np
from _common import emit, environment, peak_rss_bytes

from jaxport import dream
from jaxport.dream.serving.batches import Lane, RunningBatch
from jaxport.dream.serving.programs import CompiledPrograms
from jaxport.dream.settings import GenerationSettings, RowSettings


def block_call(batch: RunningBatch, prompt_P: np.ndarray, new_tokens: int) -> float:
    """The seconds of one call with every slot starting a fresh first block."""
    for b in range(batch.size):
        if batch.slots[b] is not None:
            batch.leave(b)
        batch.join(None, prompt_P, np.ones(len(prompt_P), bool), new_tokens, RowSettings(), jax.random.key(b))
    start = time.perf_counter()
    batch.run()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-init", default="40m")
    parser.add_argument("--prompt", type=int, default=32, help="prompt bucket (tokens)")
    parser.add_argument("--new-tokens", default="64,128,256", help="canvases: new tokens after the prompt")
    parser.add_argument("--sizes", default="1,2,4,8,16", help="batch sizes")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = dream.preset(args.random_init)
    model = dream.random_model(config)
    programs = CompiledPrograms(model)
    prompt_P = np.random.default_rng(0).integers(0, config.mask_token_id, args.prompt).astype(np.int32)
    for new_tokens in map(int, args.new_tokens.split(",")):
        settings = GenerationSettings.of(steps=new_tokens, block_length=32, cache="dual", alg="entropy")
        lane = Lane.of(args.prompt, new_tokens, new_tokens, settings.check(new_tokens).program)
        for size in map(int, args.sizes.split(",")):
            batch = RunningBatch(model, lane, size, programs, config.pad_token_id, config.mask_token_id)

            first = block_call(batch, prompt_P, new_tokens)
            median = statistics.median(block_call(batch, prompt_P, new_tokens) for _ in range(args.repeats))
            emit(
                {
                    "model": f"random-init {args.random_init}",
                    "prompt": args.prompt,
                    "new_tokens": new_tokens,
                    "batch": size,
                    "first_call_s": round(first, 3),
                    "block_call_s": round(median, 4),
                    "per_row_s": round(median / size, 4),
                    "peak_rss_bytes": peak_rss_bytes(),
                    "machine": environment(),
                }
            )


if __name__ == "__main__":
    main()
