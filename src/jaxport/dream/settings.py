"""Dream decoding settings: one validated model for the Python API, the `jaxport dream` CLI and the server.

The settings fall in two groups, by what a compiled decoding program makes of them:

* `ProgramSettings` shape the program: `steps`, `alg`, `eps`, `block_length`, `cache`, `schedule` (with the
  canvas geometry: batch, prompt length, new tokens). Each distinct combination is one compilation.
* `RowSettings` are sampling values of the rows: `temperature`, `top_p`, `top_k`, `alg_temp`, `threshold` (and
  the random key, passed beside them), each one value for every row or a list of one per row. The program takes
  them as runtime inputs of shape `[B]` (`jaxport.dream.sampling.Rows`), read only by the sampler and the unmask
  rule: one compiled program serves every value.

`GenerationSettings` holds both, flat, as `diffusion_generate` takes them, and `early_stop` (on by default): a
decoding given end-of-text ids (`diffusion_generate(stop_token_ids=...)`, which every caller that cuts text at
end-of-text passes) stops once every row's text has ended, which changes no text; never under
`schedule="fastdllm"` (Fast-dLLM decodes every block). `of(**arguments)` validates and
raises one `JaxportError` naming the argument, its value and what is expected; `check(new_tokens)` checks the
number of new tokens likewise, then adds the rules that relate settings to it and to each other (steps and blocks
must divide it): each value is checked on its own before any rule between values, so an error names the value
that is wrong.
"""

from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, TypeAdapter, ValidationError

from jaxport.dream.cache_kinds import CACHE_KINDS, CACHES, DUAL, PREFIX, CacheKind
from jaxport.errors import JaxportError

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")
# "jaxport": the schedule's share of each row's masks per step, fixed step budgets; "fastdllm": Fast-dLLM's
# `generation_utils_block._sample` (jaxport.dream.fast)
SCHEDULES = ("jaxport", "fastdllm")
BLOCKWISE = ("block_length", "cache", "threshold", "schedule")  # any of them (non-default) decodes block-wise


def _rule(ok, expected: str):
    def check(value):
        if value is not None and not ok(value):
            raise ValueError(f"{expected}, got {value!r}")
        return value

    return AfterValidator(check)


def _one_of(choices: tuple, what: str):
    def check(value):
        if value is not None and value not in choices:
            raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")
        return value

    return AfterValidator(check)


def _number(value):
    """numpy scalars as the Python numbers they hold (`steps=np.int64(8)` is an integer here); a bool is no number
    (pydantic would read `steps=True` as 1)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"expected a number, got {value!r}")
    return value.item() if hasattr(value, "item") and getattr(value, "shape", None) == () else value


Count = Annotated[int, BeforeValidator(_number), _rule(lambda v: v >= 1, "must be a positive integer")]
NonNegative = Annotated[float, BeforeValidator(_number), _rule(lambda v: v >= 0, "must be >= 0")]
Probability = Annotated[float, BeforeValidator(_number), _rule(lambda v: 0 < v <= 1, "must be in (0, 1]")]
Fraction = Annotated[float, BeforeValidator(_number), _rule(lambda v: 0 < v < 1, "must be in (0, 1)")]
Algorithm = Annotated[str, _one_of(ALGORITHMS, "alg")]
_CACHE_NAMES = [repr(name) for name in CACHE_KINDS]
Cache = Annotated[str, _rule(lambda v: v in CACHES, f"must be {', '.join(_CACHE_NAMES[:-1])} or {_CACHE_NAMES[-1]}")]
Schedule = Annotated[str, _one_of(SCHEDULES, "schedule")]


def problem(error: dict) -> str:
    """What is wrong in one pydantic error (`ValidationError.errors()` item): jaxport's words where its own rule
    failed, else pydantic's with the value given."""
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    if error["type"] == "missing":  # its input is the whole object the field is missing from
        return error["msg"]
    return f"{error['msg']}, got {error['input']!r}"


_COUNT = TypeAdapter(Count)


