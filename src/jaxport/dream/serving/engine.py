"""The serving engine: a bounded queue of requests (`Job`s, token ids in) and one worker thread that owns the model
and runs what the scheduler (`jaxport.dream.serving.scheduler`, a pure function of the queue and the running batch)
decides: static batches of one compiled program, or block calls of a running batch (continuous batching).

Static batching runs a batch to the end of its longest row. With continuous batching (`lane_tokens` given), requests
decoded block-wise with the dual cache run in a `RunningBatch` of their `Lane` instead
(`jaxport.dream.serving.batches`): rows join and leave at block boundaries, each at its own block, every call at the
smallest batch size that holds the running rows, and each request's text is still its text alone.

Before serving, `warmup` compiles the start-up set (`start_up_programs` lists it, as `--compile-for` compiles it) and
reports its programs, seconds and memory mappings (`StartUpReport`).
"""

import dataclasses
import os
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxport.dream.serving.batches import Lane, RunningBatch, generate_canvases, rng_key
from jaxport.dream.serving.output import RowText
from jaxport.dream.serving.programs import (
    BatchKey,
    CompiledPrograms,
    StartUpMappings,
    batch_buckets,
    bucket,
    map_count_limit,
    memory_mappings,
)
from jaxport.dream.serving.scheduler import Decision, Row, Running, Waiting, decide, rows_like_oldest
from jaxport.dream.settings import RowSettings
from jaxport.dream.tokenizer import DreamTokenizer
from jaxport.errors import JaxportError


def log(message: str):
    print(message, file=sys.stderr, flush=True)


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


@dataclasses.dataclass(frozen=True)
class StartUpProgram:
    """One program of the start-up set as `Engine.warmup` compiles it: a static batch of `key`'s, or a running batch's
    block call in `lane` (continuous batching: each row at its own block), at `batch` rows; `block` is the block index
    of a program per block (the prefix cache's), None for a program that runs every block or the whole canvas."""

    batch: int
    key: BatchKey | None = None
    lane: Lane | None = None
    block: int | None = None


def lane_of(key: BatchKey, lane_tokens: int | None, max_context: int | None) -> Lane | None:
    """Where continuous batching runs requests of `key`, on canvases of `lane_tokens` new tokens (None: static
    batching, as for a request that runs alone or whose prompt bucket leaves no room for that canvas)."""
    if lane_tokens is None or key.alone is not None:
        return None
    if max_context is not None and key.prompt_len + lane_tokens > max_context:
        return None
    return Lane.of(key.prompt_len, lane_tokens, key.new_tokens, key.settings)


