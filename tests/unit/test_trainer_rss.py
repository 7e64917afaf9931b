"""The trainer gives the memory a step freed back to the system (services/trainer/model/memory.py): glibc keeps
freed heap memory otherwise, and a real model's trainer grew by GiBs over tens of steps with no tensor
alive (docs/trainer.md "Memory over a run")."""

from __future__ import annotations

import mmap
import threading

import pytest
import torch

from services.trainer.model import memory

pytestmark = pytest.mark.skipif(not memory.available(), reason="no glibc malloc_trim in this C library")

MB = 2**20


def _resident() -> int:
    return memory.resident()[0]


def test_heap_memory_a_step_freed_goes_back_to_the_system() -> None:
    """As in a step: mid-sized tensors in a worker thread's arena (after a large block raised glibc's
    mmap threshold), freed while a later allocation pins the arena's top."""
    held: list[torch.Tensor] = []
    sizes: dict[str, int] = {}

    def step() -> None:
        big = torch.ones(24 * MB // 4)  # freed: glibc's mmap threshold rises to its size
        del big
        pieces = [torch.ones(MB // 4 * 3) for _ in range(300)]  # 300 x 3 MB, now from the heap arena
        held.append(torch.ones(MB // 4))  # a survivor above them
        sizes["live"] = _resident()
        del pieces
        sizes["freed"] = _resident()
        memory.release_freed()
        sizes["released"] = _resident()

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    kept = sizes["freed"] - sizes["released"]
    assert sizes["live"] - sizes["freed"] < 300 * MB, sizes  # glibc kept most of the freed 900 MB ...
    assert kept > 600 * MB, sizes  # ... until it was released
    assert held[0].sum().item() == MB // 4


def test_the_resident_peak_is_per_call() -> None:
    memory.resident()
    # 256 MB mapped, every page written, unmapped: straight from the kernel, whatever free memory the
    # allocator of this (test) process keeps from earlier tests (a torch tensor may reuse it: seen in a
    # full run, where the block never raised the resident size)
    block = mmap.mmap(-1, 256 * MB)
    for offset in range(0, 256 * MB, mmap.PAGESIZE):
        block[offset] = 1
    block.close()
    now, peak = memory.resident()
    assert peak >= now + 200 * MB  # the block counted in this call's peak
    _, peak2 = memory.resident()
    assert peak2 < peak - 200 * MB  # reset by the call before: the next step's peak is its own


def test_the_resident_size_is_split_by_kind() -> None:
    """Shared memory (the colocated weight path's buffers, mapped by the servers too) is told apart from
    the heap: a trainer's resident size counts both."""
    memory.release_freed()
    before = memory.resident_parts()
    shared = torch.ones(128 * MB // 4).share_memory_()  # a /dev/shm file, as the weight buffer sets are
    # as the trainer does after each step: the freed heap copy goes back even where glibc carved it out
    # of a heap arena instead of mapping it (a full CI run's worker did: +128 MB anon until trimmed;
    # reproduced here with a raised M_MMAP_THRESHOLD)
    memory.release_freed()
    after = memory.resident_parts()
    assert after["shmem"] - before["shmem"] >= 120 * MB, (before, after)
    assert after["anon"] - before["anon"] < 100 * MB, (before, after)  # the copy into it is not counted twice
    assert shared[0].item() == 1.0
