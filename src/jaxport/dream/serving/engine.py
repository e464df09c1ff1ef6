"""The serving engine: a bounded queue of requests (`Job`s, token ids in) and one worker thread that owns the model
and runs what the scheduler (`jaxport.dream.serving.scheduler`, a pure function of the queue and the running batch)
decides: static batches of one compiled program, or block calls of a running batch (continuous batching).

What shapes the compiled program (part of `BatchKey`; requests batch only when it is equal) and what is per row:

* the program: the prompt-length bucket, the `max_tokens` bucket (the number of new tokens on the canvas) and the
  request's `ProgramSettings` (`jaxport.dream.settings`: `steps`, `alg`, `block_length`, `cache`, `schedule`);
  the batch size is rounded up to a bucket (powers of two up to `max_batch`; spare rows repeat the first). The
  server compiles a bounded set of these at start-up (`CompiledPrograms`); a request outside it is refused, unless
  `--compile-on-demand` allows a few more.
* per row: the prompt, `max_tokens` within its bucket (the text is cut there), `stop`, `n`, streaming, and the
  sampling settings (`temperature`, `top_p`, `top_k`, `alg_temp`, `threshold`) with the random key: runtime inputs
  `[B]` of the program (`jaxport.dream.sampling.Rows`), so any values batch together without compiling.

A row's tokens depend only on its own prompt, settings and key: each request's prompt bucket comes from its own
length, every row of a batch holds the same number of masks (the exact path's unmask count is shared by the batch;
block-wise counts are per row), padding is invisible to the model, every batch passes its attention mask, and a
row draws its random numbers from its own key. Row i of a request with a `seed` draws from
`fold_in(key(seed), i)`, as `diffusion_generate(rng=key(seed))` draws for its row i: the same seed gives the same
text, alone or in any batch (tested). Without a seed a request gets a fresh key. At one batch size a row's scores
are the same bit for bit whatever the other rows hold (tested); another batch size may run other kernels, which
can move the last bits of a score and so, rarely, break a near-tie differently. A prompt that holds the mask token
runs alone (its masks would change the other rows' unmask counts, and where the first mask is shapes the program).

Static batching runs a batch to the end of its longest row. With `batching="continuous"`, requests decoded block-wise
with the dual cache run in a `RunningBatch` of their `Lane` instead (`jaxport.dream.serving.running_batch`): rows join
and leave at
block boundaries, each at its own block, every call at the smallest batch size that holds the running rows, and each
request's text is still its text alone.
"""

import bisect
import dataclasses
import os
import sys
import threading
import time
import traceback
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxport.dream.fast import generate_blocks
from jaxport.dream.program import decoding_program
from jaxport.dream.sampling import Branches
from jaxport.dream.serving.output import RowText
from jaxport.dream.serving.running_batch import Lane, RunningBatch
from jaxport.dream.serving.scheduler import Decision, Row, Running, Waiting, decide, rows_like_oldest
from jaxport.dream.settings import GenerationSettings, ProgramSettings, RowSettings
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
    """What the compiled generation depends on; requests batch together when these are equal."""

    prompt_len: int  # rows are left-padded to this bucket
    new_tokens: int  # max_tokens bucket: the canvas holds this many new tokens
    settings: ProgramSettings  # checked for this canvas (`GenerationSettings.check`)
    alone: str | None = None  # a request id: that request runs as a batch of its own

    @classmethod
    def of(cls, prompt_len: int, new_tokens: int, **settings) -> "BatchKey":
        """The key for these `diffusion_generate` settings (raises `JaxportError` naming a bad one)."""
        return cls(prompt_len, new_tokens, GenerationSettings.of(**settings).check(new_tokens).program)

    @property
    def program(self) -> tuple:
        """The compiled shapes and settings, whoever runs them."""
        return self.prompt_len, self.new_tokens, self.settings, self.alone is not None

    def describe(self) -> str:
        """The settings that are set, by name (eps and schedule only where not at their defaults)."""
        defaults = {"eps": 1e-3, "schedule": "jaxport"}
        given = sorted(
            (k, v) for k, v in self.settings.model_dump(exclude_none=True).items() if defaults.get(k, None) != v
        )
        return ", ".join([f"prompt {self.prompt_len} + {self.new_tokens} new tokens"] + [f"{k} {v}" for k, v in given])


