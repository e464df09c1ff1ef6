"""Batches concurrent Dream generation requests: one worker thread owns the model and runs, in turn,
the oldest waiting request together with every later one whose compiled settings match.

Which settings are static (part of `BatchKey`; requests batch only when they are equal, and each new
combination compiles once) and which are per row:

* static: the prompt-length bucket, the `max_tokens` bucket (the number of new tokens on the canvas) and
  the request's `GenerationSettings` (`jaxport.dream.settings`): the program's (`steps`, `alg`,
  `block_length`, `cache`, `schedule`) and, compiled in today, the sampling values (`temperature`,
  `top_p`, `top_k`, `alg_temp`, `threshold`); the batch size is rounded up to a bucket (powers of two up
  to `max_batch`; spare rows repeat the first).
* per row: the prompt, `max_tokens` within its bucket (the text is cut there), `stop`, `n` (rows of
  one request run in the same batch) and streaming.

A row's tokens depend only on its own prompt and static settings: each request's prompt bucket comes
from its own length, every row of a batch holds the same number of masks (the exact path's unmask
count is shared by the batch; block-wise counts are per row), padding is invisible to the model, and
every batch passes its attention mask, so a prompt that fills its bucket runs the same attention alone
as beside padded rows.
So greedy decoding (temperature 0 and an algorithm that draws nothing: not `origin`, no `alg_temp`)
gives the same text alone or in any batch (tested). At one batch size a row's scores are the same bit for
bit whatever the other rows hold (tested); another batch size may run other kernels, which can move the
last bits of a score and so, rarely, break a near-tie differently.

Sampling draws one key for the whole batch, so a request with a `seed` that samples runs as a batch
of its own, under the key made from the seed: the same seed gives the same text. Without a seed,
sampled requests batch freely under a fresh key. A prompt that holds the mask token also runs alone
(its masks would change the other rows' unmask counts).
"""

import bisect
import dataclasses
import os
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterator

import jax
import numpy as np

from jaxport.dream.fast import generate_blocks
from jaxport.dream.settings import GenerationSettings
from jaxport.dream.tokenizer import DreamTokenizer
from jaxport.errors import JaxportError


def log(message: str):
    print(message, file=sys.stderr, flush=True)


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes the server compiles: powers of two below `max_batch`, and `max_batch`."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch})


def bucket(value: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `value`, or None when none does."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


def rng_key(seed: int) -> jax.Array:
    """A key for any 64-bit seed (`jax.random.key` keeps 32 bits without x64); equals `key(seed)` below 2**32."""
    seed %= 1 << 64
    return jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))


@dataclasses.dataclass(frozen=True)
class BatchKey:
    """The settings the compiled generation depends on; requests batch together when these are equal."""

    prompt_len: int  # rows are left-padded to this bucket
    new_tokens: int  # max_tokens bucket: the canvas holds this many new tokens
    settings: GenerationSettings  # checked for this canvas (`GenerationSettings.check`)
    seed: int | None = None
    alone: str | None = None  # a request id: that request runs as a batch of its own

    @classmethod
    def of(cls, prompt_len: int, new_tokens: int, **settings) -> "BatchKey":
        """The key for these `diffusion_generate` settings (raises `JaxportError` naming a bad one)."""
        return cls(prompt_len, new_tokens, GenerationSettings.of(**settings).check(new_tokens))

    @property
    def samples(self) -> bool:
        """Whether generation draws random numbers (so the batch's key matters)."""
        s = self.settings
        return s.temperature > 0 or s.alg == "origin" or bool(s.alg_temp)

    def describe(self) -> str:
        """The settings that are set, by name (eps and schedule only where not at their defaults)."""
        defaults = {"eps": 1e-3, "schedule": "jaxport"}
        given = sorted(
            (k, v) for k, v in self.settings.model_dump(exclude_none=True).items() if defaults.get(k, None) != v
        )
        return ", ".join([f"prompt {self.prompt_len} + {self.new_tokens} new tokens"] + [f"{k} {v}" for k, v in given])


def generated_ids(span: np.ndarray, stop_ids: set[int], mask_token_id: int) -> tuple[list[int], bool, bool]:
    """Token ids of a row's generated span up to its first end token or still-masked position:
    `(ids, ended at an end token, reached a mask)`."""
    ids = []
    for token in span.tolist():
        if token in stop_ids or token == mask_token_id:
            return ids, token in stop_ids, token == mask_token_id
        ids.append(token)
    return ids, False, False


