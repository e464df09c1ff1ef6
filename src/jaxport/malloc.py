"""Host-memory tuning applied by every `jaxport` command (and the benchmarks) before any work."""

import ctypes
import sys


def keep_freed_memory() -> None:
    """Make glibc keep freed memory in the heap instead of returning it to the OS. XLA:CPU
    frees and reallocates its large temporaries every step, and the page faults of fresh
    mmaps cost up to half the step time of a small GPT (measured ~1.5-2x on the README
    CPU config). A no-op off Linux/glibc."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    # blocks up to glibc's largest mmap threshold come from the heap, which is never trimmed;
    # bigger ones stay mmap'ed (moving those into the heap too made large configs slower)
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.mallopt(M_TOP_PAD, 64 << 20)