@dataclasses.dataclass(eq=False)
class Job:
    """One request: its rows (prompt token ids), their sampling settings and key, and how to tell its caller about
    progress.

    `post(kind, payload)` is called from the worker thread with ("delta", (row, text)) as text
    becomes final, then ("done", None) or ("error", exception)."""

    id: str
    key: BatchKey
    prompt_ids: list[list[int]]
    texts: list[RowText]
    post: Callable[[str, object], None]
    row: RowSettings = RowSettings()
    seed: int | None = None  # None: a fresh key
    prompt_tokens: int = 0
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    started: float | None = None
    first_block: float | None = None
    batch_requests: int = 0  # how many requests shared its batch
    steps: int = 0  # denoising steps its batch ran
    lane: Lane | None = None  # where continuous batching may run it
    rows_left: int = 0  # rows still in a running batch (continuous batching)

    def keys(self) -> jax.Array:
        """Its rows' random keys: row i draws from `fold_in(key(seed), i)`, as `diffusion_generate` does."""
        base = rng_key(self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little"))
        return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(len(self.prompt_ids)))


class QueueFull(Exception):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def _spec(leaf) -> tuple:
    return np.shape(leaf), str(leaf.dtype), getattr(leaf, "sharding", None)


class CompiledPrograms:
    """The server's compiled decoding programs, each compiled ahead of time by `decoding_program` and kept here:
    those of the start-up set for good, those compiled on demand in a least-recently-used cache of at most
    `on_demand` programs. A `Programs` for `diffusion_generate` / `generate_blocks` (`programs=`).

    `pinning` says where a program compiled now goes (the scheduler sets it per batch); `compiling()` is told
    before every compilation and `compiled(seconds, pinned)` after it."""

    def __init__(self, model, on_demand: int = 0, compiling=None, compiled=None):
        self.model, self.on_demand = model, on_demand
        self.graphdef, self.state = nnx.split(model)
        self.pinned: dict = {}
        self.extra: OrderedDict = OrderedDict()
        self.pinning = True
        self.compiling = compiling or (lambda: None)
        self.compiled = compiled or (lambda seconds, pinned: None)

    def __len__(self) -> int:
        return len(self.pinned) + len(self.extra)

    def __call__(self, function, static: dict, x_BN, *dynamic):
        # every program holds all the sampler's branches, so any request's settings run without compiling
        static = {**static, "program": dataclasses.replace(static["program"], branches=Branches())}
        leaves, tree = jax.tree.flatten((x_BN, dynamic))
        signature = (function, tuple(sorted(static.items())), tree, tuple(map(_spec, leaves)))
        program = self.pinned.get(signature)
        if program is None and signature in self.extra:
            self.extra.move_to_end(signature)
            program = self.extra[signature]
        if program is None:
            program = self._compile(signature, function, static, x_BN, dynamic)
        return program(self.state, x_BN, *dynamic)

    def _compile(self, signature, function, static, x_BN, dynamic):
        self.compiling()
        start = time.perf_counter()
        jitted = decoding_program(function, self.model, x_BN, static_argnames=("graphdef", *static))
        program = jitted.lower(self.graphdef, self.state, x_BN, *dynamic, **static).compile()
        if self.pinning:
            self.pinned[signature] = program
        else:
            self.extra[signature] = program
            while len(self.extra) > self.on_demand:
                self.extra.popitem(last=False)
        self.compiled(time.perf_counter() - start, self.pinning)
        return program


def generate_canvases(
    model, key: BatchKey, input_ids, attention_mask, rows: dict, keys_B, programs
) -> Iterator[tuple[np.ndarray, bool, int]]:
    """`(canvas [B, N], final, steps run)` each time more of the canvas is final; `rows` holds the per-row
    sampling settings (`diffusion_generate`'s arguments, a list of one value per row).

    The exact path is one compiled program, so it yields once, at the end; block-wise decoding (any
    fast-decoding setting) yields after every finished block, so streams send each block's text."""
    args = dict(
        GenerationSettings.of(**key.settings.model_dump(), **rows).arguments(),
        max_new_tokens=key.new_tokens,
        rng=keys_B,
        programs=programs,
    )
    if key.settings.block_length is None:
        sequences = model.diffusion_generate(input_ids, attention_mask, return_dict_in_generate=False, **args)
        yield np.asarray(jax.device_get(sequences)), True, key.settings.steps
        return
    for block in generate_blocks(model, input_ids, attention_mask, **args):
        canvas = np.asarray(jax.device_get(block.output.sequences))
        yield canvas, block.end == input_ids.shape[1] + key.new_tokens, int(block.steps)


