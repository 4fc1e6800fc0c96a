"""The disk tier: host pages as a cache of files, for models larger than host RAM.

[Note: the disk tier]
A model loaded with `pager.load(..., host_budget=...)` keeps its pages in a
fixed amount of pinned host memory (`PageArena`), a cache of the disk:

    disk --read (IO threads)--> host page --h2d (copy stream)--> device

A weights page is first read from the checkpoint itself (byte ranges of its
files, [Note: reading checkpoints in place] in base/files.py); a page that
changed since (a training step's write-back, gradients, optimizer state) and
must leave host memory is spilled to a file of its own in `spill=`
([Note: crash-safe writes] in base/files.py) and read from there next time.

Reads run on a pool of IO threads, in chunks of `CHUNK_BYTES`, several in
flight; allocation and eviction of host pages happen only on the threads that
use blocks (under the engine's lock), so an IO thread only ever fills or
drains memory it was handed. A fetch to the device waits for the page's read
(`page_in`); the read ahead (`read_ahead`, from `Pager.prefetch`) starts the
reads of the next uses, as far as host memory holds them without evicting a
page needed sooner (Belady, by the owner's schedule), so that the disk is
read while the GPU computes; the device prefetch does not fetch a block whose
page is still being read, so the thread that issues kernels never waits on
the disk unless the disk is behind. In a pool the uses run on into the next
model's plan; each page is read by its own model's tier, which alone knows
of its reads and owns its host memory.

A host page may be reused only after the copies that read it (h2d) or wrote
it (d2h) are done (`host_event`), and a dirty page only once it is on disk.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch

from ..base.block import align_up
from ..base.budget import format_bytes
from ..base.common import WEIGHTS, WORKER_PREFIX
from .arena import PageArena, aligned_empty
from .host import HOST_RESERVE_BYTES
from .page_io import CHUNK_BYTES, Files, Piece, ReadPath, read_range, read_rate, write_page

log = logging.getLogger("pager")

IO_THREADS = 8  # reads and writes in flight
READS_AHEAD = 4  # segments whose reads the read ahead keeps in flight at most
READ_AHEAD_USES = 64  # how far down the schedule the read ahead looks


class _Read:
    """A segment's read in flight: its chunks' futures."""

    def __init__(self, futures):
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> None:
        for f in self.futures:
            f.result()


class DiskTier:
    """One model's pages below host memory: a host cache of `capacity_bytes`
    over the checkpoint files and the spill folder ([Note: the disk tier]).

    Args:
        owner: the model's `Pager` (its counters, schedule and lock).
        capacity_bytes: pinned host bytes for pages; None: as many as needed
            (every page read once, then kept).
        spill: the folder for pages that changed (training), or None.
        pin: page-lock the host memory (CUDA).
    """

    def __init__(self, owner, capacity_bytes: int | None, spill: str | None, pin: bool):
        self.owner = owner
        self.capacity_bytes = capacity_bytes
        self.arena = PageArena(capacity_bytes, pin)
        self.spill = spill
        self.files = Files()
        self.pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix=f"{WORKER_PREFIX}io")
        self.pages: dict = {}  # segment -> (chunk, offset): pages in host memory, least recently used first
        self.reading: dict = {}  # segment -> _Read
        self.writing: dict = {}  # segment -> [future, free_after]
        self.blocks: dict = {}  # segment -> its block
        self._io_lock = threading.Lock()
        self._busy, self._busy_since = 0, 0.0
        self._unread: deque = deque()  # pages `read_all` has yet to place ([Note: regions pinned ahead])
        self._placing_error: BaseException | None = None  # raised on the supply's thread, for the next use
        self.kept: set = set()  # weights pages that stay in host memory ([Note: a kept set in host memory])
        self._kept_plan = None  # the schedule's plan they were chosen for

    # ---------------------------------------------------------------- segments
    def attach(self, block, seg, pieces: list[Piece] | None) -> None:
        """`seg` is new: its bytes are `pieces` (weights from a checkpoint) or
        nowhere yet (gradients, optimizer state)."""
        seg.host, seg.disk, seg.cache = None, pieces, self
        self.blocks[seg] = block

    def page_in(self, seg) -> None:
        """`seg.host` holds the page's bytes (read now, or waited for)."""
        self._tick()
        counters = self.owner.counters
        if seg in self.writing:
            # Needed again while being spilled: it stays in host memory, and
            # the write ends first (a caller may change the page next).
            self.writing[seg][1] = False
            self.writing[seg][0].result()
            self._collect()
        if seg.host is not None and seg not in self.reading:
            counters.host_hits += 1
            self.pages[seg] = self.pages.pop(seg)
            return
        counters.host_misses += 1
        t0 = time.perf_counter()
        if seg not in self.reading:
            self._start_read(seg, demand=True)
        read = self.reading.pop(seg, None)
        if read is not None:
            read.result()
        counters.host_wait_seconds += time.perf_counter() - t0

    def readable(self, seg) -> torch.Tensor:
        """`seg`'s page bytes: its host page, or (not in host memory) a copy
        read into a buffer of its own, so that reading never evicts."""
        self._collect()
        if seg in self.reading:
            self.reading.pop(seg).result()
        if seg.host is not None or not self._needs_read(seg):
            return seg.host if seg.host is not None else torch.zeros(seg.nbytes, dtype=torch.uint8)
        _base, buffer = aligned_empty(align_up(seg.nbytes))
        for piece in seg.disk:
            self.owner.counters.disk_read_bytes += read_range(self.files, buffer, piece, 0, piece.nbytes)[0]
        return buffer[: seg.nbytes]

    def ready(self, seg) -> bool:
        """A fetch of `seg` would not wait on the disk."""
        self._tick()
        return seg.host is not None and seg not in self.reading or not self._needs_read(seg)

    def page_for_write(self, seg) -> None:
        """`seg.host` is a page about to be overwritten whole (a write-back)."""
        self._collect()
        if seg in self.writing:  # a spill of the old bytes still running: let it end first
            self.writing.pop(seg)[0].result()
            self._collect()
        if seg in self.reading:
            self.reading.pop(seg).result()
        if seg.host is None:
            self._place(seg, demand=True)

    def written(self, seg, event) -> None:
        """`seg.host` got new bytes (on CUDA: once `event` is done); the disk's are stale."""
        seg.host_dirty = True
        seg.host_event = event

    def used(self, seg, event) -> None:
        """A copy reads `seg.host` until `event` (CUDA) is done."""
        seg.host_event = event

    def read_ahead(self, uses) -> None:
        """Start reads of the pages of the upcoming `uses` ((block, kinds) pairs)
        that host memory holds without evicting a page needed sooner. In a
        pool the uses run on into the next model's plan: its blocks' pages
        are read by that model's own tier (its host memory, its reads), or
        not at all where it has none."""
        self._tick()
        self._choose_kept()
        disks = self.owner.engine.host.disks
        other: DiskTier | None = None  # (the other model's tier last ticked)
        for distance, (block, kinds) in enumerate(uses):
            if distance >= READ_AHEAD_USES:
                return
            tier: DiskTier | None = self if block.owner is self.owner else disks.get(block.owner)
            if tier is None:
                continue  # (a model of the pool not paged from files)
            if tier is not self and tier is not other:
                other = tier
                tier._tick()  # (its reads that ended settle, and its unplaced pages start: it may not have run yet)
            if len(tier.reading) >= READS_AHEAD or not tier._read_for(block, kinds, distance):
                return

    def _read_for(self, block, kinds, distance: int) -> bool:
        """Start the reads `block`'s use of `kinds` needs (its deps' weights
        too); False where host memory has no room for one."""
        for b in [*block.deps, block]:
            for kind, seg in b.segments.items():
                if (b is not block and kind not in WEIGHTS) or kind not in kinds or seg.resident:
                    continue
                if seg.host is None and seg not in self.reading and self._needs_read(seg):
                    if not self._start_read(seg, demand=False, distance=distance):
                        return False
        return True

    def settle(self) -> None:
        """Let the reads and spills in flight end: their bytes are counted as
        they end, so that counters reset after this count only later work."""
        while self._unread:  # (pages `read_all` has not placed yet: their regions are being pinned)
            seg = self._unread.popleft()
            if self._needs_read(seg) and seg not in self.reading:
                self._start_read(seg, demand=False)
        for read in list(self.reading.values()):
            read.result()
        for future, _free in list(self.writing.values()):
            future.result()
        self._collect()

    def read_all(self, blocks) -> None:
        """Read every weights page of `blocks` into host memory, in this order,
        as the host memory for them is pinned in the background ([Note: regions
        pinned ahead] in engine/arena.py): host memory holds every page."""
        self._unread.extend(seg for block in blocks for seg in block.weight_segments if self._needs_read(seg))
        self.arena.supply([seg.nbytes for seg in self._unread if seg not in self.reading], self._region_made)
        self._place_unread()

    def _region_made(self) -> None:
        """On the supply's thread, after a region is pinned: place what now
        fits, if the engine's lock is free (else the next use does)."""
        lock = self.owner.lock
        if not lock.acquire(blocking=False):
            return
        try:
            self._place_unread()
        except BaseException as e:  # (raised on the next thread that uses the tier: `_tick`)
            self._placing_error = e
        finally:
            lock.release()

    def _place_unread(self) -> None:
        """Place the pages `read_all` left that fit the host memory made so far,
        and start their reads ([Note: regions pinned ahead] in engine/arena.py)."""
        unread = self._unread
        while unread:
            seg = unread[0]
            needed = self._needs_read(seg) and seg not in self.reading
            if needed and not self.arena.fits(seg.nbytes):
                return  # (its region is still being pinned: the next use looks again)
            unread.popleft()
            if needed:
                self._start_read(seg, demand=False)

    def peak_gbps(self, nbytes: int = 1 << 30) -> float:
        """The sequential read rate of the largest checkpoint file, measured
        once (`read_rate`): the ceiling for reads."""
        if getattr(self, "_peak_gbps", None) is None:
            paths = {p.path for seg in self.blocks for p in (seg.disk or ()) if p.path and p.tensor is None}
            self._peak_gbps = read_rate(self.files, self.pool, max(paths, key=os.path.getsize), nbytes)
        return self._peak_gbps

    def close(self) -> None:
        """Let every read and write end, free host memory, close files, drop spilled pages."""
        self.arena.stop_supply()  # (first: its thread may be placing pages and starting reads)
        self._unread.clear()
        for read in self.reading.values():
            for f in read.futures:
                f.exception()
        for future, _free in self.writing.values():
            future.exception()
        self.pool.shutdown(wait=True)
        self.files.close()
        self.arena.close()
        for seg in self.blocks:
            if seg.disk and seg.disk[0].path and seg.disk[0].path.startswith(self.spill or "\0"):
                try:
                    os.remove(seg.disk[0].path)
                except OSError:
                    pass
        self.pages.clear()
        self.reading.clear()
        self.writing.clear()

    # ---------------------------------------------------------------- inside
    def _choose_kept(self) -> None:
        """[Note: a kept set in host memory]
        Evicting the page needed furthest ahead (Belady) is optimal for
        demand reads, but with reads ahead it slides: each read ahead evicts
        the page used last, which in a cyclic order (a layer stack, forward
        after forward) is needed again only after all the others, so every
        page comes from disk on every pass. As the device does with its kept
        set ([Note: why next use, and a kept set] in engine/schedule.py), host
        memory keeps a fixed set of weights pages, the first in the plan
        that fit beside a streaming window of two of the largest pages (one
        read while the other is copied up), and the rest stream through the
        window: a pass reads the model less the kept set. Blocks the device
        keeps need no host page. Only a use that needs room now evicts a kept page."""
        scheduler = self.owner.scheduler
        if self.capacity_bytes is None or scheduler.plan is self._kept_plan:
            return
        self._kept_plan = scheduler.plan
        blocks = list(dict.fromkeys(b for b, _k in scheduler.plan))
        streamed = [w for b in blocks if not b.resident_for_life and b not in scheduler.kept for w in b.weight_segments]
        room = self.capacity_bytes - 2 * max((s.nbytes for s in streamed), default=0)
        self.kept, used = set(), 0
        for seg in streamed:
            if used + align_up(seg.nbytes) <= room:
                self.kept.add(seg)
                used += align_up(seg.nbytes)

    @staticmethod
    def _needs_read(seg) -> bool:
        return seg.host is None and seg.host_valid and seg.disk is not None

    def _start_read(self, seg, demand: bool, distance: float = 0) -> bool:
        if not self._place(seg, demand, distance):
            return False
        if seg.disk is None:
            return True  # nothing on disk yet (a page that never left host memory holds nothing)
        page = seg.host
        futures = [
            self.pool.submit(self._read_chunk, page, piece, start, min(piece.nbytes, start + CHUNK_BYTES))
            for piece in seg.disk
            for start in range(0, piece.nbytes, CHUNK_BYTES)
        ]
        self.reading[seg] = _Read(futures)
        return True

    def _read_chunk(self, page, piece, start, end) -> None:
        self._io_started()
        try:
            n, path = read_range(self.files, page, piece, start, end)
        finally:
            self._io_ended()
        with self._io_lock:
            self.owner.counters.disk_read_bytes += n
            self.owner.counters.disk_direct_bytes += n if path is ReadPath.DIRECT else 0
            self.owner.counters.disk_cached_bytes += n if path is ReadPath.CACHED else 0

    def _io_started(self) -> None:
        with self._io_lock:
            if not self._busy:
                self._busy_since = time.perf_counter()
            self._busy += 1

    def _io_ended(self) -> None:
        with self._io_lock:
            self._busy -= 1
            if not self._busy:
                self.owner.counters.disk_read_seconds += time.perf_counter() - self._busy_since

    def _tick(self) -> None:
        """At each use: reads that ended settle, and pages `read_all` left whose host memory is made start reading."""
        self._collect()
        if self._placing_error is not None:
            error, self._placing_error = self._placing_error, None
            raise error
        if self._unread:
            self._place_unread()

    def _collect(self) -> None:
        """Reads and spills that ended: their pages settle."""
        for seg in [s for s, r in self.reading.items() if r.done()]:
            self.reading.pop(seg).result()  # (raises a read's error here, on the using thread)
        for seg in [s for s, (f, _free) in self.writing.items() if f.done()]:
            future, free_after = self.writing.pop(seg)
            future.result()
            path = self._spill_path(seg)
            self.files.forget(path)  # (descriptors open on the file it replaced would read the old bytes)
            seg.disk = [Piece(0, align_up(seg.nbytes), path, 0, padded=True)]
            seg.host_dirty = False
            if free_after:
                self._drop(seg)

    def _place(self, seg, demand: bool, distance: float = 0) -> bool:
        """Host memory for `seg`'s page, evicting others: for `demand` any
        page that may leave; for a read ahead only clean pages needed after
        `distance` uses. False if there is none."""
        while True:
            got = self.arena.allocate(seg.nbytes, high=seg not in self.kept)
            if got is not None:
                c, offset, page = got
                seg.host = page[: seg.nbytes]  # (the page's memory runs on to the alignment: direct I/O uses it)
                self.pages[seg] = (c, offset)
                return True
            victim = self._victim(seg, demand, distance)
            if victim is None:
                if not demand:
                    return False
                if self.writing:  # dirty pages on their way out: their memory comes back
                    future, _free = next(iter(self.writing.values()))
                    future.result()
                    self._collect()
                    continue
                raise self._no_room(seg)
            if victim in self.reading:  # (a use needs the room now: the read ahead gives way)
                self.reading.pop(victim).result()
            if victim.host_dirty:
                self._spill_out(victim)  # its memory comes back once it is written
                if not demand:
                    return False
            else:
                self._drop(victim)

    def _victim(self, seg, demand: bool, distance: float):
        best, best_key = None, None
        for other in self.pages:
            if other is seg or other in self.writing or (other in self.reading and not demand):
                continue
            if other.host_dirty and self.spill is None:
                continue
            if other.host_event is not None and not demand and not other.host_dirty and not other.host_event.query():
                continue  # (a read ahead does not wait on copies; a dirty page's spill waits for its own)
            if other in self.kept and not demand:
                continue
            block = self.blocks[other]
            far = other.resident and (block.resident_for_life or block in block.owner.scheduler.kept)
            key = float("inf") if far else block.owner.scheduler.distance_to(block)
            if other in self.kept:
                key = -1.0  # (a use that needs the room now takes it last)
            if not demand and key <= distance:
                continue
            if best_key is None or key > best_key:
                best, best_key = other, key
        return best

    def _drop(self, seg) -> None:
        """Give `seg`'s host memory back (its bytes are on disk, or not wanted)."""
        if seg.host_event is not None:
            seg.host_event.synchronize()  # a copy may still read or write the page
        c, offset = self.pages.pop(seg)
        self.arena.release(c, offset, seg.nbytes)
        seg.host, seg.host_event = None, None

    def _spill_out(self, seg) -> None:
        """Start writing dirty `seg` to its spill file; its memory is freed once written."""
        event = seg.host_event
        path = self._spill_path(seg)

        def write():
            if event is not None:
                event.synchronize()  # the write-back into the page must have landed
            t0 = time.perf_counter()
            write_page(seg.host, seg.nbytes, path)
            with self._io_lock:
                self.owner.counters.disk_write_bytes += align_up(seg.nbytes)
                self.owner.counters.disk_write_seconds += time.perf_counter() - t0
                self.owner.counters.spills += 1

        self.writing[seg] = [self.pool.submit(write), True]

    def _spill_path(self, seg) -> str:
        block = self.blocks[seg]
        spill = cast(str, self.spill)  # (only pages of a tier with a spill folder are spilled)
        return os.path.join(spill, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', block.name)}.{seg.kind}.page")

    def _no_room(self, seg) -> MemoryError:
        dirty = sum(s.nbytes for s in self.pages if s.host_dirty)
        return no_host_room(
            seg,
            self.blocks[seg].name,
            cast(int, self.capacity_bytes),
            self.arena.used_bytes,
            dirty,
            spills=self.spill is not None,
        )


def no_host_room(seg, block_name: str, capacity_bytes: int, used_bytes: int, dirty_bytes: int, spills: bool):
    """The error of a page that the host budget cannot hold."""
    fix = (
        'pass spill="folder" to pager.load so that changed pages (training) can leave host memory, or '
        if dirty_bytes and not spills
        else ""
    )
    return MemoryError(
        f"pager: host_budget={format_bytes(capacity_bytes)} cannot hold the {seg.kind} page of "
        f"{block_name!r} ({format_bytes(seg.nbytes)}): pages in use or changed hold "
        f"{format_bytes(used_bytes)} ({format_bytes(dirty_bytes)} changed since they were read); "
        f"{fix}raise host_budget (at least twice the largest block with its gradients and optimizer state)."
    )


def check_host_budget(capacity_bytes: int, largest_bytes: int) -> None:
    """Refuse a host budget that cannot hold two of the largest pages, or
    that host RAM cannot hold."""
    import psutil

    if capacity_bytes < 2 * largest_bytes:
        raise ValueError(
            f"pager: host_budget={format_bytes(capacity_bytes)} holds fewer than two of the largest block's pages "
            f"({format_bytes(largest_bytes)} each): one is read while another is copied to the device. Give "
            f"host_budget of at least {format_bytes(2 * largest_bytes, up=True)}."
        )
    available = psutil.virtual_memory().available
    if capacity_bytes + HOST_RESERVE_BYTES > available:
        raise MemoryError(
            f"pager: host_budget={format_bytes(capacity_bytes)} is more than the {format_bytes(available)} of host "
            f"memory available (pager leaves {format_bytes(HOST_RESERVE_BYTES)} to the rest); give a smaller one."
        )
