"""Pinned host memory: a few large arenas, sub-allocated into block pages.

[Note: why arenas registered with cudaHostRegister]
torch's caching host allocator rounds every pinned request up to a power of two
and `cudaHostAlloc` costs ~0.4 s/GiB, so pinning each tensor (or each block)
separately wastes up to 2x host RAM and time. We allocate ordinary host memory
in a few large chunks, page-lock each chunk once with `cudaHostRegister`, and
hand out aligned slices of it as block pages. A page never spans two chunks, so
a block's fetch is one contiguous copy.
"""

from __future__ import annotations

import logging
import time

import psutil
import torch

from ..base.block import align
from ..base.budget import format_bytes

log = logging.getLogger("pager")

ARENA_CHUNK_BYTES = 1 << 30
# Host RAM we leave to the rest of the process and the OS when pinning.
HOST_RESERVE_BYTES = 2 << 30
PIN_PROGRESS_BYTES = 8 << 30  # log progress when pinning more than this
PIN_SECONDS_PER_GIB = 0.4  # what page-locking costs on the H100 host (DESIGN.md)
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
        self._used_in_last = 0
        self._planned: list[int] = []
        self._shared: torch.Tensor | None = None  # the node's shared file, mapped (`share`)
        self._shared_used = 0
        self.reserved_bytes = 0
        self.used_bytes = 0

    def check_room(self, nbytes: int, what: str) -> None:
        """Fail before allocating anything if host RAM cannot hold `nbytes` more."""
        available = psutil.virtual_memory().available
        if nbytes + HOST_RESERVE_BYTES > available:
            raise MemoryError(
                f"pager: {what} needs {format_bytes(nbytes)} of host memory for its pages, but only "
                f"{format_bytes(available)} is available (pager leaves {format_bytes(HOST_RESERVE_BYTES)} "
                f"to the rest of the system); free host memory, or page fewer tensors (a smaller model "
                f"or `blocks=` that leaves the rest on the device)."
            )

    def reserve(self, sizes: list[int]) -> None:
        """Pin chunks for pages of `sizes` (to be allocated in this order),
        grouped into chunks of about `chunk_bytes`, each exactly its pages' sum."""
        group = 0
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
        if not self._chunks or self._used_in_last + nbytes > self._chunks[-1].numel():
            if self._planned and self._planned[-1] >= nbytes:
                self._new_chunk(self._planned.pop(), planned=True)
            else:
                # Unplanned growth (gradients, optimizer state): chunks grow
                # with what is in use, so small models pin little.
                self._new_chunk(max(nbytes, min(self.chunk_bytes, self.used_bytes)))
        start = self._used_in_last
        self._used_in_last += nbytes
        self.used_bytes += nbytes
        return self._chunks[-1][start : start + nbytes]

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
            chunk = torch.empty(nbytes, dtype=torch.uint8)
            if self.pin:
                _register(chunk)
                self._registered.append(chunk)
        self._chunks.append(chunk)
        self._used_in_last = 0
        self.reserved_bytes += nbytes

    def close(self) -> None:
        """Unregister every chunk. Pages handed out must no longer be used."""
        for chunk in self._registered:
            torch.cuda.cudart().cudaHostUnregister(chunk.data_ptr())
        self._registered.clear()
        self._chunks.clear()
        self._shared = None
        self.reserved_bytes = self.used_bytes = self._used_in_last = 0


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
