"""The training-run config: upstream's `cfg_pretrain.yaml` with its `arch` group (`arch/<name>.yaml`),
command-line overrides in Hydra's syntax (`lr=1e-4 arch.L_layers=2 +run_name=x data_paths=[a,b]
~key`), parsed by Hydra's own override parser and applied with OmegaConf, then validated into a
typed `RunConfig`.

Keys are checked against `RunConfig`'s schema rather than against the YAML: `key=value` and `+key=value`
both set any key the schema knows (upstream needs `+` for keys its YAML leaves out, such as run_name;
both spellings work here), and an unknown key is an error that lists the closest known ones.
"""

import difflib
from importlib import resources

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxport.errors import JaxportError
from jaxport.trm.config import ArchConfig, RunConfig
from jaxport.typed_config import validate

CONFIG_DIR = resources.files("jaxport") / "configs" / "trm"
GROUPS = ("arch",)


def _preset(group: str | None, name: str) -> dict:
    folder = CONFIG_DIR / group if group else CONFIG_DIR
    path = folder / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))
        raise JaxportError(f"no {group or 'run'} preset {name!r} (have: {', '.join(choices)})")
    return yaml.safe_load(path.read_text())


def _compose(choices: dict[str, str]) -> dict:
    """cfg_pretrain.yaml with its defaults list resolved (`- arch: trm` loads arch/trm.yaml as `arch`)."""
    config = _preset(None, "cfg_pretrain")
    for entry in config.pop("defaults", []):
        if isinstance(entry, dict):
            ((group, option),) = entry.items()
            config[group] = _preset(group, choices.get(group, option))
    return config


def _unknown(key: str, known, where: str) -> JaxportError:
    close = difflib.get_close_matches(key, sorted(known), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return JaxportError(f"unknown config key {key!r} in {where}{hint}")


def _known_keys(path: list[str]) -> set[str] | None:
    """Keys the schema allows under `path` (None: any, e.g. inside an evaluator's options)."""
    if path == []:
        return set(RunConfig.model_fields)
    if path == ["arch"]:
        return set(ArchConfig.model_fields)
    if path == ["arch", "loss"]:
        return {"name", "loss_type"}
    return None


def parse_overrides(overrides: list[str]):
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as err:
        raise JaxportError(
            f"cannot parse override: {str(err).splitlines()[0]} (expected key=value, see "
            f"https://hydra.cc/docs/advanced/override_grammar/basic)"
        ) from None
    for override in parsed:
        if override.is_sweep_override():
            raise JaxportError(f"override {override.input_line!r} is a sweep; give one value per key")
    return parsed


def load_run_config(overrides: list[str], base: dict | None = None) -> RunConfig:
    """cfg_pretrain.yaml (or `base`, e.g. a run's saved all_config.yaml) with the overrides applied."""
    parsed = parse_overrides(overrides)
    choices = {o.key_or_group: o.value() for o in parsed if o.key_or_group in GROUPS and isinstance(o.value(), str)}
    if base is None:
        config = _compose(choices)
    else:
        config = dict(base)
        for group, option in choices.items():
            config[group] = _preset(group, option)
    cfg = OmegaConf.create(config)
    for override in parsed:
        key = override.key_or_group
        if key in choices:
            continue
        *parents, leaf = key.split(".")
        known = _known_keys(parents)
        if known is not None and leaf not in known:
            raise _unknown(leaf, known, "the run config" + "".join(f".{p}" for p in parents))
        if override.type == OverrideType.DEL:  # `~key`: back to the schema's default
            node = OmegaConf.select(cfg, ".".join(parents)) if parents else cfg
            if node is not None and leaf in node:
                node.pop(leaf)
            continue
        try:
            OmegaConf.update(cfg, key, override.value(), merge=False, force_add=True)
        except OmegaConfBaseException as err:
            raise JaxportError(f"cannot apply override {override.input_line!r}: {str(err).splitlines()[0]}") from None
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise JaxportError(f"config interpolation failed: {str(err).splitlines()[0]}") from None
    return validate(
        RunConfig, resolved, "the run config", unknown_key_hint="" if base is None else " (from the saved config)"
    )
