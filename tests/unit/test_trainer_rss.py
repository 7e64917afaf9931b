"""The trainer gives the memory a step freed back to the system (services/trainer/model/memory.py): glibc keeps
freed heap memory otherwise, and a real model's trainer grew by GiBs over tens of steps with no tensor
alive (docs/trainer.md "Memory over a run")."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.trainer.model import memory

pytestmark = pytest.mark.skipif(not memory.available(), reason="no glibc malloc_trim in this C library")

MB = 2**20
ROOT = Path(__file__).resolve().parents[2]


def _resident() -> int:
    return memory.resident()[0]


_STEP = """
import json, threading, torch
from services.trainer.model import memory
MB = 2**20
held, sizes = [], {}

def step():
    big = torch.ones(24 * MB // 4)  # freed: glibc's mmap threshold rises to its size
    del big
    pieces = [torch.ones(MB // 4 * 3) for _ in range(300)]  # 300 x 3 MB, now from the heap arena
    held.append(torch.ones(MB // 4))  # a survivor above them
    sizes["live"] = memory.resident()[0]
    del pieces
    sizes["freed"] = memory.resident()[0]
    memory.release_freed()
    sizes["released"] = memory.resident()[0]

thread = threading.Thread(target=step)
thread.start()
thread.join()
sizes["held"] = held[0].sum().item()
print(json.dumps(sizes))
"""


def test_heap_memory_a_step_freed_goes_back_to_the_system() -> None:
    """As in a step: mid-sized tensors in a worker thread's arena (after a large block raised glibc's
    mmap threshold), freed while a later allocation pins the arena's top. Run in a fresh interpreter, as
    a trainer's first steps are: in this test process a new thread may be handed an arena that earlier
    tests left with free holes, where the survivor lands below the pieces and glibc trims them on its own
    (a full CI run's worker: 440 of the 900 MB went back at `del`), which is not the case under test."""
    out = subprocess.run([sys.executable, "-c", _STEP], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, check=True)
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    kept = sizes["freed"] - sizes["released"]
    assert sizes["live"] - sizes["freed"] < 300 * MB, sizes  # glibc kept most of the freed 900 MB ...
    assert kept > 600 * MB, sizes  # ... until it was released
    assert sizes["held"] == MB // 4


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


_THRESHOLD = """
import json, threading, torch
from services.trainer.model import memory
MB = 2**20
held, out = [], {}

def step():
    big = torch.ones(24 * MB // 4)
    del big
    pieces = [torch.ones(MB // 4 * 3) for _ in range(100)]  # 300 MB from the heap arena
    held.append(torch.ones(MB // 4))
    del pieces
    before = memory.resident()[0]
    out["skipped_s"], out["free"] = memory.release_if_free(1024 * MB)  # less free than that: left to glibc
    out["kept"] = before - memory.resident()[0]
    out["trimmed_s"], _ = memory.release_if_free(100 * MB)
    out["released"] = before - memory.resident()[0]

thread = threading.Thread(target=step)
thread.start()
thread.join()
print(json.dumps(out))
"""


@pytest.mark.skipif(memory.heap_free() is None, reason="no mallinfo2 (glibc < 2.33)")
def test_a_step_that_freed_little_is_not_trimmed() -> None:
    """A trim makes the next step fault every page back in (a fifth of the copy3 trainer's core went to the
    kernel): below `trainer.trim_free_mb` of free heap the memory stays with the allocator."""
    out = subprocess.run([sys.executable, "-c", _THRESHOLD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["free"] > 250 * MB, got  # every arena counted: the pieces were freed in a thread's arena
    assert got["skipped_s"] == 0.0 and got["kept"] < 50 * MB, got
    assert got["trimmed_s"] > 0.0 and got["released"] > 200 * MB, got
