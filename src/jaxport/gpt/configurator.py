"""nanoGPT's "poor man's configurator": `[config_file ...] [--key=value ...]`.

A bare argument names a Python config file (a path, or a preset in configs/gpt such as
`train_shakespeare_char` or nanoGPT's `config/train_shakespeare_char.py`); it runs with
the current values in scope and may assign known keys only. `--key=value` then
overrides one key, parsed as a Python literal and checked against the default's type.
"""

from __future__ import annotations

import ast
import difflib
import types
from importlib import resources
from pathlib import Path

from jaxport.errors import JaxportError

PRESETS = resources.files("jaxport") / "configs" / "gpt"


def _unknown(key: str, known, what: str) -> JaxportError:
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
    return JaxportError(f"unknown {what} --{key}{hint}")


def resolve_config_file(arg: str) -> Path:
    path = Path(arg)
    if path.is_file():
        return path
    preset = PRESETS / f"{path.stem}.py"
    if preset.is_file():
        return Path(str(preset))
    names = sorted(p.name.removesuffix(".py") for p in PRESETS.iterdir() if p.name.endswith(".py"))
    close = difflib.get_close_matches(path.stem, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; presets: {', '.join(names)}"
    raise JaxportError(f"config file not found: {arg}{hint}")


def _coerce(key: str, text: str, default, nullable: tuple[str, ...] = ()):
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, ValueError):
        value = text  # a bare string, e.g. --dataset=shakespeare_char
    if default is None or type(value) is type(default) or (value is None and key in nullable):
        return value
    if isinstance(default, float) and type(value) is int:
        return float(value)
    raise JaxportError(f"--{key}={text}: expected a {type(default).__name__} like the default {default!r}")


def configure(argv: list[str], defaults: dict, what: str = "flag", nullable: tuple[str, ...] = ()) -> dict:
    """`nullable` keys also accept None (e.g. --top_k=None)."""
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            path = resolve_config_file(arg)
            scope = dict(config)
            try:
                exec(compile(path.read_text(), str(path), "exec"), scope)  # nanoGPT config files are Python
            except Exception as err:
                raise JaxportError(f"config file {path} failed: {type(err).__name__}: {err}") from None
            for key, value in scope.items():
                if key.startswith("_") or isinstance(value, types.ModuleType):
                    continue
                if key not in defaults:
                    raise _unknown(key, defaults, f"key in {path}:")
                config[key] = value
            continue
        key, sep, text = arg[2:].partition("=")
        if key not in defaults:
            raise _unknown(key, defaults, what)
        if not sep:
            if isinstance(defaults[key], bool):
                config[key] = True
                continue
            raise JaxportError(f"--{key} needs a value: --{key}=VALUE")
        config[key] = _coerce(key, text, defaults[key], nullable)
    return config
