"""Dream / DiffuCoder masked-diffusion language models (Hugging Face format) in JAX.

`dream.generate` is text in, text out (`jaxport.dream.text`); `dream.diffusion_generate` works on token ids
(`jaxport.dream.decoding`), `dream.generate_blocks` block by block (`jaxport.dream.fast`); the settings they take
are `GenerationSettings` (`jaxport.dream.settings`).
"""

from pathlib import Path

from jax.sharding import Mesh

from jaxport.dream.config import DreamConfig, preset
from jaxport.dream.decoding import diffusion_generate
from jaxport.dream.fast import FinishedBlock, generate_blocks
from jaxport.dream.model import DreamModel
from jaxport.dream.params import load_model, random_model
from jaxport.dream.program import GenerationOutput
from jaxport.dream.settings import GenerationSettings
from jaxport.dream.text import generate
from jaxport.dream.tokenizer import DreamTokenizer


def load(model_dir: str | Path, dtype: str = "float32", mesh: Mesh | None = None):
    """`(model, tokenizer)` from a Hugging Face Dream/DiffuCoder directory; `mesh` shards the weights."""
    config = DreamConfig.from_model_dir(model_dir)
    model = load_model(model_dir, config, dtype=dtype, mesh=mesh)
    return model, DreamTokenizer.from_model_dir(model_dir, config)


__all__ = [
    "DreamConfig",
    "DreamModel",
    "DreamTokenizer",
    "FinishedBlock",
    "GenerationOutput",
    "GenerationSettings",
    "diffusion_generate",
    "generate",
    "generate_blocks",
    "load",
    "load_model",
    "preset",
    "random_model",
]
