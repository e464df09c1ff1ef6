"""Dream model configuration: the fields of a Hugging Face `config.json` that the model uses."""

import dataclasses
import json
from pathlib import Path

from jaxport.errors import JaxportError


@dataclasses.dataclass(frozen=True)
class DreamConfig:
    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 131072  # the longest prompt + generation the model was made for
    tie_word_embeddings: bool = False
    mask_token_id: int = 151666
    pad_token_id: int = 151643
    eos_token_id: int = 151643
    bos_token_id: int = 151643
    torch_dtype: str = "bfloat16"
    initializer_range: float = 0.02  # std of fresh weights (upstream's _init_weights)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def with_token_ids_of(self, tokens: "DreamConfig") -> "DreamConfig":
        """These layers with the special token ids of `tokens` (the config of a tokenizer's model directory)."""
        ids = ("mask_token_id", "pad_token_id", "eos_token_id", "bos_token_id")
        return dataclasses.replace(self, **{name: getattr(tokens, name) for name in ids})

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise JaxportError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise JaxportError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @classmethod
    def from_dict(cls, raw: dict) -> "DreamConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in fields and v is not None}
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            if isinstance(values.get(key), list):  # some configs list several stop ids; the first is eos
                values[key] = values[key][0]
        return cls(**values)

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict:
        """`config.json` as published Dream checkpoints have it: these fields plus the fixed ones of the
        architecture, with `auto_map` naming the model code files that ship beside the weights."""
        return {
            "architectures": ["DreamModel"],
            "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
            **dataclasses.asdict(self),
            "torch_dtype": torch_dtype or self.torch_dtype,
            "hidden_act": "silu",
            "max_window_layers": self.num_hidden_layers,
            "model_type": "Dream",
            "rope_scaling": None,
            "sliding_window": None,
            "use_cache": True,
            "use_mrope": False,
            "use_sliding_window": False,
        }

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "DreamConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise JaxportError(f"{model_dir} is not a Dream model directory: no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise JaxportError(f"{path} is not valid JSON: {err}") from None
        model_type = str(raw.get("model_type", ""))
        if model_type.lower() != "dream" and "DreamModel" not in raw.get("architectures", []):
            raise JaxportError(
                f"{path} describes model_type {model_type!r}, not a Dream model "
                "(expected model_type 'Dream' or architectures ['DreamModel'])"
            )
        if raw.get("mask_token_id") is None:
            raise JaxportError(f"{path} has no mask_token_id: diffusion generation needs it")
        if raw.get("use_mrope") or raw.get("rope_scaling"):
            raise JaxportError(f"{path}: rope_scaling/use_mrope are not supported (only default RoPE)")
        return cls.from_dict(raw)


# The official Dream-v0-7B config, and the 40M-parameter config upstream was timed with on CPU.
PRESETS: dict[str, DreamConfig] = {
    "7b": DreamConfig(),
    "40m": DreamConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        mask_token_id=31999,
        pad_token_id=31990,
        eos_token_id=31990,
        bos_token_id=31990,
        torch_dtype="float32",
    ),
    "tiny": DreamConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mask_token_id=423,
        pad_token_id=400,
        eos_token_id=400,
        bos_token_id=400,
        torch_dtype="float32",
    ),
    # The synthetic-task model (`jaxport dream train --preset task-demo`); vocabulary from its tokenizer.
    # Upstream's init std of 0.02 suits a 3584-wide model; this 128-wide one starts with nearly uniform
    # attention at that scale and takes far longer to learn, so it draws ~1/sqrt(hidden).
    "task": DreamConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        mask_token_id=511,
        pad_token_id=488,
        eos_token_id=488,
        bos_token_id=510,
        torch_dtype="float32",
        initializer_range=0.08,
    ),
}


def preset(name: str) -> DreamConfig:
    if name not in PRESETS:
        raise JaxportError(f"unknown Dream size {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
