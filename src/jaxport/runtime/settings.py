"""The runtime choices a user can set: each is `auto` (the policy's choice for the devices and the command) unless
the command line (`--runtime attention=xla,remat=none`, every family) or the family's config overrides it.

- `attention`: xla (one masked product), causal_blocks (causal self-attention in blocks of queries), cudnn (cuDNN's
  fused kernel where it applies), splash (Pallas's splash-attention kernel where it applies: TPUs v4 and later;
  elsewhere Pallas's interpreter runs it, for tests); auto: causal_blocks on CPUs, cudnn on GPUs, splash on TPUs
  v4, v5e, v5p and v6e, xla elsewhere.
- `remat`: what the backward pass computes again instead of keeping: none; attention_scores (each layer's
  `[B, H, S, T]` scores); block (each transformer block, from its input alone); save_dots (each block but its
  products with weights); auto: attention_scores on TPUs, none elsewhere.
- `row_major_operands`, `head_in_out`, `split_rows`: on or off (`policy.Runtime` says what each does); auto: on on
  CPUs, off elsewhere.
- `host_memory`: training (glibc keeps freed memory, a training step's temporaries stay in the heap), serving (glibc
  keeps freed memory), off (glibc's defaults); auto: training for commands that train, serving for the others, off
  without glibc (`host_memory`).
- `async_dispatch`: JAX's asynchronous CPU dispatch, on or off; auto: off where host_memory is training (a step's
  temporaries come from the main thread's heap), on elsewhere.

Host settings act on the process: the `jaxport` command applies them (`start`) before any work, from its command
line. Program settings act on the programs jitted afterwards (`policy.for_devices` reads them)."""

import sys

import pydantic

from jaxport.errors import JaxportError
from jaxport.runtime import host_memory

SWITCH = ("auto", "on", "off")
CHOICES = {
    "attention": ("auto", "xla", "causal_blocks", "cudnn", "splash"),
    "remat": ("auto", "none", "attention_scores", "block", "save_dots"),
    "row_major_operands": SWITCH,
    "head_in_out": SWITCH,
    "split_rows": SWITCH,
    "host_memory": ("auto", "training", "serving", "off"),
    "async_dispatch": SWITCH,
}
HOST_SETTINGS = ("host_memory", "async_dispatch")
FLAG = "--runtime"


class RuntimeSettings(pydantic.BaseModel, frozen=True):
    """One value per setting of `CHOICES`; `auto` leaves the choice to the policy."""

    attention: str = "auto"
    remat: str = "auto"
    row_major_operands: str = "auto"
    head_in_out: str = "auto"
    split_rows: str = "auto"
    host_memory: str = "auto"
    async_dispatch: str = "auto"

    @pydantic.model_validator(mode="before")
    @classmethod
    def _known(cls, data):
        """One JaxportError naming the bad key or value and the allowed ones (raised through pydantic as it is)."""
        if isinstance(data, RuntimeSettings):
            return data
        if not isinstance(data, dict):
            raise JaxportError(f"runtime: expected settings like attention=xla,remat=none, got {data!r}")
        for key, value in data.items():
            if key not in CHOICES:
                raise JaxportError(f"runtime: unknown setting {key!r}; the settings are {', '.join(CHOICES)}")
            if str(value) not in CHOICES[key]:
                raise JaxportError(f"runtime: {key}={value} is not one of {', '.join(CHOICES[key])}")
        return {key: str(value) for key, value in data.items()}

    @classmethod
    def parse(cls, text: str) -> "RuntimeSettings":
        """`attention=xla,remat=none` (empty: every setting auto)."""
        pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise JaxportError(f"runtime: {text!r}: expected NAME=VALUE pairs separated by commas, e.g. attention=xla")
        return cls.model_validate({name.strip(): value.strip() for name, value in pairs})

    def explicit(self) -> dict:
        """The settings that are not auto."""
        return {key: value for key, value in self.model_dump().items() if value != "auto"}

    def over(self, base: "RuntimeSettings") -> "RuntimeSettings":
        """`base` with this one's explicit settings in place of its own."""
        return base.model_copy(update=self.explicit())


def take_settings(argv: list[str]) -> tuple[RuntimeSettings, list[str]]:
    """(the settings of every `--runtime NAME=VALUE,...` or `--runtime=NAME=VALUE,...` in `argv`, later ones winning;
    `argv` without them)."""
    settings, rest, args = RuntimeSettings(), [], iter(argv)
    for arg in args:
        if arg == FLAG:
            text = next(args, None)
            if text is None:
                raise JaxportError(f"runtime: {FLAG} needs NAME=VALUE pairs, e.g. {FLAG} attention=xla")
        elif arg.startswith(FLAG + "="):
            text = arg[len(FLAG) + 1 :]
        else:
            rest.append(arg)
            continue
        settings = RuntimeSettings.parse(text).over(settings)
    return settings, rest


# This process's settings: the command line's (`start`) over the family config's (`configure`); `announce`: the
# start-up line is still to be printed (`announce_once`).
_process = {"command": RuntimeSettings(), "config": RuntimeSettings(), "announce": False}


def start(settings: RuntimeSettings, *, trains: bool) -> None:
    """A command's start, before any work: `settings` (its command line's) become this process's, and its host
    settings are applied, auto resolved for a command that trains (`trains`) or not. Its programs' first runtime
    prints the start-up line (`announce_once`)."""
    memory = settings.host_memory
    if memory == "auto":
        memory = "off" if not host_memory.available() else "training" if trains else "serving"
    if memory != "off":
        host_memory.tune_process(training=memory == "training")
    if settings.async_dispatch != "auto":
        import jax  # here: a plain import of this module leaves JAX alone

        jax.config.update("jax_cpu_enable_async_dispatch", settings.async_dispatch == "on")
    _process.update(command=settings, config=RuntimeSettings(), announce=True)


def configure(settings: RuntimeSettings) -> None:
    """The family config's settings (a TRM `runtime:` mapping, a nanoGPT config file's `runtime = "..."`), under the
    command line's. Host settings act on the process before a config is read: one here is an error."""
    for key in HOST_SETTINGS:
        value = getattr(settings, key)
        if value != "auto" and value != getattr(_process["command"], key):
            raise JaxportError(
                f"runtime: {key}={value} applies to the process before its config is read: give it on the command "
                f"line, {FLAG} {key}={value}"
            )
    _process["config"] = settings


def chosen() -> RuntimeSettings:
    """This process's settings: the command line's over the config's (every one auto in a library's process)."""
    return _process["command"].over(_process["config"])


def host() -> dict:
    """The host settings in effect: the heap's policy and JAX's CPU dispatch."""
    import jax

    memory = "training" if host_memory.tuned_for_training() else "serving" if host_memory.tuned() else "off"
    dispatch = "on" if jax.config.read("jax_cpu_enable_async_dispatch") else "off"
    return {"host_memory": memory, "async_dispatch": dispatch}


def line(values: dict) -> str:
    """The start-up line: `runtime: attention=causal_blocks remat=none ...`."""
    return "runtime: " + " ".join(f"{key}={value}" for key, value in values.items())


def announce_once(values) -> None:
    """Print the start-up line of a command's first program (stderr, process 0), once: `line(values())`."""
    if not _process["announce"]:
        return
    _process["announce"] = False
    import jax

    if jax.process_index() == 0:
        print(line(values()), file=sys.stderr, flush=True)