def start_up_programs(
    keys: list[BatchKey], batch_sizes: list[int], lane: Callable[[BatchKey], Lane | None]
) -> list[StartUpProgram]:
    """The programs the start-up set of `keys` compiles (`lane(key)`: where continuous batching runs a key, or None):
    each lane's running batch at every batch size, then every other key's programs at every batch size, one per
    block index where the window's shape depends on the block (the prefix cache)."""
    lanes = list(dict.fromkeys(found for key in keys if (found := lane(key)) is not None))
    programs = [StartUpProgram(size, lane=found) for found in lanes for size in batch_sizes]
    for key in keys:
        if lane(key) is not None:
            continue
        settings, blocks = key.settings, [None]
        if settings.block_length is not None and settings.cache_kind.per_block_program:
            blocks = list(range(key.new_tokens // settings.block_length))
        programs += [StartUpProgram(size, key=key, block=block) for size in batch_sizes for block in blocks]
    return programs


@dataclasses.dataclass(frozen=True)
class StartUpReport:
    """What the start-up set took: the programs compiled, the seconds they took to compile (and run once), the
    memory mappings they added, and the process's own mappings after them against its limit (None: not known)."""

    programs: int = 0
    seconds: float = 0.0
    mappings: int | None = None
    process_mappings: int | None = None
    limit: int | None = None

    def line(self) -> str:
        text = f"start-up set: {self.programs} programs compiled in {self.seconds:.1f} s"
        if self.mappings is None:
            return text
        text += f"; they hold {self.mappings:,} memory mappings (the process {self.process_mappings:,}"
        if self.limit:
            text += f" of vm.max_map_count {self.limit:,}, {self.process_mappings / self.limit:.0%}"
        return text + ")"


class QueueFull(Exception):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


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
        lane_tokens: int | None = None,
        max_context: int | None = None,
        delay_factor: float = 0.0,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        # continuous batching: rows of block-wise dual-cache programs share a canvas of `lane_tokens` new tokens (None:
        # static batching)
        self.lane_tokens, self.max_context = lane_tokens, max_context
        self.batch_sizes = batch_buckets(max_batch)
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.programs = CompiledPrograms(model, on_demand, self._compiling, self._compiled)
        self._describe = ""
        self.start_up: set = set()  # the programs (`BatchKey.program`) of the start-up set
        self.start_up_report = StartUpReport()
        self._mappings: StartUpMappings | None = None  # while the start-up set compiles
        self._compiled_before = 0  # start-up compilations before it
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
        if self._mappings is not None:
            self._mappings.check(self.stats["compilations start-up"] - self._compiled_before, memory_mappings())

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
            "start_up": dataclasses.asdict(self.start_up_report),
        }

    def start(self):
        """Start the worker; after `stop()`, a new one over the same compiled programs."""
        self.programs.pinning = False
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="dream-engine", daemon=True)
        self._thread.start()

    def stop(self):
        """Finish what is queued, then end the worker (the server stops taking requests first)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    # -- the worker ----------------------------------------------------------------------------
    def _lane(self, key: BatchKey) -> Lane | None:
        """Where continuous batching runs requests of `key` (None: static batching)."""
        return lane_of(key, self.lane_tokens, self.max_context)

    def start_up_programs(self, keys: list[BatchKey]) -> list[StartUpProgram]:
        """The programs `warmup(keys)` compiles."""
        return start_up_programs(keys, self.batch_sizes, self._lane)

    def lanes(self, keys: list[BatchKey]) -> set[Lane]:
        """The lanes continuous batching runs `keys` in (none under static batching)."""
        return {self._lane(key) for key in keys} - {None}

    def warmup(self, keys: list[BatchKey], prompt_ids: list[int]):
        """Compile every batch size for each key, before serving: the start-up set of programs (run on the prompt
        `prompt_ids`), refused (`JaxportError`) before it takes the process past its share of memory mappings
        (`StartUpMappings`). `start_up_report` says what it took, and the log."""
        self.start_up |= {key.program for key in keys} | self.lanes(keys)
        self._compiled_before = self.stats["compilations start-up"]
        self._mappings = StartUpMappings.measure(len(self.start_up_programs(keys)))
        start = time.perf_counter()
        try:
            self._compile_start_up(keys, prompt_ids)
        finally:
            baseline, self._mappings = self._mappings.baseline, None
        mappings = memory_mappings()
        self.start_up_report = StartUpReport(
            self.stats["compilations start-up"] - self._compiled_before,
            time.perf_counter() - start,
            None if mappings is None or baseline is None else mappings - baseline,
            mappings,
            map_count_limit(),
        )
        log(self.start_up_report.line())

    def _compile_start_up(self, keys: list[BatchKey], prompt_ids: list[int]):
        """Run every program of the start-up set once: each lane's running batch at every size, each other key's
        generation at every batch size (each of its blocks)."""
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
                for _ in self._generate(key, rows, when="at start-up", every_block=True):
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

    def _generate(
        self,
        key: BatchKey,
        rows: list[tuple[list[int], RowSettings, jax.Array]],
        when="on first use",
        every_block: bool = False,
    ):
        """Run one batch of `(prompt ids, sampling settings, key)` rows (padded to a batch bucket with copies of the
        first row), stopping once every row's text has ended, but block-wise for `every_block` (start-up: each
        block's program compiles; the exact path's one program is the one requests run, early stop included);
        yields as `generate_canvases` does."""
        stop_ids = None if every_block and key.settings.block_length is not None else self.tokenizer.stop_ids
        size = bucket(len(rows), self.batch_sizes)
        rows = rows + rows[:1] * (size - len(rows))
        prompts, settings, keys = zip(*rows, strict=True)
        input_ids, attention_mask = self.tokenizer.pad(list(prompts), pad_to=key.prompt_len)
        per_row = {name: [getattr(r, name) for r in settings] for name in RowSettings.model_fields}
        self.programs.pinning = key.program in self.start_up
        self._describe = f"{when}: batch {size}, {key.describe()}"
        yield from generate_canvases(
            self.model, key, input_ids, attention_mask, per_row, jnp.stack(keys), self.programs, stop_ids
        )
