"""Hardware policy in one place: how a compiled program runs on its devices (XLA options, operand layouts, the
attention kernel, row chunks, host memory), decided from the devices, compute dtype and size of the program and
applied where each program is jitted. Models and layers describe the math; they read the decisions from
`current()` while a program is traced; each decision is a setting a user can override (`settings.py`). Beside the
policy: the process's compiled programs (`compile_cache`: kept on disk for the next run; `compile_seconds`: the time
spent compiling them) and `compile_for` with `hlo` (`--compile-for SLICE`)."""

from jaxport.runtime import host_memory
from jaxport.runtime.policy import (
    Runtime,
    current,
    devices_of,
    effective_settings,
    for_devices,
    for_tokens,
    jit,
    jit_once,
    jit_training_step,
    packs_masks,
    per_device,
    remat_block,
    runs_per_device,
    use,
)
from jaxport.runtime.settings import RuntimeSettings, configure, start, take_settings

__all__ = [
    "Runtime",
    "RuntimeSettings",
    "configure",
    "current",
    "devices_of",
    "effective_settings",
    "for_devices",
    "for_tokens",
    "host_memory",
    "jit",
    "jit_once",
    "jit_training_step",
    "packs_masks",
    "per_device",
    "remat_block",
    "runs_per_device",
    "start",
    "take_settings",
    "use",
]
