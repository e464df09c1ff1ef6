"""The kinds of approximate KV cache of block-wise decoding (`jaxport.dream.fast`), one object each: the `cache`
setting names one (None, "prefix", "dual"), and the block loop, the serving engine and the CLI read what it says.

A block's first step runs the whole canvas; with a cache it keeps every layer's keys/values, and the block's later
steps run a window of the canvas over them (the window's fresh keys/values replace the kept ones at its positions).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class CacheKind:
    """One kind of cache: `name` (the `cache` setting), what a block's later steps run (`later_steps`, in words),
    whether the first step's keys/values are kept (`keeps`) and the positions after the window too (`keeps_suffix`:
    the window is the block alone), and whether rows at different blocks can share a call (`running_batch`:
    continuous batching)."""

    name: str | None
    later_steps: str
    keeps: bool
    keeps_suffix: bool
    running_batch: bool

    def window(self, begin, width: int, lead: int, canvas: int):
        """How many positions the later steps of a block run from `begin` (`lead` positions before the block of
        `width`, on a canvas of `canvas`): the block alone, or the block and everything after it."""
        return width + lead if self.keeps_suffix else canvas - begin

    @property
    def per_block_program(self) -> bool:
        """Whether the window's shape depends on the block (then each block index is a program of its own)."""
        return self.keeps and not self.keeps_suffix


NO_CACHE = CacheKind(None, "every step runs the whole canvas", keeps=False, keeps_suffix=False, running_batch=False)
PREFIX = CacheKind(
    "prefix",
    "the later steps run the block and everything after it, attending over the kept prefix",
    keeps=True,
    keeps_suffix=False,
    running_batch=False,
)
# every block call begins with a full forward that rebuilds the cache, so nothing but a row's canvas carries over
DUAL = CacheKind(
    "dual",
    "the later steps run only the block, attending over the kept prefix and suffix",
    keeps=True,
    keeps_suffix=True,
    running_batch=True,
)
CACHE_KINDS = {kind.name: kind for kind in (NO_CACHE, PREFIX, DUAL)}
CACHES = tuple(name for name in CACHE_KINDS if name is not None)  # the names a `cache` setting may give


def cache_kind(name: str | None) -> CacheKind:
    """The kind a `cache` setting names (checked by `jaxport.dream.settings`)."""
    return CACHE_KINDS[name]


def cache_help() -> str:
    """The kept kinds, for `--help`: each name and what its later steps run."""
    return "; ".join(f"{kind.name}: {kind.later_steps}" for kind in CACHE_KINDS.values() if kind.keeps)
