"""How a batch of rows runs on the model: a static batch until every row's text has ended (`generate_canvases`), or a
running batch a block at a time (`RunningBatch`, continuous batching).

A row's tokens depend only on its own prompt, settings and key: each request's prompt bucket comes from its own
length, every row of a batch holds the same number of masks (the exact path's unmask count is shared by the batch;
block-wise counts are per row), padding is invisible to the model, every batch passes its attention mask, and a
row draws its random numbers from its own key. Row i of a request with a `seed` draws from
`fold_in(key(seed), i)`, as `diffusion_generate(rng=key(seed))` draws for its row i: the same seed gives the same
text, alone or in any batch (tested). Without a seed a request gets a fresh key. At one batch size a row's scores
are the same bit for bit whatever the other rows hold (tested); another batch size may run other kernels, which
can move the last bits of a score and so, rarely, break a near-tie differently. A prompt that holds the mask token
runs alone (its masks would change the other rows' unmask counts, and where the first mask is shapes the program).

Continuous batching runs at block boundaries, for block-wise decoding with the dual cache.

With the dual cache every row starts a block at the same moment, and each block call begins with a full forward of
the canvas (which rebuilds the cache), so nothing of a row carries from one block call to the next but its canvas
row. A `RunningBatch` keeps `size` slots of one canvas layout (prompts left-padded to `prompt_len`, then
`new_tokens` positions); between two block calls finished rows leave and waiting rows take their slots (their canvas
row is written: the padded prompt, then mask tokens). Every call runs each row at its own block index
(`jaxport.dream.fast` takes one per row), in the smallest of the batch sizes `sizes` that holds the occupied slots:
since no state but the canvas row carries over, a call gathers those rows and writes them back, so a batch that is
draining or lightly loaded pays for the rows it runs, not for every slot.

A row sees only itself: its keys are its prompt and its own new-token region (its `max_tokens` bucket; the rest of
the canvas row is padding to the attention mask), its positions count its real tokens, its random draws come from
its own key and its sampling settings are its own (`jaxport.dream.sampling.Rows`). The schedule gives each block
the same number of steps in every row (`Lane`), so a row's tokens are those of `diffusion_generate` for it alone.
"""

import dataclasses
from collections.abc import Iterator

import jax
import numpy as np

from jaxport.dream.fast import generate_blocks, run_block
from jaxport.dream.program import Prepared, Program
from jaxport.dream.sampling import Rows
from jaxport.dream.serving.programs import BatchKey
from jaxport.dream.settings import GenerationSettings, ProgramSettings, RowSettings


def rng_key(seed: int) -> jax.Array:
    """A key for any 64-bit seed (`jax.random.key` keeps 32 bits without x64); equals `key(seed)` below 2**32."""
    seed %= 1 << 64
    return jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))


