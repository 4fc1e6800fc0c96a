"""The disk tier's host memory: `PageArena` (aligned pages cut from pinned
regions) and `RegionSupply` (regions pinned ahead, off the thread that runs
the model).

[Note: regions pinned ahead]
Without a host budget every page of a loaded model is read once, in the
order of use, and kept ([Note: the disk tier] in engine/disk.py). Placing a
page needs a region of host memory for it, and making a region means pinning
it: 0.1 s a GiB even in huge pages ([Note: pinning in huge pages] in
engine/host.py). `pager.load` placed every page before it returned, so the
first token of a 7B model at bf16 waited 0.6 s for pinning before anything
ran. A thread of its own placing pages would need the engine's lock for
each one, which the thread running the first forward holds while it waits
for a page to be read: that thread then placed most pages itself, pinning
as it went, and the first token took 2.0 s instead of 1.3 s.

So the pinning alone moves off: `RegionSupply` pins, on a thread of its
own, as many regions as the pages to read need, and hands them over in a
queue; it never waits for a lock. A page is placed (under the engine's lock,
as always) by whichever thread gets there first: the supply's thread after
each region, if the lock is free at that moment (it only tries), or the
using thread at its next use of the disk tier (`DiskTier._place_unread`),
which takes a region when a page fits no hole (`PageArena.allocate`),
waiting at most for the one being pinned. So reads start as soon as their
memory exists, whether or not a forward runs. An error while pinning (the
locked-memory limit) is raised on the thread that takes that region; one
while placing on the supply's thread, on the next thread that uses the disk
tier.
"""

from __future__ import annotations

import queue
import threading

import torch

from ..base.block import DIRECT_ALIGN, align, align_up
from ..base.common import WORKER_PREFIX
from .host import HUGE_PAGE_BYTES, host_memory, unregister

REGION_BYTES = 1 << 30  # a region for pages without a host budget (a larger page: its own; fewer pages: theirs)


