"""Pinned host memory: a few large arenas, sub-allocated into block pages
(`HostArena`), and a pool lent out piece by piece to activations copied off
the device (`PinnedPool`).

[Note: why arenas registered with cudaHostRegister]
torch's caching host allocator rounds every pinned request up to a power of two
and `cudaHostAlloc` costs ~0.6 s/GiB, so pinning each tensor (or each block)
separately wastes up to 2x host RAM and time. We allocate ordinary host memory
in a few large chunks, page-lock each chunk once with `cudaHostRegister`, and
hand out aligned slices of it as block pages. A page never spans two chunks, so
a block's fetch is one contiguous copy.

[Note: pinning in huge pages]
Page-locking costs the kernel a fault and a pin per page: with 4 KiB pages,
touching 1 GiB and registering it took 0.2 s on an H200's host (`cudaHostAlloc`
0.6 s). A chunk mapped on its own and advised into 2 MiB pages
(`MADV_HUGEPAGE`, which transparent huge pages honour where the system sets
them to "madvise" or "always") takes 0.1 s: a 1B-parameter model pins ~16 GiB
of weights, gradients and AdamW state by its first step, seconds of it. Where
the system has no huge pages the advice is ignored, and the chunk pins as
before.

[Note: activations' host memory]
Activations copied off the device in a forward (`activations="offload"`)
wait in pinned host memory for their backward. torch's caching host
allocator would give each its own `cudaHostAlloc` the first time (0.6 s/GiB,
rounded up to a power of two: a 1B decoder's first step at 4x1024 sends 9
GiB, 5 s of it). `PinnedPool` cuts them instead from chunks pinned as above
(64 MiB at first, growing with the pool to 1 GiB), in the order the forward
sends them; the backward gives them back, last first, and a chunk is cut
again from its start once all its pieces are back. The next step sends the
same sizes in the same order and takes idle chunks in the order they were
made, so it finds the same chunks: the pool grows to the most a pass holds,
and no further for a fixed batch. A chunk cut again may still be read by a
copy in of a piece it lent (on the h2d stream, queued before the piece came
back): when its last piece comes back, an event is recorded on the h2d
stream, and the copies out into it wait for that event (not for the
fetches queued on the h2d stream since), one wait a chunk. A piece may come
back from a garbage collection on the thread that holds the pool's lock:
`give` never waits for the lock, and what it could not take is settled at
the next `take`.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections import deque

import psutil
import torch

from ..base.block import align
from ..base.budget import format_bytes

log = logging.getLogger("pager")

ARENA_CHUNK_BYTES = 1 << 30
# Host RAM we leave to the rest of the process and the OS when pinning.
HOST_RESERVE_BYTES = 2 << 30
PIN_PROGRESS_BYTES = 8 << 30  # log progress when pinning more than this
PIN_SECONDS_PER_GIB = 0.2  # what page-locking costs (4 KiB pages; half that in huge pages: see the Note)
COPY_SECONDS_PER_GIB = 0.2  # a plain host copy into pageable pages, roughly


class HostArena:
    """Hands out contiguous, aligned uint8 pages from a few large host chunks.

    Args:
        pin: page-lock the chunks (needed for asynchronous copies to a GPU).
        chunk_bytes: the size of each chunk; a larger request gets its own chunk.
    """

    def __init__(self, pin: bool, chunk_bytes: int = ARENA_CHUNK_BYTES):
        self.pin = pin
        self.chunk_bytes = chunk_bytes
        self._chunks: list[torch.Tensor] = []
        self._registered: list[torch.Tensor] = []
        self._used: list[int] = []  # bytes handed out of each chunk, from its start
        self._planned: list[int] = []
        self._plan_left = 0  # pages `reserve` planned that are still to be allocated
        self._shared: torch.Tensor | None = None  # the node's shared file, mapped (`share`)
        self._shared_used = 0
        self.reserved_bytes = 0
        self.used_bytes = 0

    def check_room(self, nbytes: int, what: str) -> None:
        """Fail before allocating anything if host RAM cannot hold `nbytes` more."""
        check_host_room(
            nbytes,
            f"{what} needs {format_bytes(nbytes)} of host memory for its pages",
            "page fewer tensors (a smaller model or `blocks=` that leaves the rest on the device)",
        )

    def reserve(self, sizes: list[int]) -> None:
        """Pin chunks for pages of `sizes` (to be allocated in this order),
        grouped into chunks of about `chunk_bytes`, each exactly its pages' sum."""
        group = 0
        self._plan_left = len(sizes)
        for n in [align(max(n, 1)) for n in sizes] + [None]:
            if group and (n is None or group + n > self.chunk_bytes):
                self._planned.append(group)
                group = 0
            group += n or 0
        self._planned.reverse()

    def share(self, path: str) -> None:
        """Carve the planned chunks (the pages `reserve` planned: the model's
        weights) out of the file `path` in shared memory, which the other
        ranks of the node map too ([Note: one host copy per node] in
        training/distributed.py). Pages allocated past the plan stay private."""
        size = max(sum(self._planned), 1)
        self._shared = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self._shared_used = 0
        if self.pin:
            # Not touched first: other ranks may be writing their pages into it.
            _register(self._shared, touch=False)
            self._registered.append(self._shared)

    def is_shared(self, page: torch.Tensor) -> bool:
        """Whether `page` lies in the node's shared file."""
        s = self._shared
        return s is not None and s.data_ptr() <= page.data_ptr() < s.data_ptr() + s.numel()

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes` (rounded up to the alignment) in one chunk."""
        nbytes = align(max(nbytes, 1))
        planned = self._plan_left > 0
        if planned:
            self._plan_left -= 1
        i = self._fitting(nbytes, planned)
        if i is None:
            if self._planned and self._planned[-1] >= nbytes:
                self._new_chunk(self._planned.pop(), planned=True)
            else:
                # Unplanned growth (gradients, optimizer state): chunks grow
                # with what is in use, so small models pin little, and hold
                # a whole number of pages of this size (the next pages of a
                # model's blocks are most often as large: no tail left over).
                grown = min(self.chunk_bytes, self.used_bytes) // nbytes * nbytes
                self._new_chunk(max(nbytes, grown))
            i = len(self._chunks) - 1
        start = self._used[i]
        self._used[i] += nbytes
        self.used_bytes += nbytes
        return self._chunks[i][start : start + nbytes]

    def _fitting(self, nbytes: int, planned: bool) -> int | None:
        """The chunk with room for `nbytes`: for a page of the plan, the
        last one (the plan's chunks hold its pages in order); for another,
        the last or else the first whose tail fits, never one of the node's
        shared file (it holds the plan's pages: the weights every rank of
        the node reads). Pages are few and allocated at wrap or a first
        step, never per use."""
        chunks, used = self._chunks, self._used
        order = (len(chunks) - 1,) if planned else (len(chunks) - 1, *range(len(chunks)))
        return next(
            (
                i
                for i in order
                if i >= 0 and used[i] + nbytes <= chunks[i].numel() and (planned or not self.is_shared(chunks[i]))
            ),
            None,
        )

    def _new_chunk(self, nbytes: int, planned: bool = False) -> None:
        if planned and self._shared is not None:  # (registered whole by `share`)
            chunk = self._shared[self._shared_used : self._shared_used + nbytes]
            self._shared_used += nbytes
        else:
            if self.reserved_bytes + nbytes >= PIN_PROGRESS_BYTES and self.pin:
                log.info(
                    "pager: pinning host pages: %s so far, %s more",
                    format_bytes(self.reserved_bytes),
                    format_bytes(nbytes),
                )
            chunk = host_memory(nbytes, self.pin)
            if self.pin:
                self._registered.append(chunk)
        self._chunks.append(chunk)
        self._used.append(0)
        self.reserved_bytes += nbytes

    def host_table(self, value: torch.Tensor, cuda: bool, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`value` as a table kept in host memory (a row table's, an experts
        module's): a CPU tensor owning its whole storage is used where it is,
        page-locked there on CUDA (a 40 GB table needs no second copy);
        anything else is copied into a page of the arena. Returns the host
        tensor and, where it was page-locked in place, what to give
        `unregister_table` when it is given back (else None)."""
        storage = value.untyped_storage()
        if (
            value.device.type == "cpu"
            and value.is_contiguous()
            and value.storage_offset() == 0
            and storage.nbytes() == value.numel() * value.element_size()
        ):
            if not (cuda and self.pin) or value.is_pinned():
                return value, None  # (page-locked already: as it is, nothing to undo)
            err = torch.cuda.cudart().cudaHostRegister(value.data_ptr(), storage.nbytes(), 0)
            if int(getattr(err, "value", err)) == 0:
                return value, value
            # (not lockable here: copied into the arena instead)
        nbytes = value.numel() * value.element_size()
        self.check_room(nbytes, what)
        host = self.allocate(nbytes)[:nbytes].view(value.dtype).view(value.shape)
        host.copy_(value)
        return host, None

    def close(self) -> None:
        """Unregister every chunk. Pages handed out must no longer be used."""
        unregister(self._registered)
        self._registered.clear()
        self._chunks.clear()
        self._used.clear()
        self._shared = None
        self.reserved_bytes = self.used_bytes = 0


def unregister_table(registered: torch.Tensor | None) -> None:
    """Undo the page-locking in place of `HostArena.host_table`."""
    if registered is not None:
        torch.cuda.cudart().cudaHostUnregister(registered.data_ptr())


POOL_CHUNK_MIN_BYTES = 64 << 20
POOL_CHUNK_MAX_BYTES = 1 << 30


class PinnedPool:
    """Page-locked host memory lent out piece by piece, to activations
    copied off the device until the backward brings them back ([Note:
    activations' host memory]).

    Args:
        mark_reads: called when a chunk's last piece comes back: an event
            after every copy queued so far that may read its pieces (None:
            nothing to wait for).
        wait_reads: called with that event before the chunk is lent out
            again: the writes into it come after it.
        pin: page-lock the chunks (False: pageable memory, for the tests).
    """

    def __init__(self, mark_reads, wait_reads, pin: bool = True):
        self._mark_reads, self._wait_reads = mark_reads, wait_reads
        self.pin = pin
        self._lock = threading.Lock()
        self._chunks: list[_PoolChunk] = []
        self._idle: list[_PoolChunk] = []  # chunks none of whose pieces are lent
        self._current: _PoolChunk | None = None  # the chunk pieces are cut from now
        self._lent: dict[int, _PoolChunk] = {}  # a lent piece's address -> its chunk
        # Pieces given back while the lock was held (by this thread too: a
        # garbage collection inside `take` may end an activation's life).
        self._returned: deque = deque()
        self.reserved_bytes = 0

    def take(self, shape, stride, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor of `shape`, `stride` and `dtype` (as
        `torch.empty_strided`), lent until `give(it)`."""
        itemsize = dtype.itemsize
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(n > 0 for n in shape) else 0
        nbytes = align(max(span * itemsize, 1))
        with self._lock:
            self._settle_returned()
            chunk = self._current
            if chunk is None or chunk.used + nbytes > chunk.data.numel():
                chunk = self._current = self._open(nbytes)
            piece = chunk.data[chunk.used : chunk.used + nbytes]
            chunk.used += nbytes
            chunk.lent += 1
            self._lent[piece.data_ptr()] = chunk
        return piece[: span * itemsize].view(dtype).as_strided(shape, stride)

    def give(self, host: torch.Tensor) -> None:
        """`host` (from `take`) is no longer used; no view of it may be.
        Never waits: where the lock is held, the piece is settled later."""
        # (by its storage: an empty tensor's data_ptr() is 0)
        address = host.untyped_storage().data_ptr() + int(host.storage_offset()) * host.element_size()
        if not self._lock.acquire(blocking=False):
            self._returned.append(address)
            return
        try:
            self._back(address)
        finally:
            self._lock.release()

    def _settle_returned(self) -> None:
        while self._returned:
            self._back(self._returned.popleft())

    def _back(self, address: int) -> None:
        chunk = self._lent.pop(address, None)
        if chunk is None:  # (the pool was closed since)
            return
        chunk.lent -= 1
        if chunk.lent == 0:
            chunk.used = 0
            chunk.reads = self._mark_reads()
            if chunk is self._current:
                self._current = None
            self._idle.append(chunk)

    def _open(self, nbytes: int) -> _PoolChunk:
        """A chunk to cut pieces of `nbytes` and more from: the first made
        of the idle ones that hold it (a step's pieces then find the chunks
        the last step cut them from), or a new one, larger as the pool grows."""
        fits = [c for c in self._idle if c.data.numel() >= nbytes]
        if fits:
            chunk = min(fits, key=lambda c: c.made)
            self._idle.remove(chunk)
            if chunk.reads is not None:
                self._wait_reads(chunk.reads)
            return chunk
        size = max(nbytes, min(POOL_CHUNK_MAX_BYTES, max(POOL_CHUNK_MIN_BYTES, self.reserved_bytes)))
        check_host_room(
            size,
            f"activations copied off the device need {format_bytes(size)} more of pinned host memory",
            'use a smaller batch, or activations="recompute"',
        )
        chunk = _PoolChunk(host_memory(size, self.pin), len(self._chunks))
        self._chunks.append(chunk)
        self.reserved_bytes += size
        return chunk

    def close(self) -> None:
        """Unpin every chunk. A piece still lent stays readable and
        writable, as pageable memory."""
        with self._lock:
            if self.pin:
                unregister(c.data for c in self._chunks)
            self._chunks.clear()
            self._idle.clear()
            self._lent.clear()
            self._returned.clear()
            self._current = None
            self.reserved_bytes = 0


class _PoolChunk:
    __slots__ = ("data", "made", "used", "lent", "reads")

    def __init__(self, data: torch.Tensor, made: int):
        self.data = data
        self.made = made  # its place in the order chunks were made
        self.used = 0  # bytes cut from its start since it was last idle
        self.lent = 0  # pieces lent and not given back
        self.reads = None  # an event after the copies that read its pieces, once all came back


def check_host_room(nbytes: int, needs: str, fix: str) -> None:
    """Fail before allocating `nbytes` more if host RAM cannot hold them
    (`needs`: who needs them, and how much; `fix`: what else to do)."""
    available = psutil.virtual_memory().available
    if nbytes + HOST_RESERVE_BYTES > available:
        raise MemoryError(
            f"pager: {needs}, but only {format_bytes(available)} is available (pager leaves "
            f"{format_bytes(HOST_RESERVE_BYTES)} to the rest of the system); free host memory, or {fix}."
        )


def unregister(chunks) -> None:
    """Unpin `chunks` (each registered whole by `host_memory` or `_register`)."""
    for chunk in chunks:
        torch.cuda.cudart().cudaHostUnregister(chunk.data_ptr())


def host_memory(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of host memory (uint8), page-locked if `pin`, in huge pages
    where the system has them ([Note: pinning in huge pages])."""
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    chunk = _huge_pages(nbytes)
    _register(chunk)
    return chunk


HUGE_PAGE_BYTES = 2 << 20


def _huge_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` of a private anonymous mapping of its own, starting on a huge
    page and advised into huge pages (the mapping lives as long as a view of it)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:  # (not Linux)
        return torch.empty(nbytes, dtype=torch.uint8)
    mapped = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = -torch.frombuffer(mapped, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE_BYTES
    try:
        mapped.madvise(advice, skip, nbytes)
    except OSError:  # (a kernel built without transparent huge pages: 4 KiB pages)
        pass
    # Its storage starts where the pages do (not at the mapping's start): what
    # `is_pinned()` asks CUDA about is the storage's first byte, registered.
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=skip)


def _register(chunk: torch.Tensor, touch: bool = True) -> None:
    t0 = time.perf_counter()
    if touch:
        # Touch the pages first so registration does not fault them in one by one.
        chunk.zero_()
    err = torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), chunk.numel(), 0)
    code = int(err.value) if hasattr(err, "value") else int(err)
    if code != 0:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else format_bytes(soft)
        raise MemoryError(
            f"pager: cudaHostRegister refused to pin {format_bytes(chunk.numel())} (CUDA error {code}); "
            f"the locked-memory limit (ulimit -l) is {limit}. Raise it (`ulimit -l unlimited`, or "
            f"memlock in /etc/security/limits.conf), or pass pin=False to page from pageable memory "
            f"(about 4-7x slower transfers)."
        )
    log.debug("pager: pinned %s in %.2f s", format_bytes(chunk.numel()), time.perf_counter() - t0)
