"""The bounded set of decoding programs a server runs.

What shapes the compiled program (part of `BatchKey`; requests batch only when it is equal) and what is per row:

* the program: the prompt-length bucket, the `max_tokens` bucket (the number of new tokens on the canvas) and the
  request's `ProgramSettings` (`jaxport.dream.settings`: `steps`, `alg`, `block_length`, `cache`, `schedule`);
  the batch size is rounded up to a bucket (powers of two up to `max_batch`; spare rows repeat the first). The
  server compiles a bounded set of these at start-up (`ServedPrograms`); a request outside it is refused, unless
  `--compile-on-demand` allows a few more (`CompiledPrograms` holds them all, compiled).
* per row: the prompt, `max_tokens` within its bucket (the text is cut there), `stop`, `n`, streaming, and the
  sampling settings (`temperature`, `top_p`, `top_k`, `alg_temp`, `threshold`) with the random key: runtime inputs
  `[B]` of the program (`jaxport.dream.sampling.Rows`), so any values batch together without compiling.

The start-up set is every allowed program (`ServeSettings.allowed`: the defaults and each `--program`) at every
prompt bucket and `max_tokens` bucket that fit `--max-context`, each compiled at every batch bucket. A request
outside it is refused with the reason, unless `--compile-on-demand N` lets the server compile its program on first
use (then at most N such programs are kept, least recently used evicted).

The start-up set stays within the process's limit of memory mappings (`StartUpMappings`): XLA:CPU maps every
section of each kernel it loads, and past `vm.max_map_count` the next compilation aborts the process.
"""

import bisect
import dataclasses
import time
from collections import OrderedDict
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxport.dream.program import decoding_program
from jaxport.dream.sampling import Branches
from jaxport.dream.serving.settings import ServeSettings
from jaxport.dream.settings import GenerationSettings, ProgramSettings
from jaxport.errors import JaxportError


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes the server compiles: powers of two below `max_batch`, and `max_batch`."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch})


