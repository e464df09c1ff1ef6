"""TinyRecursiveModels (TRM) in JAX: the model, its checkpoints, data and training."""

from jaxport.trm.config import TRMConfig
from jaxport.trm.model import TRM, Carry, InnerCarry
from jaxport.trm.params import load_upstream_checkpoint, save_upstream_checkpoint, state_dict

__all__ = [
    "TRMConfig",
    "TRM",
    "Carry",
    "InnerCarry",
    "load_upstream_checkpoint",
    "save_upstream_checkpoint",
    "state_dict",
]