def count(name: str, value) -> int:
    """`value`, checked as a positive integer (as `steps`), or a `JaxportError` naming `name` and the value."""
    try:
        return _COUNT.validate_python(value)
    except ValidationError as err:
        raise JaxportError(f"{name}: {problem(err.errors()[0])}") from None


def _per_row(scalar):
    """`scalar`, or one such value per row: a list, tuple or 1-D array, stored as a tuple (hashable)."""
    adapter = TypeAdapter(scalar | None)

    def one(value, where: str):
        try:
            return adapter.validate_python(value)
        except ValidationError as err:
            raise ValueError(where + problem(err.errors()[0])) from None

    def validate(value):
        if isinstance(value, np.ndarray) and value.ndim == 1:
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("expected one value, or a non-empty list of one per row")
            return tuple(one(v, f"row {i}: ") for i, v in enumerate(value))
        return one(value, "")

    return Annotated[Any, BeforeValidator(validate)]


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")  # frozen: hashable, a compiled program's static argument


class RowSettings(_Settings):
    """Per-row sampling values (see the module docstring): each one value for every row, or a tuple of one per row."""

    temperature: _per_row(NonNegative) = 0.0
    top_p: _per_row(Probability) = None
    top_k: _per_row(Count) = None
    alg_temp: _per_row(NonNegative) = None
    threshold: _per_row(Probability) = None

    def rows(self, batch: int) -> list["RowSettings"]:
        """The settings of each of `batch` rows (one value per field); a field given per row must have `batch`."""
        columns = {}
        for name in RowSettings.model_fields:
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != batch:
                raise JaxportError(f"{name}: {len(value)} per-row values for a batch of {batch} rows")
            columns[name] = value if isinstance(value, tuple) else (value,) * batch
        return [RowSettings.model_construct(**{k: v[b] for k, v in columns.items()}) for b in range(batch)]

    def each(self, name: str) -> tuple:
        """The values of one field, as a tuple (one value for every row: a tuple of one)."""
        value = getattr(self, name)
        return value if isinstance(value, tuple) else (value,)


class ProgramSettings(_Settings):
    """The settings that shape the compiled program (see the module docstring)."""

    steps: Count = 512  # upstream's default; the CLI, the text API and the server use one step per new token
    alg: Algorithm = "origin"
    eps: Fraction = 1e-3
    block_length: Count | None = None
    cache: Cache | None = None
    schedule: Schedule = "jaxport"

    @property
    def cache_kind(self) -> CacheKind:
        """The kind of cache `cache` names (`jaxport.dream.cache_kinds`)."""
        return CACHE_KINDS[self.cache]


