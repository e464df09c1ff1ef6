"""TRM architecture config: upstream's `arch` keys, one-to-one, plus the dataset-derived sizes."""

import dataclasses
import difflib
from pathlib import Path

import yaml

from jaxport.errors import JaxportError

# arch keys that name upstream classes rather than sizes; kept so configs round-trip.
ARCH_NAME = "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1"
LOSS_NAME = "losses@ACTLossHead"
LOSS_TYPES = ("stablemax_cross_entropy", "softmax_cross_entropy")


@dataclasses.dataclass(frozen=True)
class TRMConfig:
    """TinyRecursiveReasoningModel_ACTV1Config. `seq_len=None` means "from the batch"; it is
    needed only by learned positions and mlp_t, whose weights have the sequence length in them."""

    vocab_size: int
    num_puzzle_identifiers: int
    seq_len: int | None = None
    batch_size: int | None = None
    H_cycles: int = 3
    L_cycles: int = 6
    H_layers: int = 0  # unused by TRM, kept as upstream
    L_layers: int = 2
    hidden_size: int = 512
    expansion: float = 4.0
    num_heads: int = 8
    pos_encodings: str = "rope"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    halt_max_steps: int = 16
    halt_exploration_prob: float = 0.1
    forward_dtype: str = "bfloat16"
    mlp_t: bool = False
    puzzle_emb_ndim: int = 512
    puzzle_emb_len: int = 16
    no_ACT_continue: bool = True
    loss_type: str = "stablemax_cross_entropy"

    def __post_init__(self):
        if self.pos_encodings not in ("rope", "learned", "none"):
            raise JaxportError(f"arch.pos_encodings must be rope, learned or none, got {self.pos_encodings!r}")
        if self.forward_dtype not in ("float32", "bfloat16", "float16"):
            raise JaxportError(f"arch.forward_dtype must be float32 or bfloat16, got {self.forward_dtype!r}")
        if self.loss_type not in LOSS_TYPES:
            raise JaxportError(f"arch.loss.loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.hidden_size % self.num_heads:
            raise JaxportError(f"arch.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")

    @property
    def num_puzzle_positions(self) -> int:
        """Positions the puzzle embedding occupies (upstream: ceil(ndim / hidden) when puzzle_emb_len is 0)."""
        if self.puzzle_emb_len == 0:
            return -(self.puzzle_emb_ndim // -self.hidden_size)
        return self.puzzle_emb_len

    @classmethod
    def from_arch(cls, arch: dict, source: str = "arch", **dataset_fields) -> "TRMConfig":
        """Build from an upstream `arch:` mapping (as in all_config.yaml or arch/trm.yaml).
        Unknown keys are an error that lists the closest known keys."""
        arch = dict(arch)
        arch.pop("name", None)
        loss = arch.pop("loss", None) or {}
        if "loss_type" in loss:
            arch["loss_type"] = loss["loss_type"]
        known = {f.name for f in dataclasses.fields(cls)}
        for key in arch:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(sorted(known))}"
                raise JaxportError(f"unknown TRM config key {key!r} in {source}{hint}")
        arch.update({k: v for k, v in dataset_fields.items() if v is not None})
        missing = [k for k in ("vocab_size", "num_puzzle_identifiers") if k not in arch]
        if missing:
            raise JaxportError(f"{source} does not give {', '.join(missing)} (they come from the dataset metadata)")
        try:
            return cls(**arch)
        except TypeError as err:
            raise JaxportError(f"bad TRM config in {source}: {err}") from None

    def arch_dict(self) -> dict:
        """The upstream `arch:` mapping (dataset-derived sizes removed)."""
        arch = dataclasses.asdict(self)
        for key in ("vocab_size", "num_puzzle_identifiers", "seq_len", "batch_size", "rms_norm_eps", "rope_theta"):
            arch.pop(key)
        arch["loss"] = {"name": LOSS_NAME, "loss_type": arch.pop("loss_type")}
        return {"name": ARCH_NAME, **arch}


def read_all_config(path: str | Path) -> dict:
    """Parse an upstream `all_config.yaml` (or any YAML mapping) with clear errors."""
    path = Path(path)
    if not path.exists():
        raise JaxportError(f"config file not found: {path}")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise JaxportError(f"config file is not valid YAML: {path} ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict) or not isinstance(config.get("arch"), dict):
        raise JaxportError(f"config file has no `arch:` mapping (expected an upstream all_config.yaml): {path}")
    return config
