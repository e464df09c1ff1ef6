"""What `jaxport dream serve` accepts and how it batches: its flags, checked once at start-up."""

import dataclasses

from jaxport.dream.settings import ALGORITHMS, GenerationSettings, ProgramSettings
from jaxport.errors import JaxportError


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """What the server accepts and how it batches (see `jaxport dream serve --help`)."""

    model_name: str
    max_batch: int = 8
    max_queue: int = 64
    max_context: int = 2048
    prompt_buckets: tuple[int, ...] = (128, 512)
    max_tokens_buckets: tuple[int, ...] = (64, 256)
    default_max_tokens: int | None = None  # None: the smallest max_tokens bucket
    alg: str = "entropy"
    fast: tuple = ()  # fast-decoding (name, value) pairs (`settings.BLOCKWISE`), for requests that do not set them
    # more program-shaping combinations compiled at start-up, each a tuple of (name, value) pairs over the defaults
    programs: tuple = ()
    compile_on_demand: int = 0  # programs outside the start-up set compiled for requests, least recently used evicted
    batching: str = "static"  # or "continuous": block-wise dual-cache requests join a running batch between blocks
    max_body_bytes: int = 1 << 20  # a longer request body gets HTTP 413
    # a batch with room waits up to this many times the last call's seconds for requests to fill it (0: never)
    schedule_delay_factor: float = 0.0

    def __post_init__(self):
        for name in ("max_batch", "max_queue", "max_context", "default_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise JaxportError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_queue < self.max_batch:
            raise JaxportError(f"--max-queue {self.max_queue} must hold a full batch (--max-batch {self.max_batch})")
        for name in ("prompt_buckets", "max_tokens_buckets"):
            values = getattr(self, name)
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise JaxportError(
                    f"--{name.replace('_', '-')} {','.join(map(str, values))}: expected increasing positive sizes"
                )
        if self.default_max_tokens and self.default_max_tokens > self.max_tokens_buckets[-1]:
            raise JaxportError(
                f"--default-max-tokens {self.default_max_tokens} exceeds the largest "
                f"--max-tokens-buckets value {self.max_tokens_buckets[-1]}"
            )
        if self.alg not in ALGORITHMS:
            raise JaxportError(f"--alg {self.alg!r}: choose one of {', '.join(ALGORITHMS)}")
        if self.batching not in ("static", "continuous"):
            raise JaxportError(f"--batching {self.batching!r}: choose static or continuous")
        if not self.schedule_delay_factor >= 0:
            raise JaxportError(f"--schedule-delay-factor must be at least 0, got {self.schedule_delay_factor}")
        if self.compile_on_demand < 0:
            raise JaxportError(f"--compile-on-demand must be at least 0, got {self.compile_on_demand}")
        for new_tokens in self.max_tokens_buckets:
            self.allowed(new_tokens)  # a bad --program is an error at start-up

    @property
    def lane_tokens(self) -> int | None:
        """The new tokens of a running batch's canvas, the largest `max_tokens` bucket (continuous batching; None:
        static batching)."""
        return self.max_tokens_buckets[-1] if self.batching == "continuous" else None

    def defaults(self, new_tokens: int) -> dict:
        """The program settings of a request that sets none (steps: one per new token)."""
        return {"steps": new_tokens, "alg": self.alg, **dict(self.fast)}

    def allowed(self, new_tokens: int) -> list[ProgramSettings]:
        """The program settings compiled at start-up for canvases of `new_tokens` new tokens: the defaults, then
        each `--program` over them."""
        allowed = []
        for extra in ((), *self.programs):
            try:
                settings = GenerationSettings.of(**{**self.defaults(new_tokens), **dict(extra)}).check(new_tokens)
            except JaxportError as err:
                spec = ",".join(f"{k}={v}" for k, v in extra)
                raise JaxportError(f"--program {spec} (with {new_tokens} new tokens): {err}") from None
            if settings.program not in allowed:
                allowed.append(settings.program)
        return allowed