def bucket(value: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `value`, or None when none does."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


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


# the start-up set may bring the process to this share of vm.max_map_count: the rest is left to the programs
# compiled on demand and to what the runtime maps later
MAP_SHARE = 0.6
# what makes the start-up set smaller, named where it is refused
SHRINKING_FLAGS = (
    "fewer --prompt-buckets or --max-tokens-buckets values, fewer --program combinations, a smaller --max-batch (a "
    "program per power of two up to it), no prefix cache at start-up (a program per block: --compile-on-demand "
    "serves it), or a higher limit (sysctl vm.max_map_count)"
)


def memory_mappings() -> int | None:
    """The memory mappings this process holds now (the lines of /proc/self/maps; None where there is none)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def map_count_limit() -> int | None:
    """The most memory mappings a process may hold (`vm.max_map_count`; None where it cannot be read)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class StartUpMappings:
    """The start-up set's memory mappings against the process's limit, checked after each of its `planned` programs
    compiles (`check`): the process's mappings once they all are is projected from those compiled so far (each
    program to come adds the mean of those after the first, whose own count holds the compiler's one-time
    mappings), and a set that would pass `MAP_SHARE` of the limit is refused before it gets there."""

    planned: int
    baseline: int | None  # the process's mappings before the first program (None: not known here)
    limit: int | None
    first: int | None = None  # the process's mappings after the first program

    @classmethod
    def measure(cls, planned: int) -> "StartUpMappings":
        return cls(planned, memory_mappings(), map_count_limit())

    def projected(self, compiled: int, mappings: int) -> int:
        """The process's mappings once every planned program is compiled, from `mappings` after `compiled`."""
        if compiled < 2 or self.first is None:
            return mappings
        per_program = max(mappings - self.first, 0) / (compiled - 1)
        return round(mappings + per_program * max(self.planned - compiled, 0))

    def check(self, compiled: int, mappings: int | None):
        """After the `compiled`-th program, the process holding `mappings`: raises `JaxportError` (one line naming
        what shrinks the set) where the set would pass `MAP_SHARE` of the limit."""
        if mappings is None or self.baseline is None or self.limit is None:
            return
        if compiled == 1:
            self.first = mappings
        projected = self.projected(compiled, mappings)
        if projected <= MAP_SHARE * self.limit:
            return
        raise JaxportError(
            f"the start-up set of {self.planned} programs would hold about {projected - self.baseline:,} memory "
            f"mappings ({mappings - self.baseline:,} after {compiled} of them), taking the process past "
            f"{MAP_SHARE:.0%} of its limit (vm.max_map_count {self.limit:,}; it held {self.baseline:,} before); "
            f"make the set smaller: {SHRINKING_FLAGS}"
        )


# the program settings a refusal may name, in the order it looks for the first one no allowed program has
PROGRAM_FIELDS = ("alg", "steps", "block_length", "cache", "schedule", "eps")


class NotServed(Exception):
    """A request outside the programs this server runs: `param` is the request field at fault, `code` the reason."""

    def __init__(self, param: str, message: str, code: str):
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


class ServedPrograms:
    """Which programs the server of `settings` runs: the start-up set and the on-demand policy."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.on_demand = settings.compile_on_demand

    def start_up_keys(self) -> list[BatchKey]:
        """The start-up set: every allowed program at every prompt and max_tokens bucket."""
        s = self.settings
        return [
            BatchKey(prompt_len, new_tokens, settings)
            for new_tokens in s.max_tokens_buckets
            for settings in s.allowed(new_tokens)
            for prompt_len in s.prompt_buckets
            if prompt_len + new_tokens <= s.max_context
        ]

    def prompt_bucket(self, longest: int, new_tokens: int, prompt_field: str) -> int:
        """The prompt bucket a prompt of `longest` tokens runs in with `new_tokens` new tokens. Past the largest
        bucket that fits the context, the request is refused unless `--compile-on-demand` lets the server compile
        a program for it (then its prompt length is the room the context leaves): nothing else compiles after
        start-up."""
        s = self.settings
        room = s.max_context - new_tokens
        usable = [b for b in s.prompt_buckets if b <= room]
        prompt_len = bucket(longest, usable)
        if prompt_len is not None:
            return prompt_len
        if self.on_demand:
            return room
        largest = f"the largest prompt bucket is {usable[-1]}" if usable else "no prompt bucket fits"
        raise NotServed(
            prompt_field,
            f"the prompt has {longest} tokens; with {new_tokens} new tokens and --max-context {s.max_context}, "
            f"{largest} (--prompt-buckets {','.join(map(str, s.prompt_buckets))}); start the server with a larger "
            "--prompt-buckets value, or --compile-on-demand to compile such prompts' programs on first use",
            "context_length_exceeded",
        )

    def check(self, key: BatchKey, given: set[str]):
        """Raises `NotServed` for a request whose program is not in the start-up set, unless `--compile-on-demand`
        lets the server compile it: names the first setting whose value no allowed program has (`given`: the
        settings the request set), with the allowed values."""
        allowed = self.settings.allowed(key.new_tokens)
        if key.settings in allowed or self.on_demand:
            return
        fields = PROGRAM_FIELDS
        name = next(
            (n for n in fields if getattr(key.settings, n) not in {getattr(a, n) for a in allowed}),
            next(n for n in fields if n in given) if given & set(fields) else "steps",
        )
        param = "threshold" if name == "block_length" and "block_length" not in given and "threshold" in given else name
        combos = "; ".join(
            ", ".join(f"{n}={getattr(a, n)}" for n in fields if getattr(a, n) is not None) for a in allowed
        )
        raise NotServed(
            param,
            f"{name}={getattr(key.settings, name)} is not among the programs this server compiled at start-up "
            f"for {key.new_tokens} new tokens (allowed {name}: "
            f"{', '.join(sorted({str(getattr(a, name)) for a in allowed}))}; programs: {combos}); "
            f"start it with --program or --compile-on-demand",
            "setting_not_served",
        )

    def mask_prompt(self, prompt_field: str):
        """Raises `NotServed` unless the server may compile the program of its own that a prompt holding the mask
        token needs."""
        if not self.on_demand:
            raise NotServed(
                prompt_field,
                "holds the mask token, which makes a program of its own; start the server with "
                "--compile-on-demand to serve such prompts",
                "setting_not_served",
            )
