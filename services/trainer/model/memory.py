"""Hand the memory a step freed back to the system (glibc's allocator keeps it otherwise).

A step's tensors of a few MB (activations, the published weights' copies) come from glibc malloc,
whose mmap threshold rises to the largest block freed so far (up to 32 MB): after the first step they
are carved out of the heap arenas (one per thread that allocates: the training call runs in a thread
pool), and freed heap memory stays with the process. With sequence lengths that change every step the
pieces fit badly, so the resident size grew step after step with no tensor alive: 4.5 GiB after the
first step of a 135M-parameter LoRA run and +1 GiB over the next five, with 0.56 GiB of live tensors
(docs/trainer.md "Memory over a run"). `malloc_trim(0)` after each step returns every free page of
every arena (glibc >= 2.8 releases whole free pages inside the heaps too, not only the top), which
keeps the resident size at the live tensors plus the allocator's small change.

The trim is not free: it returns the pages, and the next step faults every one of them back in, zeroed
by the kernel. On the copy3 toy, whose heaps hold 20-90 MB free, trimming after every step put a fifth of the
trainer's core into the kernel (19.7% sys against 4.7% without) and made a step ~20% longer. So the
trainer trims only when the allocator's heaps hold at least `trainer.trim_free_mb` of free memory
(`heap_free`, glibc's `mallinfo2`, every arena; free chunks whose pages a trim already returned still
count, so a heap once that large is trimmed after every step, as before): a real model's step frees
hundreds of MB and is trimmed every time, a toy's tens of MB are left to glibc. Where `mallinfo2` is
missing (glibc < 2.33) every step is trimmed.

Other C libraries (musl, macOS) have no `malloc_trim`: then this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from functools import cache
from typing import Any

from services.common.logging import get_logger

log = get_logger("trainer.memory")


@cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def available() -> bool:
    """Whether this process's C library can give freed heap memory back (glibc)."""
    return _libc() is not None


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@cache
def _mallinfo2() -> Any:
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is not None:
        fn.restype = _Mallinfo2
        fn.argtypes = []
    return fn


def heap_free() -> int | None:
    """Bytes the allocator holds freed in its heaps (every arena), which a trim could return; None where
    the C library cannot say (no glibc >= 2.33)."""
    fn = _mallinfo2()
    return None if fn is None else int(fn().fordblks)


def release_freed() -> float:
    """Return the allocator's free memory to the system; the seconds it took (0 where unavailable)."""
    libc = _libc()
    if libc is None:
        return 0.0
    t0 = time.perf_counter()
    libc.malloc_trim(0)
    return time.perf_counter() - t0


def release_if_free(min_free: int) -> tuple[float, int | None]:
    """`release_freed` when the heaps hold at least `min_free` bytes free (always where the amount is
    unknown); (the seconds the trim took, 0 if skipped; the free bytes measured, None if unknown)."""
    free = heap_free()
    if free is not None and free < min_free:
        return 0.0, free
    return release_freed(), free


def resident_parts() -> dict[str, int]:
    """The resident size now by kind, in bytes: `anon` (the heap, tensors), `file` (mapped files: a
    safetensors model that transformers maps and never copies, frozen base weights under LoRA) and
    `shmem` (shared memory: the colocated weight path's buffer sets, which the servers map too);
    empty where /proc is not there."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                for key, name in (("RssAnon:", "anon"), ("RssFile:", "file"), ("RssShmem:", "shmem")):
                    if line.startswith(key):
                        out[name] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return out


def resident() -> tuple[int, int]:
    """(resident size now, its peak since the last call) in bytes, the peak then reset so that the
    next call gives the next step's; (0, 0) where /proc is not there. Where the peak cannot be reset
    (no write access to clear_refs) it is the process's peak so far."""
    now = peak = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    now = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
    except OSError:
        return 0, 0
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
    except OSError:
        pass
    return now, peak
