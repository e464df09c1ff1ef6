"""nanoGPT in JAX: the GPT model, GPT-2 and ckpt.pt loading, data preparation, training, sampling."""

from jaxport.gpt.config import GPTConfig
from jaxport.gpt.model import GPT, sample_probs
from jaxport.runtime.topologies import device_peak_flops  # one table of chips for every family

__all__ = ["GPT", "GPTConfig", "device_peak_flops", "sample_probs"]