@dataclasses.dataclass(frozen=True)
class Lane:
    """Rows that can share a running batch: one prompt bucket, one canvas of `new_tokens` new positions (the largest
    `max_tokens` bucket) and the program settings with `steps` counted over that canvas (the same steps per block
    as each row's own, smaller, canvas)."""

    prompt_len: int
    new_tokens: int
    settings: ProgramSettings

    @classmethod
    def of(cls, prompt_len: int, new_tokens: int, row_tokens: int, settings: ProgramSettings) -> "Lane | None":
        """The lane of a row of `row_tokens` new tokens, or None where its settings cannot run in one (not block-wise
        with the dual cache, or blocks that do not divide the lane's canvas)."""
        width = settings.block_length
        if not settings.cache_kind.running_batch or width is None or new_tokens % width or row_tokens % width:
            return None
        per_block = settings.steps // (row_tokens // width)
        return cls(prompt_len, new_tokens, settings.model_copy(update={"steps": per_block * (new_tokens // width)}))

    @property
    def blocks(self) -> int:
        return self.new_tokens // self.settings.block_length


class RunningBatch:
    """`size` slots decoding `lane`'s canvas a block at a time; `join` and `leave` between `run` calls. Each call
    runs at the smallest of `sizes` (batch sizes with compiled programs; default `size` alone) that holds the
    occupied slots."""

    def __init__(self, model, lane: Lane, size: int, programs, pad_token_id: int, mask_token_id: int, sizes=()):
        self.model, self.lane, self.size, self.programs = model, lane, size, programs
        self.sizes = sorted({n for n in sizes if n < size} | {size})
        self.pad, self.mask = pad_token_id, mask_token_id
        N = lane.prompt_len + lane.new_tokens
        self.x_BN = np.full((size, N), pad_token_id, np.int32)
        self.valid_BN = np.zeros((size, N), bool)
        self.keys_B = jax.random.split(jax.random.key(0), size)
        self.rows = Rows.of([RowSettings()] * size)  # host arrays, written per slot
        self.block_B = np.zeros(size, np.int32)
        self.slots: list[tuple | None] = [None] * size  # (owner, new tokens) of each occupied slot
        self.program = Program(settings=lane.settings, mask_token_id=mask_token_id, first=lane.prompt_len)

    @property
    def free(self) -> int:
        return self.slots.count(None)

    @property
    def running(self) -> int:
        return self.size - self.free

    @property
    def call_size(self) -> int:
        """The batch size the next call runs at: the smallest of `sizes` that holds the occupied slots."""
        return next(n for n in self.sizes if n >= self.running)

    def join(self, owner, ids_P, valid_P, new_tokens: int, row: RowSettings, key: jax.Array) -> int:
        """Put a row in a free slot: its canvas row is the prompt `ids_P` (left-padded to the lane's prompt bucket,
        `valid_P` its attention mask), then `new_tokens` masks. Returns the slot."""
        b = self.slots.index(None)
        P = self.lane.prompt_len
        self.x_BN[b] = self.pad
        self.x_BN[b, :P] = ids_P
        self.x_BN[b, P : P + new_tokens] = self.mask
        self.valid_BN[b] = False
        self.valid_BN[b, :P] = valid_P
        self.valid_BN[b, P : P + new_tokens] = True
        self.keys_B = self.keys_B.at[b].set(key)
        for name, value in zip(Rows._fields, Rows.of([row]), strict=True):
            getattr(self.rows, name)[b] = value[0]
        self.block_B[b] = 0
        self.slots[b] = (owner, new_tokens)
        return b

    def leave(self, b: int):
        """Free slot `b`: its row holds no mask, so the block calls leave it as it is."""
        self.x_BN[b] = self.pad
        self.valid_BN[b] = False
        self.slots[b] = None

    def run(self) -> tuple[np.ndarray, int]:
        """One block of every occupied row, each at its own block index: `(canvas, steps run)`. Afterwards each row's
        next block is the one after (`done(b)` says when a row has none)."""
        occupied = [b for b, slot in enumerate(self.slots) if slot is not None]
        free = [b for b, slot in enumerate(self.slots) if slot is None]
        # free slots fill the batch size: they hold no mask, so the call leaves them as they are
        index = np.array(occupied + free[: self.call_size - len(occupied)])
        x, valid, keys, block, *settings = self.model.place_batch(
            *(a[index] for a in (self.x_BN, self.valid_BN, self.keys_B, self.block_B, *self.rows))
        )
        prepared = Prepared(x, valid, keys, Rows(*settings), self.program)
        canvas, _, steps = run_block(self.programs, prepared, x, block)
        self.x_BN[index] = np.asarray(jax.device_get(canvas))
        self.block_B[occupied] += 1
        return self.x_BN, int(steps)

    def done(self, b: int) -> bool:
        """Whether slot `b` ran all the blocks of its new tokens."""
        return self.block_B[b] * self.lane.settings.block_length >= self.slots[b][1]

    def span(self, b: int) -> np.ndarray:
        """Slot `b`'s new tokens on the canvas."""
        P = self.lane.prompt_len
        return self.x_BN[b, P : P + self.slots[b][1]]


def generate_canvases(
    model, key: BatchKey, input_ids, attention_mask, rows: dict, keys_B, programs, stop_token_ids=None
) -> Iterator[tuple[np.ndarray, bool, int]]:
    """`(canvas [B, N], final, steps run)` each time more of the canvas is final; `rows` holds the per-row
    sampling settings (`diffusion_generate`'s arguments, a list of one value per row).

    The exact path is one compiled program, so it yields once, at the end; block-wise decoding (any
    fast-decoding setting) yields after every finished block, so streams send each block's text. Given
    `stop_token_ids`, the batch stops once every row's text has ended (`diffusion_generate`'s early stop): the
    canvas after it is final, its positions after each row's end-of-text may hold masks."""
    args = dict(
        GenerationSettings.of(**key.settings.model_dump(), **rows).arguments(),
        max_new_tokens=key.new_tokens,
        rng=keys_B,
        programs=programs,
        stop_token_ids=stop_token_ids,
    )
    if key.settings.block_length is None:
        sequences = model.diffusion_generate(input_ids, attention_mask, return_dict_in_generate=False, **args)
        yield np.asarray(jax.device_get(sequences)), True, key.settings.steps
        return
    for block in generate_blocks(model, input_ids, attention_mask, **args):
        canvas = np.asarray(jax.device_get(block.output.sequences))
        yield canvas, block.last, int(block.steps)
