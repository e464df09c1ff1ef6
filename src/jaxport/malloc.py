"""Host-memory tuning applied by every `jaxport` command (and the benchmarks) before any work."""

import ctypes
import os
import sys
import weakref

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def restart_with_huge_pages() -> None:
    """Re-execute this program (same pid, arguments and environment) with glibc's malloc asking for
    transparent huge pages on the memory it maps. Where glibc maps a large step's temporaries afresh every
    step (4.8 GB for GPT's train_shakespeare_char, 2.5 GB for a paper-size bfloat16 TRM step; since
    2026-11-26 only on a machine too small to keep them in the heap, `reuse_memory_for`), it faults them in
    4 KB page by page: 1.2 million faults per GPT step, 4 000 with huge pages (their effect on each step's
    time, host by host, is in docs/performance.md), so `jaxport gpt` and `jaxport trm` ask for them.
    Tunables are read only when a process starts, hence the restart: call it from a program's entry point,
    before any work. A no-op off Linux, where the tunable is already set, or where `JAXPORT_NO_RESTART` is
    set (to keep a process under a debugger)."""
    if sys.platform != "linux" or os.environ.get("JAXPORT_NO_RESTART"):
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _libc():
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
TRIM_THRESHOLD = 1 << 30
_tuned = False  # keep_freed_memory ran in this process
_sized = weakref.WeakSet()  # the jitted functions reuse_memory_before_first_call has seen


def keep_freed_memory() -> None:
    """Make glibc keep freed memory in the heap instead of returning it to the OS. XLA:CPU
    frees and reallocates its large temporaries every step, and the page faults of fresh
    mmaps cost up to half the step time of a small GPT (measured ~1.5-2x on the README
    CPU config). A no-op off Linux/glibc.

    The step's temporaries are one block, allocated by the thread that runs the program. A
    thread's own arena maps any block over 64 MB afresh, so one-device programs run on the
    calling (main) thread, whose arena is the heap (JAX's `jax_cpu_enable_async_dispatch`
    off: the call returns when the step is done). XLA's worker threads keep arenas of their
    own: their many small allocations (oneDNN's 74 KB matmul workspace, ~450 per README-config
    GPT step) then take no shared lock; one arena for every thread, as here until 2026-11-26,
    queued them (docs/performance.md, "Malloc arenas", has the measurements)."""
    global _tuned
    libc = _libc()
    if libc is None:
        return
    _tuned = True
    import jax  # here, not at the top: `restart_with_huge_pages` runs before anything is imported

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    # blocks up to glibc's largest mmap threshold come from the heap, which is never trimmed;
    # bigger ones stay mmap'ed unless `reuse_memory_for` says otherwise
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    libc.mallopt(M_TOP_PAD, 64 << 20)


def reuse_memory_before_first_call(jitted, *args) -> None:
    """Before `jitted(*args)` first runs in this process, compile it ahead and size the host-memory policy on
    its temporaries (`reuse_memory_for`); later calls return at once. For a training loop's step: XLA keeps the
    compiled program, so the call that follows does not compile again."""
    if jitted not in _sized:
        reuse_memory_for(jitted.lower(*args).compile())
        _sized.add(jitted)


def reuse_memory_for(compiled) -> None:
    """Serve every block from the heap from now on, and never trim it below the compiled step's temporaries:
    XLA:CPU allocates them as one block per call, which glibc would otherwise map and fault in afresh each step
    (40 000 page faults per demo-size TRM step, 153 MB; with huge pages, the kernel zeroing the paper-size TRM
    steps' 2.5-4 GB every step: docs/performance.md, "Temporaries kept").
    A long-lived block freed into the middle of a large step's hole can make the heap grow by a second block of
    temporaries (train_shakespeare_char's 4.8 GB: 5.9 -> 10.0 GB peak resident over a run with evaluations), so
    temporaries above the trim threshold stay mapped afresh unless two of them fit in half the machine's
    memory. Only in a process that `keep_freed_memory` tuned (the jaxport command, the benchmarks), whose steps
    allocate on the main thread and so from the heap."""
    import jax

    libc = _libc()
    # an accelerator program's temporaries live in device memory: the host's malloc has nothing to size
    memory = compiled.memory_analysis() if jax.default_backend() == "cpu" else None
    if not _tuned or libc is None or memory is None:
        return
    temp = memory.temp_size_in_bytes
    if temp > TRIM_THRESHOLD:
        if 4 * temp > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
            return
        libc.mallopt(M_TRIM_THRESHOLD, -1)  # glibc reads -1 as the largest size: never trim
    libc.mallopt(M_MMAP_MAX, 0)
