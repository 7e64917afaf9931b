"""The memory a colocated version is copied into, and who may still read it.

A `BufferSet` holds one version: one flat buffer per bucket (shared memory on the CPU, device memory
on a GPU), each tensor of the bucket a view into it at an aligned offset. The sender copies the
gathered parameters in (the only copy of the transport) and passes the servers handles to the views
(`tensor_payload.serialize`), so the bytes themselves never move again.

Buffers are reused version after version: fresh memory costs a page fault per 4 KiB at both ends
(at 1 GB more than the copy itself), and a buffer the receiving server mapped once stays mapped
there. A set is written only when no server may still read it (`holders` empty):
- a server that adopted the version (the CPU server serves straight from the buffers: `adopt`)
  holds its set until it reports a newer one;
- a server that copied it out (SGLang, a GPU server) holds nothing once it answered;
- a server that did not answer in time may still be reading: it holds the set until it answers a
  later version or is found gone (its connection refused or dropped: its mappings died with it).
So a server holds at most one set besides the one being written, and the pool needs two sets for
any number of healthy servers; a set freed beyond that is released (`trim`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from services.common.logging import get_logger

log = get_logger("weights.colocated")

ALIGN = 64
"""Byte alignment of each tensor inside its bucket's buffer."""
COPY_THREADS = 2
"""Threads a bucket is copied in (torch's copy releases the GIL): one core's copy runs at ~5 GB/s."""

PIECE = 8 << 20
"""Bytes per copy piece (`_pieces`)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _new_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 buffer of `nbytes`: a shared-memory file on the CPU (torch's `file_system`
    storage, which an unrelated process maps by name), plain device memory on a GPU (shared by
    CUDA IPC handle). Touched once here, so no copy into it pays for page faults."""
    if device.type == "cpu":
        storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
        buf = torch.empty(0, dtype=torch.uint8).set_(storage)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    buf.zero_()
    return buf


def warm_shared_memory() -> None:
    """Start torch's shared-memory manager (`torch_shm_manager`, one per process, spawned by the first
    shared-memory storage and kept for the process's life) ahead of the first version."""
    _new_buffer(ALIGN, torch.device("cpu"))


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy cut into pieces of about PIECE bytes, so one large tensor keeps every copy thread busy."""
    if not src.is_contiguous():
        return [(dst, src)]
    step = max(1, PIECE // max(1, src.element_size()))
    d, s = dst.view(-1), src.view(-1)
    return [(d[i:i + step], s[i:i + step]) for i in range(0, s.numel(), step)]


class BufferSet:
    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.buffers: list[torch.Tensor] = []
        """One flat buffer per bucket index."""
        self.holders: set[str] = set()
        """Servers that may still read this set."""
        self.busy = False
        """Being written for the version under way."""

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def place(self, index: int, tensors: list[torch.Tensor], dtype: torch.dtype, copier: ThreadPoolExecutor) -> list[torch.Tensor]:
        """Bucket `index`'s tensors copied into this set (cast to `dtype`); returns the views."""
        device = tensors[0].device if tensors else torch.device("cpu")
        sizes = [t.numel() * dtype.itemsize for t in tensors]
        need = sum(_aligned(s) for s in sizes)
        while len(self.buffers) <= index:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
        buf = self.buffers[index]
        if buf.numel() < need or buf.device != device:
            buf = self.buffers[index] = _new_buffer(need, device)
        views, offset = [], 0
        for t, size in zip(tensors, sizes, strict=True):
            views.append(buf[offset:offset + size].view(dtype).view(t.shape))
            offset += _aligned(size)
        pieces = [piece for v, t in zip(views, tensors, strict=True) for piece in _pieces(v, t)]
        list(copier.map(lambda i: [v.copy_(t) for v, t in pieces[i::COPY_THREADS]], range(COPY_THREADS)))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the receiver reads through its own stream
        return views


class BufferPool:
    def __init__(self) -> None:
        self.sets: list[BufferSet] = []
        self._made = 0

    def acquire(self) -> BufferSet:
        """A set no server may read, marked busy: a free one, or a new one."""
        for s in self.sets:
            if not s.holders and not s.busy:
                s.busy = True
                return s
        self._made += 1
        s = BufferSet(self._made)
        if len(self.sets) >= 2:
            log.warning("a third weights buffer set: a server that did not answer may still read the others",
                        holders=[sorted(x.holders) for x in self.sets])
        self.sets.append(s)
        s.busy = True
        return s

    def loaded(self, server: str, bset: BufferSet, adopted: bool) -> None:
        """`server` took the version in `bset` (serving from it when `adopted`): it reads nothing else."""
        self.gone(server)
        if adopted:
            bset.holders.add(server)

    def unsure(self, server: str, bset: BufferSet) -> None:
        """`server` gave no answer: it may still read `bset` (and keeps whatever it held)."""
        bset.holders.add(server)

    def gone(self, server: str) -> None:
        """`server` is gone (its process and its mappings with it), or reads none of our sets."""
        for s in self.sets:
            s.holders.discard(server)

    def release(self, bset: BufferSet) -> None:
        """The version in `bset` is done; free sets beyond one are dropped."""
        bset.busy = False
        free = [s for s in self.sets if not s.holders and not s.busy]
        for s in free[1:]:
            self.sets.remove(s)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sets)
