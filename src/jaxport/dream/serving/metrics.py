"""The Prometheus metrics of `jaxport dream serve` (`GET /metrics`, the text format every scraper reads).

Each server has its own `CollectorRegistry`, so several apps in one process do not share counters. Counters and
histograms are updated as requests and batches end; the gauges (queue depth, running rows, batch occupancy, compiled
programs, the start-up set and the process's memory mappings) are read from the engine at scrape time.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxport.dream.serving.engine import Engine, Job
from jaxport.dream.serving.programs import map_count_limit, memory_mappings

CONTENT_TYPE = CONTENT_TYPE_LATEST
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _known(value) -> float:
    """A gauge's value; NaN where it is not known (a process without /proc)."""
    return float("nan") if value is None else float(value)


class ServerMetrics:
    """The metrics of one server, named `jaxport_dream_*`."""

    def __init__(self, engine: Engine):
        self.registry = registry = CollectorRegistry()
        p = "jaxport_dream_"
        self.requests = Counter(
            p + "requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=registry
        )
        Gauge(p + "queue_rows", "rows waiting for a batch", registry=registry).set_function(engine.queued_rows)
        Gauge(p + "running_rows", "rows of the batch running now", registry=registry).set_function(
            lambda: engine.running_rows
        )
        Gauge(
            p + "batch_occupancy",
            "running rows over the batch size they are padded to (0 when idle)",
            registry=registry,
        ).set_function(lambda: engine.running_rows / engine.batch_size if engine.batch_size else 0.0)
        Gauge(p + "compiled_programs", "decoding programs held compiled", registry=registry).set_function(
            lambda: len(engine.programs)
        )
        self._start_up_gauges(engine)
        self.time_to_first_block = Histogram(
            p + "time_to_first_block_seconds",
            "from a request's arrival to its first finished block (the whole canvas on the exact path)",
            buckets=SECONDS,
            registry=registry,
        )
        self.latency = Histogram(
            p + "request_seconds", "from a request's arrival to its end", buckets=SECONDS, registry=registry
        )
        self.generated_tokens = Counter(
            p + "generated_tokens", "completion tokens returned to clients", registry=registry
        )
        self.steps = Histogram(
            p + "decoding_steps", "denoising steps run for a request", buckets=STEPS, registry=registry
        )
        self.compilations = Counter(
            p + "compilations", "decoding programs compiled, by set (start-up or on demand)", ["set"], registry=registry
        )
        self.compile_seconds = Counter(
            p + "compile_seconds", "seconds spent compiling decoding programs, by set", ["set"], registry=registry
        )
        for label in ("start-up", "on demand"):  # both series exist from the start, at 0
            self.compilations.labels(label)
            self.compile_seconds.labels(label)
        engine.finished = self.job_finished
        engine.compiled_hooks.append(self.compiled)

    def _start_up_gauges(self, engine: Engine):
        """What the start-up set took (`Engine.start_up_report`) and the memory mappings against the process's limit."""
        p, registry = "jaxport_dream_", self.registry
        Gauge(p + "start_up_programs", "programs the start-up set compiled", registry=registry).set_function(
            lambda: engine.start_up_report.programs
        )
        Gauge(
            p + "start_up_seconds", "seconds the start-up set took to compile (each run once)", registry=registry
        ).set_function(lambda: engine.start_up_report.seconds)
        Gauge(
            p + "start_up_memory_mappings", "memory mappings the start-up set's programs added", registry=registry
        ).set_function(lambda: _known(engine.start_up_report.mappings))
        Gauge(
            p + "memory_mappings", "memory mappings the process holds (/proc/self/maps)", registry=registry
        ).set_function(lambda: _known(memory_mappings()))
        Gauge(
            p + "memory_mappings_limit",
            "the most memory mappings the process may hold (vm.max_map_count)",
            registry=registry,
        ).set_function(lambda: _known(map_count_limit()))

    def compiled(self, seconds: float, when: str):
        self.compilations.labels(when).inc()
        self.compile_seconds.labels(when).inc(seconds)

    def job_finished(self, job: Job):
        """A job's batch ended (from the worker thread)."""
        if job.first_block is not None:
            self.time_to_first_block.observe(job.first_block - job.submitted)
        self.generated_tokens.inc(sum(t.tokens for t in job.texts))
        self.steps.observe(job.steps)

    def answered(self, endpoint: str, status: int):
        self.requests.labels(endpoint, str(status)).inc()

    def ended(self, job: Job):
        """A job's last event reached its client."""
        self.latency.observe(time.perf_counter() - job.submitted)

    def text(self) -> bytes:
        return generate_latest(self.registry)
