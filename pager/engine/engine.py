"""The residency engine: what is where, what is in flight, what may leave,
and how bytes move. One per device budget; several pagers (models) may share it.

[Note: the residency engine]
The engine owns the budget, the bytes resident and in flight, the ordered set
of resident blocks, the copy streams (through the transport) and the tier
under the device (`engine/tiers.py`). Each segment's residency is one explicit state:

    HOST --fetch--> FETCHING --wait--> RESIDENT --evict--> WRITING_BACK --fetch--> FETCHING
                                                  \\--evict (clean, or CPU)--> HOST

`fetch` allocates device memory and enqueues the copy up; `wait` orders
compute after it; `evict` writes dirty pages back and frees the memory; a
fetch of a page still being written back orders its copy after the write-back.
Pins (a block in use) keep a block from leaving. Every transition is one
method, and each is a no-op on a segment already in the state it leads to.

What a block's bytes mean (guards on its tensors, gradients paged out as
stand-ins, deferred optimizer updates, activations that share the budget) is
its owner's business: the engine calls the owner (`block.owner`, a `Pager`)
through the few methods listed in `Owner` (engine/owner.py), and never the other way round
except through the public methods here.

[Note: stream discipline]
Written once, in `engine/transport.py` ([Note: events, not record_stream]): device
memory of a block is allocated on the h2d stream and freed from the host
after the h2d stream has waited for the block's last use on compute and its
write-back on the d2h stream; compute waits on a block's fetch event before
reading it (`wait`); a write-back waits on the block's last use (`evict`).
No host synchronisation in any of it, except on the out-of-memory path.

"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ..base.block import PageState, Segment, storage_key
from ..base.budget import format_bytes
from ..base.common import ROOM_WAIT_SECONDS, BudgetError, _record_range
from . import segments
from .meter import Meter
from .room import Room
from .tiers import HostTier
from .transport import CpuTransport, CudaTransport
from .waiting import Waiters

log = logging.getLogger("pager")


class Engine:
    """The budget and the residency of every block of its owners.

    Args:
        device: the device the blocks run on ("cpu" stands for a device with a
            separate host copy: same code, synchronous copies).
        budget_bytes: device bytes for blocks (and, where owners page them,
            activations).
        pin: page-lock the host tier (CUDA only).
        wait_seconds: how long a use waits for room held by other threads
            before it fails ([Note: waiting for room] in engine/waiting.py).
        helpers: (GPU, budget bytes) of other GPUs whose links carry shares
            of each fetch ([Note: split fetch] in engine/split_fetch.py) and
            whose memory keeps pages up to their budgets ([Note: pages kept
            on helpers] in engine/helper_pages.py); checked by
            `split_fetch.resolve_helpers` and `split_fetch.helper_budgets`.
    """

    def __init__(
        self,
        device: torch.device,
        budget_bytes: int,
        *,
        pin: bool = True,
        wait_seconds: float = ROOM_WAIT_SECONDS,
        helpers=(),
    ):
        self.device = device
        self.budget_bytes = budget_bytes
        self.pool = None  # the `Pool` this engine serves, if it was made for one
        self.transport = CudaTransport(device, helpers) if device.type == "cuda" else CpuTransport(device)
        self.host = HostTier(self.transport, pin=pin and device.type == "cuda")
        self.owners: list = []
        self.resident: dict = {}  # ordered set of blocks with device bytes, oldest first
        self.resident_bytes = 0
        self.total_bytes = 0  # of every segment of every owner
        # One lock for every owner (see [Note: threads] in base/common.py): a
        # transition of one owner's block may evict another's.
        self.lock = threading.RLock()
        self.room = Room(
            self
        )  # what blocks may hold, and who leaves to make more ([Note: sharing the room] in engine/room.py)
        self.waiters = Waiters(
            self, wait_seconds
        )  # uses waiting for room ([Note: waiting for room] in engine/waiting.py)
        self.peak_resident_bytes = 0
        self.departures = 0  # evictions so far (a prefetch's frontier holds until one: model/prefetch.py)
        self.meter = Meter(self.transport.is_cuda)  # copy and stall seconds, per block and owner

    def __repr__(self) -> str:
        return (
            f"Engine({self.device}, budget {format_bytes(self.budget_bytes)}, "
            f"{len(self.owners)} model(s), {format_bytes(self.resident_bytes)} resident)"
        )

    def fixed_bytes(self) -> int:
        """Device bytes that stay for life (owners' remainders and the blocks they use)."""
        return sum(o.fixed_bytes() for o in self.owners)

    def held_bytes(self) -> int:
        """Device bytes its owners hold whatever runs: for life, and in their row tables' and experts' caches."""
        return self.fixed_bytes() + sum(o.row_bytes for o in self.owners)

    def least_budget(self) -> int:
        """The least budget its owners run in together: what each holds for
        life and in its row tables' and experts' caches, and room for the one
        whose largest use needs most beside it."""
        return self.held_bytes() + max((max(0, o.min_budget_bytes - o.fixed_bytes()) for o in self.owners), default=0)

    # ---------------------------------------------------------- segments
    def add_segment(self, block, kind: str, named: list, values: bool, **options) -> Segment:
        """A new segment of `block` for `named` tensors, counted in the
        engine's total: `segments.new_segment` says how it is made and what
        `options` (`codec`, `pieces`, `keep_plain`) mean."""
        seg = segments.new_segment(self, block, kind, named, values, **options)
        block.segments[kind] = seg
        self._count_total(block.owner, seg.nbytes)
        return seg

    def _count_total(self, owner, nbytes: int) -> None:
        self.total_bytes += nbytes
        owner.total_bytes += nbytes

    def _count_resident(self, block, nbytes: int) -> None:
        self.resident_bytes += nbytes
        block.owner.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    # ---------------------------------------------------------- pins
    def pin(self, block) -> None:
        if block.pins == 0:
            self.room.not_idle(block)
        block.pins += 1
        tid = threading.get_ident()
        block.thread_pins[tid] = block.thread_pins.get(tid, 0) + 1

    def unpin(self, block) -> None:
        block.pins -= 1
        tid = threading.get_ident()
        n = block.thread_pins.pop(tid, 0)
        if n > 1:
            block.thread_pins[tid] = n - 1
        elif n == 0 or block.pins == 0:
            # Released by another thread than took it (or by the last): no
            # thread keeps the unserved path it may no longer have.
            block.thread_pins.clear()
        if block.pins == 0 and block in self.resident:
            self.room.became_idle(block)

    def idle(self, block, mark: bool = True, timed: bool = False) -> None:
        """`block`'s last pin is gone: from the end of compute enqueued so far,
        its memory may be reused (`mark`; without, an eviction orders itself
        after a fresh event: see [Note: the last use, or a fresh event]);
        `timed`: the mark is a timing event (a traced span's end)."""
        self.waiters.room_may_be_back()
        if not mark:
            block.last_use_event = None
            return
        block.last_use_event = self.transport.record_compute() if timed else self.transport.mark_compute()
        block.release_versions = block.versions()

    # ---------------------------------------------------------- transitions
    def bring(self, block, kinds, all_resident: bool = False) -> bool:
        """Pin `block` and make `kinds` of it usable by compute: room made,
        fetched, compute ordered after the fetch. True if bytes were copied
        for this call (a miss). On failure nothing stays pinned."""
        missing = 0 if all_resident else block.missing_bytes(kinds)
        self.pin(block)
        try:
            if missing:
                with _record_range("fetch", block.name):
                    missing = self.waiters.room_for_use(block, kinds)
                    self.fetch(block, kinds)
        except BaseException:
            self.unpin(block)
            raise
        moved = bool(missing and block.fetched_data)
        self.wait(block)
        return moved

    def fetch(self, block, kinds) -> None:
        """HOST or WRITING_BACK -> FETCHING for each of `kinds` not on the
        device: memory allocated (the room made by the caller), the page's
        copy up enqueued. Compute has not waited yet (`wait`)."""
        block.settled = False  # until an acquire has ordered compute after this fetch
        owner = block.owner
        if block.host_update is not None or block.owner_update is not None:
            owner.host_pages_ready(block)  # (its optimizer update, on the host or another rank's, writes the pages)
        allocated, moved, decoded, nbytes, first, end = False, False, False, 0, None, None
        last_copy = None  # the end of a copy enqueued after every allocation so far
        for kind in kinds:
            seg = block.segments.get(kind)
            if seg is None or seg.resident:
                continue
            self._allocate(block, seg)
            allocated = True
            self._count_resident(block, seg.nbytes)
            if kind == "grads":
                owner.grads_arriving(block, seg)  # host_valid: is a gradient in the page still wanted?
            if seg.host_valid:
                # A page still being written back is final only once that copy is done.
                after = (seg.writeback_event,) if seg.state is PageState.WRITING_BACK else ()
                start, end = self.host.up(block, seg, after=after)
                if seg.encoded is None:
                    owner.counters.split_fetch_bytes += self.transport.helper_link_bytes
                    owner.counters.helper_page_bytes += self.transport.helper_memory_bytes
                first = first if moved else start
                moved = True
                decoded = decoded or seg.encoded is not None
                nbytes += seg.page_bytes
                self.meter.copied(block, "h2d", start, end, seg.page_bytes)
            last_copy = end if seg.host_valid and seg.encoded is None else None
            seg.state = PageState.FETCHING
            seg.snapshot_versions()
        block.fetched_data = moved
        if moved:
            block.stats.fetches += 1
        if allocated:
            # One mark after every allocation and copy: compute waits on it
            # (the last copy's end, where no allocation came after it).
            event = self.transport.mark_h2d(decoded, last_copy=last_copy)
            end = event if event is not None else time.perf_counter()
            block.fetch_event = event
        if moved:
            owner.tracer.span("fetch", block.name, first, end, nbytes)
        self.resident[block] = None
        if block.pins == 0:
            self.room.became_idle(block)  # (a prefetch)
        owner.counters.peak_resident_bytes = max(owner.counters.peak_resident_bytes, owner.resident_bytes)
        block.stats.peak_resident_bytes = max(block.stats.peak_resident_bytes, block.device_bytes())
        self._moved()

    def host_pages_change(self, block) -> None:
        """`block`'s weight pages are about to change in host memory (its
        optimizer update runs there): copies of them elsewhere are stale."""
        if self.transport.kept_pages is not None:
            for seg in block.weight_segments:
                self.transport.kept_pages.changed(seg)  # ([Note: pages kept on helpers] in engine/helper_pages.py)

    def wait(self, block) -> None:
        """FETCHING -> RESIDENT: compute is ordered after the block's fetch;
        from here on its device bytes may be read on the compute stream."""
        if block.fetch_event is not None:
            with _record_range("wait", block.name):
                if self.transport.is_cuda:
                    arrive = self.transport.record_compute()
                    self.meter.stalled(block, arrive, block.fetch_event)
                    block.owner.tracer.span("wait", block.name, arrive, block.fetch_event)
                # Compute must not read the block before its fetch has landed.
                self.transport.compute_waits(block.fetch_event)
            block.fetch_event = None
        for seg in block.segments.values():
            if seg.state is PageState.FETCHING:
                seg.state = PageState.RESIDENT

    def evict(self, block) -> bool:
        """What happens when a block leaves: RESIDENT -> WRITING_BACK (dirty
        pages) or HOST (clean ones; the CPU device), memory freed. False if
        its owner keeps it (a view of it kept elsewhere, numpy sharing it)."""
        assert block.pins == 0 and not block.resident_for_life, block
        owner = block.owner
        if not self.transport.can_free(block):
            block.resident_for_life = True
            self.room.not_idle(block)
            owner.warn_once(
                f"numpy:{block.name}",
                "pager: block %r stays on the (CPU) device from now on: `.numpy()` of one "
                "of its tensors shares its memory, which therefore cannot be paged. Use "
                "`tensor.detach().clone().numpy()` for a copy.",
                block.name,
            )
            return False
        if not owner.may_leave(block):
            return False
        with _record_range("evict", block.name):
            for kind in ("weights", "frozen", "state"):
                if kind in block.segments and block.segments[kind].resident:
                    _readopt(block, block.segments[kind])
            owner.pages_leaving(block)
            ready = owner.leave_after(block, self._ready_event(block))
            for seg in block.segments.values():
                if seg.resident:
                    self._leave(block, seg, ready, owner.page_leaving(block, seg, ready, seg.is_dirty()))
        block.fetch_event = None
        self.room.not_idle(block)
        self.resident.pop(block, None)
        self.departures += 1
        self._moved()
        block.stats.evictions += 1
        owner.counters.evictions += 1
        owner.left(block)
        return True

    def write_back(self, block, kinds):
        """Copy `block`'s changed pages of `kinds` down now; they stay on the
        device, clean. Returns the last copy's end (CUDA event) or None."""
        ready, end = self.transport.mark_compute(), None  # (the copies read what compute wrote)
        for seg in (block.segments[k] for k in kinds if k in block.segments):
            if seg.resident and seg.is_dirty():
                start, end = self.host.down(block, seg, after=(ready,))
                self.meter.copied(block, "d2h", start, end, seg.nbytes)
                seg.snapshot_versions()
        return end if self.transport.is_cuda else None

    def drop(self, block, seg: Segment) -> None:
        """RESIDENT -> HOST for one segment whose bytes nobody wants (its
        gradients were set to None): memory freed, nothing written back, its
        page marked empty. The block stays (its other pages)."""
        assert seg.kind == "grads" and seg.resident and block.pins == block.resident_for_life, (block, seg.kind)
        seg.host_valid = False
        self._leave(block, seg, self._ready_event(block), write=False)
        self._moved()

    def _ready_event(self, block):
        # [Note: the last use, or a fresh event]
        # The write-back and the reuse of the memory are ordered after the
        # block's last use. If its tensors changed after that release (the
        # user's zero_grad(set_to_none=False), clip_grad_norm_, gathered
        # gradients: version counters tell), they are ordered after
        # everything enqueued on the compute stream so far instead. Always
        # taking a fresh event would be safe too, but it serialises each
        # prefetch behind current compute (measured: NAS step 1.20x -> 1.35x).
        if block.last_use_event is None or block.versions() != block.release_versions:
            return self.transport.mark_compute()
        return block.last_use_event

    def _leave(self, block, seg: Segment, ready, write: bool) -> None:
        writeback = None
        if write:
            start, end = self.host.down(block, seg, after=(ready,))
            writeback = end if self.transport.is_cuda else None
            seg.writeback_event = writeback
            seg.host_valid = True
            self.meter.copied(block, "d2h", start, end, seg.nbytes)
            block.owner.tracer.span("writeback", block.name, start, end, seg.nbytes)
        # (block.fetch_event: a fetch compute never waited on may still be
        # decoding into this memory; see [Note: staging and decoding compressed pages].)
        self.transport.free(seg.flat, after=(ready, writeback, block.fetch_event))
        seg.state = PageState.WRITING_BACK if writeback is not None else PageState.HOST
        self._count_resident(block, -seg.nbytes)

    def _allocate(self, block, seg: Segment) -> None:
        """Device memory for `seg`; on out-of-memory, evict what can go and retry once."""
        try:
            self.transport.allocate(seg.flat, seg.nbytes)
            return
        except torch.cuda.OutOfMemoryError:
            pass
        for other in self.room.idle_blocks(protect=(block,)):
            self.evict(other)
        if self.transport.is_cuda:
            torch.cuda.synchronize(self.device)  # error path: let freed memory settle
            torch.cuda.empty_cache()
        try:
            self.transport.allocate(seg.flat, seg.nbytes)
            log.warning("pager: out of device memory fetching %r; evicted idle blocks and retried", block.name)
        except torch.cuda.OutOfMemoryError:
            raise _out_of_memory(self, block, seg) from None

    def _moved(self) -> None:
        for owner in self.owners:
            owner.blocks_moved()

    def set_budget(self, nbytes: int) -> None:
        """Blocks leave until `nbytes` holds them; then it is the budget.
        Raises (the budget unchanged) if blocks in use hold more."""
        for block in self.room.idle_blocks():
            if self.resident_bytes <= nbytes:
                break
            self.evict(block)
        if self.resident_bytes > nbytes:
            self.waiters.room_may_be_back()
            raise ValueError(
                f"pager: cannot lower the budget to {format_bytes(nbytes)} now: blocks in use hold "
                f"{format_bytes(self.resident_bytes)}; call set_budget between steps."
            )
        self.budget_bytes = nbytes
        for owner in self.owners:
            owner.counters.budget_bytes = nbytes
        self.waiters.room_may_be_back()

    # ---------------------------------------------------------- owners
    def join(self, owner) -> None:
        """`owner` (a new Pager) shares this engine from now on."""
        self.owners.append(owner)

    def leave(self, owner) -> None:
        """Forget `owner` (unwrapped): free its device memory and its pages.
        Its tensors must hold their own copies by now."""
        self.meter.resolve()
        for block in [b for b in self.resident if b.owner is owner]:
            self.room.not_idle(block)
            for seg in block.segments.values():
                if seg.resident and seg.flat.untyped_storage().resizable():  # (numpy may still share it)
                    self.transport.free(seg.flat)
                    self._count_resident(block, -seg.nbytes)
            self.resident.pop(block)
        self.departures += 1
        for block in owner.all_blocks():
            for seg in block.segments.values():
                seg.state = PageState.HOST
                if self.transport.kept_pages is not None:
                    self.transport.kept_pages.drop(seg)
        self.resident_bytes -= owner.resident_bytes  # what numpy still shares is the user's now
        self.total_bytes -= owner.total_bytes
        owner.resident_bytes = owner.total_bytes = 0
        self.host.release(owner)
        if owner in self.owners:
            self.owners.remove(owner)
        if not any(seg.encoded is not None for o in self.owners for b in o.all_blocks() for seg in b.segments.values()):
            self.transport.release_staging()  # no page left to stage
        if not self.owners:
            self.transport.release_host_pool()  # no model left to copy activations out
        self.room.forget(owner)
        self.waiters.room_may_be_back()


def _readopt(block, seg: Segment) -> None:
    """Tensors given new memory by `t.data = new` since their fetch: copy
    the new value into the page and make them views of it again (else the
    page would keep the old bytes)."""
    key = seg.storage_key
    with torch._C.DisableTorchFunctionSubclass():  # (the common case, once for the segment: at every eviction)
        for t in seg.tensors:
            if t.untyped_storage()._cdata != key:
                break
        else:
            return
    for slot, t in zip(seg.slots, seg.tensors):
        if storage_key(t) == key:
            continue
        with torch._C.DisableTorchFunctionSubclass():
            if t.shape != slot.shape or t.dtype != slot.dtype:
                raise RuntimeError(
                    f"pager: {slot.name!r} (block {block.name!r}) was given data of shape {tuple(t.shape)} "
                    f"and dtype {t.dtype} through `.data =` after wrap; its page holds {tuple(slot.shape)} "
                    f"{slot.dtype}. Change shapes before wrapping: pager.unwrap(model), change, wrap again."
                )
            view = slot.view_of(seg.flat)
            view.copy_(t.detach())
            t.data = view
        seg.force_dirty = True


def _out_of_memory(engine: Engine, block, seg: Segment) -> BudgetError:
    from ..base.budget import device_memory

    free, total = device_memory(engine.device)
    return BudgetError(
        f"pager: out of device memory fetching {block.name!r} ({seg.kind}, {format_bytes(seg.nbytes)}), "
        f"even after evicting every idle block: budget {format_bytes(engine.budget_bytes)}, pager holds "
        f"{format_bytes(engine.resident_bytes)}, the device has {format_bytes(free)} free of "
        f"{format_bytes(total)}. Other allocations (activations, other models) take the rest: lower "
        f"the budget (pager.of(model).set_budget(...)), use a smaller batch, or free device memory."
    )
