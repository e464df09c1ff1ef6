"""The training-run config: upstream's `cfg_pretrain.yaml` + `arch/<name>.yaml`, with Hydra-style
overrides (`lr=1e-4 arch.L_layers=2 +run_name=x data_paths="[a,b]"`)."""

import difflib
from pathlib import Path

import yaml

from jaxport.errors import JaxportError
from jaxport.trm.config import TRMConfig

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs" / "trm"


def _preset(path: Path, what: str) -> dict:
    if not path.exists():
        choices = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise JaxportError(f"no {what} preset {path.stem!r} (have: {', '.join(choices)})")
    return yaml.safe_load(path.read_text())


def _unknown(key: str, known, where: str) -> JaxportError:
    close = difflib.get_close_matches(key, sorted(known), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return JaxportError(f"unknown config key {key!r} in {where}{hint} (prefix with + to add a new key)")


def parse_overrides(overrides: list[str]) -> list[tuple[str, object, bool]]:
    """`[+]key.sub=value` -> (dotted key, YAML-parsed value, forced add)."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise JaxportError(f"override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        add = key.startswith("+")
        key = key.lstrip("+")
        parsed.append((key, _parse_value(raw), add))
    return parsed


def _parse_value(raw: str):
    """Numbers as Python reads them (YAML 1.1 would leave `1e-4` a string), the rest as YAML."""
    for number in (int, float):
        try:
            return number(raw)
        except ValueError:
            continue  # not this kind of number
    try:
        return yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        return raw


def load_run_config(overrides: list[str], base: dict | None = None) -> dict:
    """cfg_pretrain.yaml (or `base`, e.g. a run's saved all_config.yaml) with the overrides applied."""
    config = dict(base) if base is not None else _preset(CONFIG_DIR / "cfg_pretrain.yaml", "run")
    overrides = parse_overrides(overrides)
    arch_choice = next((v for k, v, _ in overrides if k == "arch"), None)
    if isinstance(config.get("arch"), str) or arch_choice is not None:
        config["arch"] = _preset(CONFIG_DIR / "arch" / f"{arch_choice or config['arch']}.yaml", "arch")
    arch_keys = {f for f in TRMConfig.__dataclass_fields__} | {"name", "loss"}
    for key, value, add in overrides:
        if key == "arch":
            continue
        *parents, leaf = key.split(".")
        node, where = config, "the run config"
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise _unknown(key, config, where)
            node, where = node[part], f"{where}.{part}"
        known = arch_keys if parents == ["arch"] else node
        if not add and leaf not in known:
            raise _unknown(leaf, known, where)
        node[leaf] = value
    arch = config["arch"]
    if arch.get("puzzle_emb_ndim") == "${.hidden_size}":
        arch["puzzle_emb_ndim"] = arch["hidden_size"]
    return config


def make_model_config(run_config: dict, vocab_size: int, seq_len: int, num_puzzle_identifiers: int) -> TRMConfig:
    return TRMConfig.from_arch(run_config["arch"], source="arch config", vocab_size=vocab_size, seq_len=seq_len,
                               num_puzzle_identifiers=num_puzzle_identifiers,
                               batch_size=run_config["global_batch_size"])
