"""Host memory for XLA:CPU programs: glibc's malloc, tuned in-process, keeps freed memory, and a training step's
temporaries stay in the heap between calls on transparent huge pages instead of being mapped and faulted in afresh
every call (docs/performance.md, "Host memory"). Linux with glibc only; a no-op elsewhere.

A program's entry point calls `tune_process` before any work (the `jaxport` command through its `host_memory`
runtime setting, `runtime.settings.start`, and the benchmarks do); a
training step's first call then sizes the heap on its temporaries (`keep_temporaries`, through
`runtime.jit_training_step`). A program that only imports jaxport keeps glibc's defaults. glibc's own
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, set by the user before the process starts, also puts the blocks that stay
mapped afresh (a step too large for the heap) on huge pages."""

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
MMAP_THRESHOLD = 32 << 20  # glibc's largest: smaller blocks come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory the heap keeps at its top before returning it
TOP_PAD = 64 << 20  # the heap grows by this much more than it needs
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25

_tuned = {"heap": False, "training": False}


def _libc():
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018  (glibc's, not musl's)
    except (OSError, AttributeError):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def tune_process(*, training: bool) -> None:
    """Make glibc keep freed memory in the heap instead of returning it to the OS: blocks up to its largest mmap
    threshold come from the heap, which keeps up to `TRIM_THRESHOLD` free. With `training` (a command that runs
    training steps), one-device CPU programs also run on the calling thread (JAX's asynchronous CPU dispatch off):
    the main thread's arena is the heap, where `keep_temporaries` can keep a step's temporaries, while another
    thread's arena maps any large block afresh. JAX reads that setting when it starts its CPU backend, so call this
    before any work; a server or decoder keeps asynchronous dispatch."""
    libc = _libc()
    if libc is None:
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    libc.mallopt(M_TOP_PAD, TOP_PAD)
    _tuned["heap"] = True
    if training:
        import jax  # here: a plain import of this module leaves JAX alone

        jax.config.update("jax_cpu_enable_async_dispatch", False)
        _tuned["training"] = True


def available() -> bool:
    """glibc's malloc is there to tune (Linux with glibc)."""
    return _libc() is not None


def tuned() -> bool:
    """`tune_process` ran in this process."""
    return _tuned["heap"]


def tuned_for_training() -> bool:
    """`tune_process(training=True)` ran in this process."""
    return _tuned["training"]


def keep_temporaries(compiled) -> None:
    """Serve every block from the heap from now on, never trimmed below two blocks of the temporaries of `compiled`
    (an XLA:CPU program, which allocates them as one block per call; calls may take two in turn), all of it on
    transparent huge pages. Temporaries above `TRIM_THRESHOLD` stay mapped afresh unless two blocks of them fit in
    half the machine's memory: a long-lived block freed into the middle of the hole can make the heap grow by a
    second one. Only in a process tuned for training, whose steps allocate on the main thread."""
    libc = _libc()
    if not _tuned["training"] or libc is None:
        return
    memory = compiled.memory_analysis()
    if memory is None:
        return
    temp = memory.temp_size_in_bytes
    if temp > TRIM_THRESHOLD:
        if 4 * temp > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
            return
        libc.mallopt(M_TRIM_THRESHOLD, -1)  # glibc reads -1 as the largest size: never trim
    else:
        libc.mallopt(M_TRIM_THRESHOLD, max(TRIM_THRESHOLD, 2 * temp + TOP_PAD))
    libc.mallopt(M_MMAP_MAX, 0)
    _on_huge_pages(libc, reserve=2 * temp)


def _on_huge_pages(libc, reserve: int) -> None:
    """Advise the heap as transparent huge pages, collapse what it holds already (weights, optimizer state) into
    them, and grow it by `reserve` bytes, untouched and advised too: what glibc's `glibc.malloc.hugetlb=1` tunable
    does for each extension of the heap (tunables are read only when a process starts). Best effort: a kernel
    without transparent huge pages or `MADV_COLLAPSE` (Linux 6.1) refuses the advice, and nothing changes."""
    heap = _heap_range()
    if heap is not None:
        libc.madvise(heap[0], heap[1] - heap[0], MADV_HUGEPAGE)
        libc.madvise(heap[0], heap[1] - heap[0], MADV_COLLAPSE)
    libc.free(libc.malloc(reserve))
    heap = _heap_range()
    if heap is not None:
        libc.madvise(heap[0], heap[1] - heap[0], MADV_HUGEPAGE)


def _heap_range() -> tuple[int, int] | None:
    """(start, end) of this process's heap: the `[heap]` mappings of /proc/self/maps, which advice splits in parts."""
    parts = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if line.rstrip().endswith("[heap]"):
                    parts.append([int(address, 16) for address in line.split()[0].split("-")])
    except OSError:
        pass
    return (parts[0][0], parts[-1][1]) if parts else None