class RowText:
    """The text of one generated row as more of its canvas becomes final: cut at end-of-text, after
    `max_tokens` tokens and before the first `stop` string. `update` returns the text that is new."""

    def __init__(self, tokenizer: DreamTokenizer, max_tokens: int, stop: list[str]):
        self.tokenizer, self.max_tokens, self.stop = tokenizer, max_tokens, stop
        self.text, self.tokens, self.finish_reason = "", 0, None

    def update(self, span: np.ndarray, final: bool) -> str:
        if self.finish_reason is not None:
            return ""
        ids, ended, masked = generated_ids(
            span[: self.max_tokens], self.tokenizer.stop_ids, self.tokenizer.mask_token_id
        )
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, ended = text[:cut], True
            # the fewest tokens whose text covers the kept text
            ids = ids[
                : bisect.bisect_left(
                    range(len(ids) + 1),
                    cut,
                    key=lambda k: len(self.tokenizer.decode(ids[:k], skip_special_tokens=True)),
                )
            ]
        if ended:
            self.finish_reason = "stop"
        elif final or not masked:
            self.finish_reason = "length"
        else:
            # Hold back a character still missing bytes and any tail that may begin a stop string.
            text = text.rstrip("\ufffd")
            held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - held]
        delta = text[len(self.text) :]
        self.text, self.tokens = text, len(ids)
        return delta


@dataclasses.dataclass(eq=False)
class Job:
    """One request: its rows (prompt texts) and how to tell its caller about progress.

    `post(kind, payload)` is called from the worker thread with ("delta", (row, text)) as text
    becomes final, then ("done", None) or ("error", exception)."""

    id: str
    key: BatchKey
    prompts: list[str]
    texts: list[RowText]
    post: Callable[[str, object], None]
    prompt_tokens: int = 0
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    started: float | None = None
    batch_requests: int = 0  # how many requests shared its batch


class QueueFull(Exception):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def generate_canvases(model, key: BatchKey, input_ids, attention_mask, rng) -> Iterator[tuple[np.ndarray, bool]]:
    """`(canvas [B, N], final)` each time more of the canvas is final.

    The exact path is one compiled program, so it yields once, at the end; block-wise decoding (any
    fast-decoding setting) yields after every finished block, so streams send each block's text."""
    args = dict(key.settings.arguments(), max_new_tokens=key.new_tokens, rng=rng)
    if key.settings.block_length is None:
        sequences = model.diffusion_generate(input_ids, attention_mask, return_dict_in_generate=False, **args)
        yield np.asarray(jax.device_get(sequences)), True
        return
    for block in generate_blocks(model, input_ids, attention_mask, **args):
        yield np.asarray(jax.device_get(block.output.sequences)), block.end == input_ids.shape[1] + key.new_tokens


