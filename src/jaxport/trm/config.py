"""TRM configs, typed: `ArchConfig` is upstream's `arch:` mapping (config/arch/trm.yaml), `TRMConfig` adds the
sizes that come from the dataset, and `RunConfig` is upstream's `PretrainConfig` (cfg_pretrain.yaml) plus
jaxport's own keys. A bad key or value is one error naming the key, the value and what is expected."""

from pathlib import Path
from typing import Literal

import pydantic
import yaml
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveInt

from jaxport.errors import JaxportError
from jaxport.runtime.settings import RuntimeSettings
from jaxport.typed_config import validate

# arch keys that name upstream classes rather than sizes; kept so configs round-trip.
ARCH_NAME = "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1"
LOSS_NAME = "losses@ACTLossHead"
DATASET_FIELDS = ("vocab_size", "num_puzzle_identifiers", "seq_len", "batch_size")

Probability = pydantic.confloat(ge=0.0, le=1.0)


class Frozen(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")


class LossConfig(Frozen):
    name: str = LOSS_NAME
    loss_type: Literal["stablemax_cross_entropy", "softmax_cross_entropy"] = "stablemax_cross_entropy"


class ArchConfig(Frozen):
    """TinyRecursiveReasoningModel_ACTV1's `arch:` keys, one to one."""

    name: str = ARCH_NAME
    loss: LossConfig = LossConfig()
    H_cycles: PositiveInt = 3
    L_cycles: PositiveInt = 6
    H_layers: NonNegativeInt = 0  # unused by TRM, kept as upstream
    L_layers: PositiveInt = 2
    hidden_size: PositiveInt = 512
    expansion: pydantic.PositiveFloat = 4.0
    num_heads: PositiveInt = 8
    pos_encodings: Literal["rope", "learned", "none"] = "rope"
    rms_norm_eps: pydantic.PositiveFloat = 1e-5
    rope_theta: pydantic.PositiveFloat = 10000.0
    halt_max_steps: PositiveInt = 16
    halt_exploration_prob: Probability = 0.1
    forward_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    mlp_t: bool = False
    puzzle_emb_ndim: NonNegativeInt = 512
    puzzle_emb_len: NonNegativeInt = 16
    no_ACT_continue: bool = True

    @pydantic.model_validator(mode="after")
    def _heads_divide_hidden(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"arch.hidden_size {self.hidden_size} is not divisible by arch.num_heads {self.num_heads}")
        return self

    @property
    def loss_type(self) -> str:
        return self.loss.loss_type

    @property
    def num_puzzle_positions(self) -> int:
        """Positions the puzzle embedding occupies (upstream: ceil(ndim / hidden) when puzzle_emb_len is 0)."""
        if self.puzzle_emb_len == 0:
            return -(self.puzzle_emb_ndim // -self.hidden_size)
        return self.puzzle_emb_len

    def arch_dict(self) -> dict:
        """The upstream `arch:` mapping."""
        return ArchConfig.model_validate({k: getattr(self, k) for k in ArchConfig.model_fields}).model_dump()


class TRMConfig(ArchConfig):
    """The model's config: the arch plus the dataset's sizes. `seq_len=None` means "from the batch"; it is
    needed only by learned positions and mlp_t, whose weights have the sequence length in them."""

    vocab_size: PositiveInt
    num_puzzle_identifiers: PositiveInt
    seq_len: PositiveInt | None = None
    batch_size: PositiveInt | None = None

    @classmethod
    def from_arch(cls, arch: dict, source: str = "arch", **dataset_fields) -> "TRMConfig":
        """Build from an upstream `arch:` mapping (as in all_config.yaml or arch/trm.yaml) and the dataset's
        sizes; a bad key or value names itself and `source`."""
        arch = dict(arch)
        if "${" in str(arch.get("puzzle_emb_ndim", "")):  # arch/trm.yaml's `${.hidden_size}`, unresolved
            arch["puzzle_emb_ndim"] = arch.get("hidden_size", ArchConfig.model_fields["hidden_size"].default)
        for key in DATASET_FIELDS:
            if key in arch:
                raise JaxportError(f"{source}: arch.{key} comes from the dataset's dataset.json, not the config")
        validate(ArchConfig, arch, source, what="TRM config key")
        missing = [k for k in ("vocab_size", "num_puzzle_identifiers") if dataset_fields.get(k) is None]
        if missing:
            raise JaxportError(f"{source} does not give {', '.join(missing)} (they come from the dataset metadata)")
        sizes = {k: v for k, v in dataset_fields.items() if v is not None}
        return validate(cls, {**arch, **sizes}, source, what="TRM config key")


class EvaluatorConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")  # the evaluator's own options
    name: str


class RunConfig(Frozen):
    """upstream PretrainConfig (its keys and defaults), plus jaxport's keys at the end."""

    arch: ArchConfig
    data_paths: list[str]
    data_paths_test: list[str] = []
    evaluators: list[EvaluatorConfig] = []
    global_batch_size: PositiveInt
    epochs: PositiveInt
    lr: NonNegativeFloat
    lr_min_ratio: NonNegativeFloat
    lr_warmup_steps: NonNegativeInt
    weight_decay: NonNegativeFloat
    beta1: Probability
    beta2: Probability
    puzzle_emb_lr: NonNegativeFloat
    puzzle_emb_weight_decay: NonNegativeFloat
    project_name: str | None = None
    run_name: str | None = None
    load_checkpoint: str | None = None
    checkpoint_path: str | None = None
    seed: int = 0
    checkpoint_every_eval: bool = False
    eval_interval: PositiveInt | None = None
    min_eval_interval: NonNegativeInt | None = 0
    eval_save_outputs: list[str] = []
    ema: bool = False
    ema_rate: Probability = 0.999
    freeze_weights: bool = False
    # jaxport's own
    checkpoint_every_steps: PositiveInt | None = None
    keep_last: PositiveInt | None = 3
    keep_every: PositiveInt | None = None
    export_upstream: bool = False
    loggers: list[Literal["jsonl", "wandb", "tensorboard"]] = ["jsonl"]
    max_steps: PositiveInt | None = None
    # `runtime.attention=xla`: the runtime's choices (runtime/settings.py), which `jaxport trm` makes the process's
    runtime: RuntimeSettings = RuntimeSettings()

    @pydantic.model_validator(mode="after")
    def _eval_interval_divides_epochs(self):
        if self.eval_interval and self.epochs % self.eval_interval:
            raise ValueError(f"epochs ({self.epochs}) must be a multiple of eval_interval ({self.eval_interval})")
        return self

    def replace(self, **changes) -> "RunConfig":
        return self.model_copy(update=changes)

    def to_yaml(self) -> str:
        """all_config.yaml, as upstream writes it (`yaml.dump(config.model_dump())`)."""
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


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
