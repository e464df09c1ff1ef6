"""Layers shared by the model families."""

from jaxport.nn.attention import Attention, dot_product_attention, take_rows, window_at, write_at
from jaxport.nn.dropout import dropout
from jaxport.nn.initializers import truncated_normal
from jaxport.nn.linear import Embedding, Linear, add_positions
from jaxport.nn.losses import label_entries, softmax_cross_entropy
from jaxport.nn.mlp import SwiGLU, find_multiple, gelu, swiglu_intermediate_size
from jaxport.nn.norm import RMSNorm, rms_norm
from jaxport.nn.rotary import apply_rotary, rotary_cos_sin, rotate_half

__all__ = [
    "Attention",
    "dot_product_attention",
    "take_rows",
    "window_at",
    "write_at",
    "dropout",
    "truncated_normal",
    "Embedding",
    "Linear",
    "add_positions",
    "label_entries",
    "softmax_cross_entropy",
    "SwiGLU",
    "find_multiple",
    "gelu",
    "swiglu_intermediate_size",
    "RMSNorm",
    "rms_norm",
    "apply_rotary",
    "rotary_cos_sin",
    "rotate_half",
]