def aligned_empty(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host memory for `nbytes` starting on a DIRECT_ALIGN boundary: (what
    was allocated, the aligned view)."""
    base = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8)
    skip = -base.data_ptr() % DIRECT_ALIGN
    return base, base[skip : skip + nbytes]


def new_region(nbytes: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Host memory for a region of `nbytes`: (what was allocated, the aligned view)."""
    # (pinned: a mapping of its own, on a huge page's boundary, which is a direct read's too)
    return (host_memory(nbytes, pin=True),) * 2 if pin else aligned_empty(nbytes)


class RegionSupply:
    """Regions pinned ahead on a thread of its own ([Note: regions pinned ahead]).

    Args:
        sizes: the bytes of each region to make, in order.
        pin: page-lock them (CUDA).
        made: called (on the supply's thread) after each region is ready.
    """

    def __init__(self, sizes: list[int], pin: bool, made=None):
        self.pin, self._made = pin, made
        # (pinned in the context of the device current here, as on this thread: a new thread's is cuda:0)
        self._device = torch.cuda.current_device() if pin else None
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # regions made (or the error that stopped it)
        self._untaken = len(sizes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._make, args=(sizes,), name=f"{WORKER_PREFIX}pin", daemon=True)
        self._thread.start()

    def _make(self, sizes: list[int]) -> None:
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            for nbytes in sizes:
                if self._stop.is_set():
                    return
                self._ready.put(new_region(nbytes, self.pin))
                if self._made is not None:
                    self._made()
        except BaseException as e:  # (raised on the thread that takes the region: `take`)
            self._ready.put(e)

    def spent(self) -> bool:
        """Every region was taken."""
        return self._untaken <= 0

    def ready(self) -> bool:
        """A region can be taken without waiting."""
        return self._untaken > 0 and not self._ready.empty()

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next region (waiting for the one being pinned), or None when all were taken."""
        if self._untaken <= 0:
            return None
        got = self._ready.get()
        self._untaken -= 1
        if isinstance(got, BaseException):
            self._untaken = 0
            raise got
        return got

    def close(self) -> None:
        """Stop making regions and give back those not taken."""
        self._stop.set()
        self._thread.join()
        while not self._ready.empty():
            got = self._ready.get()
            if self.pin and not isinstance(got, BaseException):
                unregister([got[0]])
        self._untaken = 0


class PageArena:
    """Host memory handed out as aligned pages, first fit: one region of
    `capacity_bytes` (pinned at first use), or, with None, regions added as
    pages are asked for (never given back before `close`), taken from a
    `RegionSupply` where one was started (`supply`)."""

    def __init__(self, capacity_bytes: int | None, pin: bool):
        self.capacity_bytes, self.pin = capacity_bytes, pin
        self.chunks: list[torch.Tensor] = []  # aligned views
        self._bases: list[torch.Tensor] = []  # what was allocated (and registered)
        self.free: list[list] = []  # per chunk: sorted [offset, size]
        self.reserved_bytes = self.used_bytes = 0
        self.expected_bytes: int | None = None  # (see `expect`)
        self._supply: RegionSupply | None = None

    def expect(self, nbytes: int) -> None:
        """About `nbytes` of pages will be placed (a loaded model's weights):
        a region made on demand before `supply` (the pages a load fetches
        first) is no larger than what is still to come."""
        self.expected_bytes = nbytes

    def supply(self, page_bytes: list[int], made=None) -> None:
        """Start pinning, in the background, regions for pages of `page_bytes`
        (in the order they will be placed) beyond the holes there are now;
        `made()` is called on that thread after each."""
        holes = [hole[1] for holes in self.free for hole in holes]
        first_new = len(holes)
        sizes: list[int] = []
        for nbytes in map(align_up, page_bytes):  # (first fit, as `allocate` places them)
            fit = next((i for i, room in enumerate(holes) if room >= nbytes), None)
            if fit is None:
                sizes.append(max(REGION_BYTES, nbytes))
                holes.append(sizes[-1])
                fit = len(holes) - 1
            holes[fit] -= nbytes
        # Each region no larger than the pages it takes (to a huge page): pinning touches every byte, so
        # a model of 0.2 GB (a pipeline's VAE) would hold a whole REGION_BYTES of host memory.
        sizes = [min(size, align(size - holes[first_new + i], HUGE_PAGE_BYTES)) for i, size in enumerate(sizes)]
        if sizes:
            self._supply = RegionSupply(sizes, self.pin, made)

    def fits(self, nbytes: int) -> bool:
        """A page of `nbytes` can be placed without waiting for a region to be pinned."""
        nbytes = align_up(max(nbytes, 1))
        if any(hole[1] >= nbytes for holes in self.free for hole in holes):
            return True
        if self._supply is not None and not self._supply.spent():
            return self._supply.ready()
        return self.capacity_bytes is None  # (off the supply's plan: `allocate` makes the region)

    def allocate(self, nbytes: int, high: bool = False):
        """A uint8 page of `nbytes` (rounded up to DIRECT_ALIGN) as (chunk,
        offset, tensor), or None. `high`: from the top of the region (pages
        that come and go), else from the bottom (pages that stay), so that
        the churn does not cut the room of the ones that stay into pieces."""
        nbytes = align_up(max(nbytes, 1))
        for c, holes in enumerate(self.free):
            for hole in reversed(holes) if high else holes:
                if hole[1] >= nbytes:
                    hole[1] -= nbytes
                    offset = hole[0] + hole[1] if high else hole[0]
                    if not high:
                        hole[0] += nbytes
                    if not hole[1]:
                        holes.remove(hole)
                    self.used_bytes += nbytes
                    return c, offset, self.chunks[c][offset : offset + nbytes]
        if self.capacity_bytes is not None:
            if self.chunks or nbytes > self.capacity_bytes:
                return None
            self._add(*new_region(align_up(self.capacity_bytes), self.pin))
        else:
            region = self._supply.take() if self._supply is not None else None
            self._add(*(region or new_region(self._region_bytes(nbytes), self.pin)))
        return self.allocate(nbytes, high)

    def _region_bytes(self, nbytes: int) -> int:
        """The size of a region made on demand for a page of `nbytes`."""
        to_come = None if self.expected_bytes is None else self.expected_bytes - self.used_bytes
        if to_come is None or not 0 < to_come < REGION_BYTES:
            return max(REGION_BYTES, nbytes)
        return max(nbytes, align(to_come, HUGE_PAGE_BYTES))

    def release(self, c: int, offset: int, nbytes: int) -> None:
        nbytes = align_up(max(nbytes, 1))
        holes = self.free[c]
        holes.append([offset, nbytes])
        holes.sort()
        merged = [holes[0]]
        for hole in holes[1:]:
            if merged[-1][0] + merged[-1][1] == hole[0]:
                merged[-1][1] += hole[1]
            else:
                merged.append(hole)
        self.free[c] = merged
        self.used_bytes -= nbytes

    def _add(self, base: torch.Tensor, chunk: torch.Tensor) -> None:
        self._bases.append(base)
        self.chunks.append(chunk)
        self.free.append([[0, chunk.numel()]])
        self.reserved_bytes += chunk.numel()

    def stop_supply(self) -> None:
        """Stop pinning regions ahead; those made and not taken are given back."""
        if self._supply is not None:
            self._supply.close()
            self._supply = None

    def close(self) -> None:
        self.stop_supply()
        if self.pin:
            unregister(self._bases)
        self._bases.clear()
        self.chunks.clear()
        self.free.clear()
        self.reserved_bytes = self.used_bytes = 0
