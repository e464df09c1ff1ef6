"""Checkpoints: upstream formats (torch state dicts, nanoGPT ckpt.pt, HF safetensors) and orbax runs."""

from jaxport.checkpoint.torch_io import atomic_write, load_torch_file, save_torch_file, strip_prefix, torch_available

__all__ = ["atomic_write", "load_torch_file", "save_torch_file", "strip_prefix", "torch_available"]
