"""GPT model configuration: nanoGPT's `GPTConfig`, field for field."""

import dataclasses

from jaxport.errors import JaxportError


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, like GPT-2

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise JaxportError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @classmethod
    def from_model_args(cls, model_args: dict, where: str = "model_args") -> "GPTConfig":
        """Build from a nanoGPT `model_args` dict, naming the missing or unknown keys."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(model_args) - fields)
        if unknown:
            raise JaxportError(f"{where} has keys nanoGPT's GPTConfig does not know: {unknown}")
        missing = sorted({"n_layer", "n_head", "n_embd", "block_size", "vocab_size"} - set(model_args))
        if missing:
            raise JaxportError(f"{where} lacks {missing}")
        return cls(**{k: (v.item() if hasattr(v, "item") else v) for k, v in model_args.items()})

    def to_model_args(self) -> dict:
        return dataclasses.asdict(self)