class Engine:
    """A bounded queue of `Job`s and the worker thread that runs them as the scheduler decides."""

    def __init__(
        self,
        model,
        tokenizer: DreamTokenizer,
        *,
        max_batch: int,
        max_queue: int,
        on_demand: int = 0,
        batching: str = "static",
        lane_tokens: int | None = None,
        max_context: int | None = None,
        delay_factor: float = 0.0,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        # continuous batching: rows of block-wise dual-cache programs share a canvas of `lane_tokens` new tokens
        self.batching, self.lane_tokens, self.max_context = batching, lane_tokens, max_context
        self.batch_sizes = batch_buckets(max_batch)
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="dream-engine", daemon=True)
        self.programs = CompiledPrograms(model, on_demand, self._compiling, self._compiled)
        self._describe = ""
        self.start_up: set = set()  # the programs (`BatchKey.program`) of the start-up set
        self._batch_seconds = 1.0  # running mean, for Retry-After
        # a batch with room waits up to `delay_factor` times the last call (batch or block call) for more requests
        self.delay_factor, self._call_seconds = delay_factor, 0.0
        self.stats, self.running_rows, self.batch_size = Counter(), 0, 0
        self.batch_requests, self.batch_rows = Counter(), Counter()
        self.compile_seconds = Counter()
        self.finished: Callable[[Job], None] = lambda job: None  # told of every job that ends, from the worker
        self.compiled_hooks: list[Callable[[float, str], None]] = []  # told of every compilation (seconds, set)

    def _compiling(self):
        log(f"compiling generation {self._describe}")

    def _compiled(self, seconds: float, pinned: bool):
        when = "start-up" if pinned else "on demand"
        log(f"compiled in {seconds:.1f} s ({when} set; {len(self.programs)} programs)")
        self.stats["compilations"] += 1
        self.stats[f"compilations {when}"] += 1
        self.compile_seconds[when] += seconds
        for hook in self.compiled_hooks:
            hook(seconds, when)

    # -- called from the server's event loop --------------------------------------------------
    def submit(self, job: Job):
        with self._cond:
            waiting = sum(len(j.prompt_ids) for j in self._waiting)
            if waiting + len(job.prompt_ids) > self.max_queue:
                self.stats["rejected"] += 1
                retry_after = max(1, round((waiting // self.max_batch + 1) * self._batch_seconds))
                raise QueueFull(
                    f"the queue is full ({waiting} rows wait, --max-queue {self.max_queue}); "
                    f"retry after {retry_after} s",
                    retry_after,
                )
            job.lane = self._lane(job.key)
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

    def queued_rows(self) -> int:
        with self._cond:
            return sum(len(j.prompt_ids) for j in self._waiting)

    def metrics(self) -> dict:
        return {
            **{
                k: self.stats[k]
                for k in ("requests", "rows", "batches", "generated_tokens", "cancelled", "rejected", "errors")
            },
            "queued_rows": self.queued_rows(),
            "running_rows": self.running_rows,
            "compiled_programs": len(self.programs),
            "compilations": self.stats["compilations"],
            "compilations_on_demand": self.stats["compilations on demand"],
            "block_calls": self.stats["block calls"],  # of running batches (continuous batching)
            "row_blocks": self.stats["row blocks"],  # their running rows, summed over the calls
            "batch_requests": {str(k): v for k, v in sorted(self.batch_requests.items())},
            "batch_rows": {str(k): v for k, v in sorted(self.batch_rows.items())},
        }

    def start(self):
        self.programs.pinning = False
        self._thread.start()

    def stop(self):
        """Finish what is queued, then end the worker (the server stops taking requests first)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    # -- the worker ----------------------------------------------------------------------------
    def _lane(self, key: BatchKey) -> Lane | None:
        """Where continuous batching runs requests of `key` (None: static batching)."""
        if self.batching != "continuous" or key.alone is not None:
            return None
        if self.max_context is not None and key.prompt_len + self.lane_tokens > self.max_context:
            return None
        return Lane.of(key.prompt_len, self.lane_tokens, key.new_tokens, key.settings)

    def lanes(self, keys: list[BatchKey]) -> set[Lane]:
        """The lanes continuous batching runs `keys` in (none under static batching)."""
        return {self._lane(key) for key in keys} - {None}

    def warmup(self, keys: list[BatchKey], prompt_ids: list[int]):
        """Compile every batch size for each key, before serving: the start-up set of programs (run on the prompt
        `prompt_ids`)."""
        self.start_up |= {key.program for key in keys} | self.lanes(keys)
        for lane in self.lanes(keys):
            self.programs.pinning = True
            ids, valid = self.tokenizer.pad([prompt_ids], pad_to=lane.prompt_len)
            for size in self.batch_sizes:  # a running batch runs at the smallest size that holds its rows
                self._describe = f"at start-up: {self._lane_name(lane)}, {size} row(s) running"
                batch = self._running_batch(lane)
                for _ in range(size):
                    batch.join(None, ids[0], valid[0], lane.settings.block_length, RowSettings(), jax.random.key(0))
                batch.run()
        for key in keys:
            if self.lanes([key]):
                continue  # served by its lane
            for size in self.batch_sizes:
                rows = [(prompt_ids, RowSettings(), jax.random.key(0))] * size
                for _ in self._generate(key, rows, when="at start-up"):
                    pass  # run every block: compiling each program is the point, not its text

    def _queue(self) -> list[Waiting]:
        """The waiting jobs as the scheduler sees them (under the lock)."""
        return [Waiting(job, len(job.prompt_ids), job.key, job.lane) for job in self._waiting]

    def _loop(self):
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if not self._waiting:
                    return
                if self._waiting[0].lane is None:  # static batching: a fuller batch, if it comes soon
                    self._gather(lambda: not self._waiting or rows_like_oldest(self._queue()) >= self.max_batch)
                    if not self._waiting:
                        continue  # cancelled while it waited
                decision = decide(self._queue(), None, self.max_batch)
                jobs = [] if decision.lane is not None else self._take(decision)
            if decision.lane is not None:
                self._run_lane(decision.lane)
            else:
                self._run(jobs)

    def _gather(self, full: Callable[[], bool]):
        """Hold the next call (under the lock) up to `delay_factor` times the last call's seconds, until `full()`:
        a client that sends its next request on a reply then joins this call, not the one after."""
        deadline = time.perf_counter() + self.delay_factor * self._call_seconds
        while not full() and not self._stopping:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._cond.wait(left)

    def _lane_name(self, lane: Lane) -> str:
        return f"running batch {self.max_batch}, {BatchKey(lane.prompt_len, lane.new_tokens, lane.settings).describe()}"

    def _running_batch(self, lane: Lane) -> RunningBatch:
        return RunningBatch(
            self.model,
            lane,
            self.max_batch,
            self.programs,
            self.tokenizer.pad_token_id,
            self.tokenizer.mask_token_id,
            sizes=self.batch_sizes,
        )

    def _run_lane(self, lane: Lane):
        """Continuous batching in `lane`: at every block boundary the scheduler's decision is applied (`_step`), until
        no row runs. Rows of another lane wait for this one to drain once one of them is the oldest waiting."""
        batch = self._running_batch(lane)
        self.programs.pinning = lane in self.start_up
        self._describe = f"on first use: {self._lane_name(lane)}"
        slots: dict[int, tuple[Job, int, RowText]] = {}
        finished: set[int] = set()  # slots whose rows finished in the last call
        while True:
            with self._cond:
                called = len(slots)
                left = len(self._step(lane, batch, slots, finished).leave)
                # the clients of rows that just left may send their next requests at once: wait a little for them
                expected = called if left and called > left else 0
                self._gather(lambda expected=expected: self._step(lane, batch, slots, set()).rows >= expected)
                self.running_rows, self.batch_size = batch.running, batch.call_size
            if not slots:
                self.running_rows = self.batch_size = 0
                return
            start = time.perf_counter()
            try:
                _, steps = batch.run()
            except Exception as err:  # the running rows fail, the server goes on
                if not isinstance(err, JaxportError):
                    traceback.print_exc()
                for job in {job for job, _, _ in slots.values()}:
                    self.stats["errors"] += 1
                    job.post("error", err)
                self.running_rows = self.batch_size = 0
                return
            now = time.perf_counter()
            self._call_seconds = now - start
            self.stats.update({"block calls": 1, "row blocks": len(slots)})
            for job in {job for job, _, _ in slots.values()}:
                job.first_block, job.steps = job.first_block or now, job.steps + steps
            finished = set()
            for b, (job, index, text) in slots.items():
                final = batch.done(b)
                delta = text.update(batch.span(b), final)
                if delta and not job.cancelled:
                    job.post("delta", (index, delta))
                if text.finish_reason is not None or final:
                    finished.add(b)

    def _step(self, lane: Lane, batch: RunningBatch, slots: dict, finished: set[int]) -> Decision:
        """The scheduler's decision at a block boundary, applied (under the lock): rows that `finished` or whose
        client went away leave, waiting rows of the lane join."""
        rows = tuple(Row(b, job, b in finished, job.cancelled) for b, (job, _, _) in slots.items())
        decision = decide(self._queue(), Running(lane, batch.size, rows), self.max_batch)
        for b in decision.leave:
            job = slots.pop(b)[0]
            batch.leave(b)
            job.rows_left -= 1
            if job.rows_left == 0:
                self._end(job)
        for job in decision.admit:
            self._waiting.remove(job)
            self._join(batch, slots, job)
            job.batch_requests = len({job for job, _, _ in slots.values()})
        return decision

    def _join(self, batch: RunningBatch, slots: dict, job: Job):
        job.started, job.rows_left = time.perf_counter(), len(job.prompt_ids)
        ids, valid = self.tokenizer.pad(job.prompt_ids, pad_to=job.lane.prompt_len)
        for i, (text, key) in enumerate(zip(job.texts, job.keys(), strict=True)):
            b = batch.join(job, ids[i], valid[i], job.key.new_tokens, job.row, key)
            slots[b] = (job, i, text)

    def _end(self, job: Job):
        """A job whose rows all left a running batch."""
        self.stats.update(requests=1, rows=len(job.prompt_ids), generated_tokens=sum(t.tokens for t in job.texts))
        self.finished(job)
        if not job.cancelled:
            job.post("done", None)

    def _take(self, decision: Decision) -> list[Job]:
        """The jobs of a static batch, out of the queue (under the lock)."""
        for job in decision.admit:
            self._waiting.remove(job)
        self.running_rows, self.batch_size = decision.rows, bucket(decision.rows, self.batch_sizes)
        return list(decision.admit)

    def _run(self, jobs: list[Job]):
        start = time.perf_counter()
        for job in jobs:
            job.started, job.batch_requests = start, len(jobs)
        rows = [(job, index, text) for job in jobs for index, text in enumerate(job.texts)]
        settings = [(ids, job.row, key) for job in jobs for ids, key in zip(job.prompt_ids, job.keys(), strict=True)]
        try:
            for canvas, final, steps in self._generate(jobs[0].key, settings):
                now = time.perf_counter()
                for job in jobs:
                    job.first_block, job.steps = job.first_block or now, job.steps + steps
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
            self.running_rows = self.batch_size = 0
        seconds = self._call_seconds = time.perf_counter() - start
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * seconds
        self.stats.update(
            requests=len(jobs),
            rows=len(settings),
            batches=1,
            generated_tokens=sum(t.tokens for job in jobs for t in job.texts),
        )
        self.batch_requests[len(jobs)] += 1
        self.batch_rows[len(settings)] += 1
        log(
            f"batch: {len(jobs)} requests, {len(settings)} rows (padded to "
            f"{bucket(len(settings), self.batch_sizes)}), {seconds:.2f} s"
        )
        for job in jobs:
            self.finished(job)
            if not job.cancelled:
                job.post("done", None)

    def _generate(self, key: BatchKey, rows: list[tuple[list[int], RowSettings, jax.Array]], when="on first use"):
        """Run one batch of `(prompt ids, sampling settings, key)` rows (padded to a batch bucket with copies of the
        first row); yields as `generate_canvases` does."""
        size = bucket(len(rows), self.batch_sizes)
        rows = rows + rows[:1] * (size - len(rows))
        prompts, settings, keys = zip(*rows, strict=True)
        input_ids, attention_mask = self.tokenizer.pad(list(prompts), pad_to=key.prompt_len)
        per_row = {name: [getattr(r, name) for r in settings] for name in RowSettings.model_fields}
        self.programs.pinning = key.program in self.start_up
        self._describe = f"{when}: batch {size}, {key.describe()}"
        yield from generate_canvases(
            self.model, key, input_ids, attention_mask, per_row, jnp.stack(keys), self.programs
        )
