"""jaxport: TinyRecursiveModels, nanoGPT and Dream/DiffuCoder natively in JAX."""

__version__ = "0.1.0"
