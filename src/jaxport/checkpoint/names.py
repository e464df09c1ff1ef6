"""Checkpoint tensor names <-> module parameter paths, from a table, in both directions.

Each family's params.py lists `(checkpoint template, module template)` pairs, as bonsai's params.py
files list regexes: `{name}` matches one dotted name part, `{i}` a number (a layer index), `{rest}`
any dotted tail. A name is matched against the checkpoint side and the module path formatted from
the other side, or the reverse when saving:

    NAMES = NameTable([("model.layers.{i}.{rest}", "layers.{i}.{rest}"), ("lm_head.weight", "lm_head.weight")])
    NAMES.to_module("model.layers.3.mlp.up_proj.weight")   # ('layers', 3, 'mlp', 'up_proj', 'weight')
    NAMES.to_checkpoint(("layers", 3, "mlp", "up_proj", "weight"))  # 'model.layers.3.mlp.up_proj.weight'
"""

import re

_FIELDS = {"i": r"\d+", "name": r"[^.]+", "rest": r".+"}


def _pattern(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)
    regex = "".join(re.escape(part) if n % 2 == 0 else f"(?P<{part}>{_FIELDS[part]})" for n, part in enumerate(parts))
    return re.compile(f"^{regex}$")


def path_parts(dotted: str) -> tuple:
    """`"layers.3.mlp"` -> `("layers", 3, "mlp")`: list indices as ints, as nnx state paths have them."""
    return tuple(int(p) if p.isdigit() else p for p in dotted.split("."))


class NameTable:
    """Checkpoint name templates paired with module path templates (see the module docstring)."""

    def __init__(self, rules: list[tuple[str, str]]):
        self.rules = [(_pattern(ckpt), ckpt, _pattern(module), module) for ckpt, module in rules]

    def to_module(self, name: str) -> tuple | None:
        """The module path of checkpoint tensor `name`, or None if no rule covers it."""
        for ckpt_re, _, _, module in self.rules:
            found = ckpt_re.match(name)
            if found:
                return path_parts(module.format(**found.groupdict()))
        return None

    def to_checkpoint(self, path: tuple) -> str | None:
        """The checkpoint name of module path `path` (`("layers", 3, ...)`), or None."""
        dotted = ".".join(str(p) for p in path)
        for _, ckpt, module_re, _ in self.rules:
            found = module_re.match(dotted)
            if found:
                return ckpt.format(**found.groupdict())
        return None