class Scheduler:
    """A bounded queue of `Job`s and the worker thread that runs them in batches of equal `BatchKey`."""

    def __init__(self, model, tokenizer: DreamTokenizer, *, max_batch: int, max_queue: int):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.batch_sizes = batch_buckets(max_batch)
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="dream-scheduler", daemon=True)
        self._compiled: set = set()
        self._batch_seconds = 1.0  # running mean, for Retry-After
        self.stats, self.running_rows = Counter(), 0
        self.batch_requests, self.batch_rows = Counter(), Counter()

    # -- called from the server's event loop --------------------------------------------------
    def submit(self, job: Job):
        with self._cond:
            waiting = sum(len(j.prompts) for j in self._waiting)
            if waiting + len(job.prompts) > self.max_queue:
                self.stats["rejected"] += 1
                retry_after = max(1, round((waiting // self.max_batch + 1) * self._batch_seconds))
                raise QueueFull(
                    f"the queue is full ({waiting} rows wait, --max-queue {self.max_queue}); "
                    f"retry after {retry_after} s",
                    retry_after,
                )
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job):
        """Drop a job whose client went away: out of the queue at once, or its rows discarded when
        its batch (one compiled program, not interruptible) ends."""
        with self._cond:
            if job.cancelled:
                return
            job.cancelled = True
            self.stats["cancelled"] += 1
            if job in self._waiting:
                self._waiting.remove(job)

    def metrics(self) -> dict:
        with self._cond:
            waiting = sum(len(j.prompts) for j in self._waiting)
            return {
                **{
                    k: self.stats[k]
                    for k in ("requests", "rows", "batches", "generated_tokens", "cancelled", "rejected", "errors")
                },
                "queued_rows": waiting,
                "running_rows": self.running_rows,
                "compiled_programs": len(self._compiled),
                "batch_requests": {str(k): v for k, v in sorted(self.batch_requests.items())},
                "batch_rows": {str(k): v for k, v in sorted(self.batch_rows.items())},
            }

    def start(self):
        self._thread.start()

    def stop(self):
        """Finish what is queued, then end the worker (the server stops taking requests first)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    # -- the worker ----------------------------------------------------------------------------
    def warmup(self, keys: list[BatchKey], prompt: str = "Hello"):
        """Compile (by running once) every batch size for each key, before serving."""
        for key in keys:
            for size in self.batch_sizes:
                for _ in self._generate(key, [prompt] * size, when="at start-up"):
                    pass  # run every block: compiling each program is the point, not its text

    def _loop(self):
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if not self._waiting:
                    return
                jobs = self._take()
            self._run(jobs)

    def _take(self) -> list[Job]:
        """The oldest job and the later ones with its key, as many as fit in `max_batch` rows."""
        key, rows, jobs = self._waiting[0].key, 0, []
        for job in list(self._waiting):
            if job.key == key and rows + len(job.prompts) <= self.max_batch:
                self._waiting.remove(job)
                jobs.append(job)
                rows += len(job.prompts)
        self.running_rows = rows
        return jobs

    def _run(self, jobs: list[Job]):
        start = time.perf_counter()
        prompts = [p for job in jobs for p in job.prompts]
        for job in jobs:
            job.started, job.batch_requests = start, len(jobs)
        rows = [(job, index, text) for job in jobs for index, text in enumerate(job.texts)]
        try:
            for canvas, final in self._generate(jobs[0].key, prompts):
                for row, (job, index, text) in enumerate(rows):
                    delta = text.update(canvas[row, jobs[0].key.prompt_len :], final)
                    if delta and not job.cancelled:
                        job.post("delta", (index, delta))
        except Exception as err:  # the batch fails, the server goes on
            if not isinstance(err, JaxportError):
                traceback.print_exc()
            self.stats["errors"] += len(jobs)
            for job in jobs:
                job.post("error", err)
            return
        finally:
            self.running_rows = 0
        seconds = time.perf_counter() - start
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * seconds
        self.stats.update(
            requests=len(jobs),
            rows=len(prompts),
            batches=1,
            generated_tokens=sum(t.tokens for job in jobs for t in job.texts),
        )
        self.batch_requests[len(jobs)] += 1
        self.batch_rows[len(prompts)] += 1
        log(
            f"batch: {len(jobs)} requests, {len(prompts)} rows (padded to {bucket(len(prompts), self.batch_sizes)}), "
            f"{seconds:.2f} s"
        )
        for job in jobs:
            if not job.cancelled:
                job.post("done", None)

    def _generate(self, key: BatchKey, prompts: list[str], when: str = "on first use"):
        """Run one batch (padded to a batch bucket with copies of the first row); yields as
        `generate_canvases` does."""
        size = bucket(len(prompts), self.batch_sizes)
        input_ids, attention_mask = self.tokenizer(prompts + prompts[:1] * (size - len(prompts)), pad_to=key.prompt_len)
        masks = np.nonzero((input_ids == self.tokenizer.mask_token_id).any(axis=0))[0]
        # the program also depends on where the first prompt mask is (jaxport.dream.program)
        program = (key.prompt_len, key.new_tokens, key.settings, size, int(masks[0]) if len(masks) else None)
        compiling = program not in self._compiled
        if compiling:
            log(f"compiling generation {when}: batch {size}, {key.describe()}")
        rng = rng_key(key.seed if key.seed is not None else int.from_bytes(os.urandom(8), "little"))
        start = time.perf_counter()
        for canvas, final in generate_canvases(self.model, key, input_ids, attention_mask, rng):
            if compiling and final:
                self._compiled.add(program)
                log(f"compiled and ran batch {size} in {time.perf_counter() - start:.1f} s")
            yield canvas, final