class GenerationSettings(ProgramSettings, RowSettings):
    """Every decoding setting, validated (`of`), split into the program's (`program`) and the rows' (`row`), and
    `early_stop` (see the module docstring)."""

    early_stop: bool = True

    @classmethod
    def of(cls, **arguments) -> "GenerationSettings":
        """Validated settings; `top_p=1` and `alg_temp=0` mean no filter and no sampled order, as upstream, and
        are stored as None so that equal behaviour compiles once."""
        try:
            settings = cls(**arguments)
        except ValidationError as err:
            raise settings_error(err) from None
        no_filter = lambda v: None if v == 1 else v  # noqa: E731
        unordered = lambda v: v or None  # noqa: E731
        return settings.model_copy(
            update={
                name: tuple(map(rule, value)) if isinstance(value, tuple) else rule(value)
                for name, rule in (("top_p", no_filter), ("alg_temp", unordered))
                for value in [getattr(settings, name)]
            }
        )

    @property
    def blockwise(self) -> bool:
        """Whether a fast-decoding setting is given (then generation runs block-wise, `jaxport.dream.fast`); a
        threshold counts when any row has one."""
        given = lambda name: any(v not in (None, "jaxport") for v in self.each(name))  # noqa: E731
        return any(given(name) for name in BLOCKWISE)

    @property
    def stops_early(self) -> bool:
        """Whether a decoding given end-of-text ids stops once every row's text has ended: `early_stop`, never
        under `schedule="fastdllm"`."""
        return self.early_stop and self.schedule != "fastdllm"

    @property
    def program(self) -> ProgramSettings:
        return ProgramSettings(**{name: getattr(self, name) for name in ProgramSettings.model_fields})

    @property
    def row(self) -> RowSettings:
        return RowSettings(**{name: getattr(self, name) for name in RowSettings.model_fields})

    def arguments(self) -> dict:
        """The settings as `diffusion_generate` keyword arguments, those at their default left out."""
        return self.model_dump(exclude_defaults=True)

    def check(self, new_tokens: int, blockwise: bool = False, batch: int | None = None) -> "GenerationSettings":
        """These settings for a canvas of `new_tokens` new tokens (and `batch` rows, which per-row values must
        match); block-wise (`blockwise` or a fast-decoding setting), with `block_length` resolved (default: one
        block of all new tokens). `new_tokens` is checked on its own (as `max_new_tokens`) before the rules that
        relate it to the settings, which `of` has checked one by one."""
        new_tokens = count("max_new_tokens", new_tokens)
        if batch is not None:
            self.row.rows(batch)
        _check(
            "steps",
            self.steps <= new_tokens,
            f"steps={self.steps} must be between 1 and the number of new tokens ({new_tokens})",
        )
        if not (blockwise or self.blockwise):
            return self
        block_length = new_tokens if self.block_length is None else self.block_length
        _check(
            "block_length",
            block_length <= new_tokens and new_tokens % block_length == 0,
            f"block_length={block_length} must divide the number of new tokens ({new_tokens})",
        )
        blocks = new_tokens // block_length
        _check(
            "steps",
            self.steps % blocks == 0,
            f"steps={self.steps} must be divisible by the number of blocks ({blocks} = "
            f"{new_tokens} new tokens / block_length {block_length})",
        )
        _check(
            "alg",
            not (self.schedule == "fastdllm" and self.alg == "origin"),
            "schedule 'fastdllm' ranks the block's masks by confidence, which alg 'origin' (a random order) has "
            "not; Fast-dLLM's scheduled decoding is alg 'entropy', its confidence_threshold alg 'maskgit_plus'",
        )
        return self.model_copy(update={"block_length": block_length})


def _check(name: str, ok: bool, message: str):
    if not ok:
        raise JaxportError(f"{name}: {message}")


def settings_error(err: ValidationError) -> JaxportError:
    """The first problem in `err` as `name: what is wrong` (the message of jaxport's own rules, or pydantic's
    with the value given)."""
    error = err.errors()[0]
    name = ".".join(str(part) for part in error["loc"]) or "settings"
    if error["type"] == "extra_forbidden":
        return JaxportError(f"{name}: unknown generation argument")
    return JaxportError(f"{name}: {problem(error)}")


FASTDLLM_TOP_K = 50  # transformers' PretrainedConfig default, which reaches Fast-dLLM's generation config


def fastdllm_settings(
    *,
    steps: int,
    alg: str = "origin",
    threshold: float = 0.9,
    block_length: int = 32,
    dual_cache: bool = False,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    alg_temp: float | None = None,
) -> dict:
    """The `diffusion_generate` settings that decode as Fast-dLLM's `diffusion_generate` (generation_utils_block.py)
    called with these arguments and defaults. Its `confidence_threshold` ranks by the candidate's probability
    (`maskgit_plus`); every other `alg` is its scheduled decoding, ranked by negative entropy. A call without
    `top_k` decodes with 50 there: `DreamGenerationConfig.from_model_config` takes transformers' `PretrainedConfig`
    defaults (top_k 50, top_p 1.0, which filters nothing)."""
    by_threshold = alg == "confidence_threshold"
    return dict(
        steps=steps,
        alg="maskgit_plus" if by_threshold else "entropy",
        threshold=threshold if by_threshold else None,
        block_length=block_length,
        cache=DUAL.name if dual_cache else PREFIX.name,
        schedule="fastdllm",
        temperature=temperature,
        top_p=top_p,
        top_k=FASTDLLM_TOP_K if top_k is None else top_k,
        alg_temp=alg_temp,
    )
