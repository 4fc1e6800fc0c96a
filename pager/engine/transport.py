"""Copies between host pages and device storage, and the ordering between them.

`CudaTransport` runs copies on side streams and orders them with events;
`CpuTransport` stands for a device with a separate host copy: copies are
synchronous and events are `None`, so the paging logic above it is the same.

[Note: events, not record_stream]
Device storage of a block is allocated on the h2d stream, used on the compute
stream, and freed from the host. The caching allocator hands a freed block only
to later allocations on the stream that allocated it (here: the h2d stream), so
freeing is safe once the h2d stream is ordered after every use of the memory:
before a free, the h2d stream waits on a compute event recorded at eviction
time and on the block's write-back event (d2h). `record_stream` would do the same bookkeeping
inside the allocator, but its frees happen late and nondeterministically (at
the next allocation after the event completes), which makes the budget a guess.

[Note: staging and decoding compressed pages]
A compressed page ([Note: compressed pages] in codec/compress.py) is fetched piece
by piece: each piece is copied on the h2d stream into one slot of a small ring
of device buffers (the staging ring, `STAGING_SLOTS` of the largest piece,
taken from the budget), then decoded from there into the block's storage by a
kernel on the decode stream, which has a high priority so that its short
kernels do not queue behind compute. The copy engine runs on while pieces are
decoded: a slot is overwritten only after the decode that read it (its event).
The fetch ends on the decode stream (`mark_h2d(decoded=True)`), so compute waits for the
last decode, and a block evicted before compute waited on its fetch is freed
only after the h2d stream waited on it too (the decode stream writes memory
that the h2d stream hands out).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import torch

from ..codec.compress import decode
from ..codec.kernels import decode_on_device
from .helper_pages import HelperPages
from .host import PinnedPool
from .split_fetch import SplitFetch

STAGING_SLOTS = 3  # copies of pieces in flight while earlier ones decode


def event_method(name: str) -> Callable[..., Any]:
    """torch.cuda.Event's C method `name`, unbound, to call directly: its
    Python `__new__`, `record`, `wait` and `query` (and Stream.wait_event's,
    which calls `wait`) add a frame each, at every fetch, wait and release
    of a block (2.5 events a streamed use). In a build of torch without
    CUDA, which has none, one that says so (no CudaTransport is made there)."""
    return getattr(torch._C._CudaEventBase, name, None) or _no_cuda_events


def _no_cuda_events(*args, **kwargs):
    raise RuntimeError("pager: CUDA events need a build of torch with CUDA")


_new_event = torch._C._CudaEventBase.__new__  # (with torch.cuda.Event as the class: what callers read)
_record_event = event_method("record")
_wait_event = event_method("wait")  # (event, stream): later work on `stream` waits for `event`


class CpuTransport:
    """Synchronous copies; the 'device' is separate host memory."""

    is_cuda = False
    split = None  # (no other GPUs' links: [Note: split fetch] in engine/split_fetch.py)

    def __init__(self, device: torch.device):
        self.device = device

    def allocate(self, flat: torch.Tensor, nbytes: int) -> None:
        flat.untyped_storage().resize_(nbytes)

    def free(self, flat: torch.Tensor, after=()) -> None:
        flat.untyped_storage().resize_(0)

    def can_free(self, block) -> bool:
        """False once `numpy()` of one of the block's tensors shared its memory
        (torch then forbids resizing the storage): it must stay."""
        return all(seg.flat.untyped_storage().resizable() for seg in block.segments.values() if seg.resident)

    kept_pages = None  # (no other GPUs' memory either)
    helper_link_bytes = helper_memory_bytes = 0

    def h2d(self, device_flat: torch.Tensor, host: torch.Tensor, after=(), seg=None):
        t0 = time.perf_counter()
        device_flat.copy_(host)
        return t0, time.perf_counter()

    def h2d_encoded(self, device_flat: torch.Tensor, page: torch.Tensor, encoded, after=()):
        """Decode compressed `page` (laid out by `encoded`) into `device_flat`."""
        t0 = time.perf_counter()
        decode(page, encoded, device_flat)
        return t0, time.perf_counter()

    staging_bytes = 0  # decoded straight from the page: nothing staged

    def ensure_staging(self, nbytes: int) -> None:
        pass

    def release_staging(self) -> None:
        pass

    def d2h(self, host: torch.Tensor, device_flat: torch.Tensor, after=()):
        t0 = time.perf_counter()
        host.copy_(device_flat)
        return t0, time.perf_counter()

    def send_to_host(self, t: torch.Tensor, host: torch.Tensor | None = None):
        """A host copy of `t` (an activation; see training/offload.py; into `host` if
        given) and an event after it."""
        return (t.detach().clone() if host is None else host.copy_(t)), None

    def bring_to_device(self, host: torch.Tensor, written=None):
        """A device copy of `host` and an event after it."""
        return host.clone(), None

    def give_host(self, host: torch.Tensor) -> None:
        pass  # (a clone of its own: freed with it)

    def release_host_pool(self) -> None:
        pass

    def forget_brought(self, device_t: torch.Tensor) -> None:
        pass

    def forget_sent(self, device_t: torch.Tensor) -> None:
        pass

    def side(self, fn, after=()):
        """Run `fn` (device work) off the compute stream; here: now."""
        return fn(), None

    def record_compute(self):
        return None

    def mark_compute(self):
        return None

    def mark_h2d(self, decoded: bool = False, last_copy=None):
        return None

    def compute_waits(self, event) -> None:
        pass

    def new_flat(self, nbytes: int) -> torch.Tensor:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        flat.untyped_storage().resize_(0)
        return flat


class CudaTransport:
    """Side streams for each direction; ordering by events, never by the host."""

    is_cuda = True

    def __init__(self, device: torch.device, helpers=()):
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        # Other GPUs whose links carry shares of each fetch ([Note: split fetch] in engine/split_fetch.py),
        # and whose memory keeps pages up to their budgets ([Note: pages kept on helpers] in engine/helper_pages.py).
        helpers = list(helpers)  # (GPU, bytes it may hold)
        own = torch.device("cuda", self.index)
        self.split = SplitFetch(own, [h for h, _b in helpers], _Current) if helpers else None
        keeps = self.split is not None and any(b > self.split.staging_bytes for _h, b in helpers)
        self.kept_pages = HelperPages(self.split, [b for _h, b in helpers]) if keeps else None
        self.helper_link_bytes = self.helper_memory_bytes = 0  # of the last plain copy up, what helpers carried
        self._split_unjoined = None  # the end of the last split copy, until a fetch's mark covers it
        self.h2d_stream = torch.cuda.Stream(device)
        self.d2h_stream = torch.cuda.Stream(device)
        self.decode_stream = torch.cuda.Stream(device, priority=-1)  # see [Note: staging and decoding ...]
        self._streams: dict = {}  # stream id -> Stream, for `compute_stream`
        self._staging: list = []  # the ring of slots, each `staging_slot_bytes`
        self._staging_events: list = []  # per slot: (its copy landed, its decode read it), re-recorded
        self._staging_used: list = []  # per slot: a piece went through it (its events are recorded)
        self._next_slot = 0
        # fp8 conversion in the decoder needs sm_89 (else the reference decoder runs).
        self.fp8_kernels = torch.cuda.get_device_capability(device) >= (8, 9)
        self.staging_slot_bytes = 0
        self._host_pool: PinnedPool | None = None  # activations' host copies ([Note: activations' host memory])

    def compute_stream(self):
        """The caller's current stream (compute). `torch.cuda.current_stream`
        resolves the device anew on each call (~15 us; a quarter of the host
        time of a forward of many small blocks), so the index is kept here and
        Stream objects reused."""
        stream_id, index, kind = torch._C._cuda_getCurrentStream(self.index)
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = torch.cuda.Stream(
                stream_id=stream_id, device_index=index, device_type=kind
            )
        return stream

    def allocate(self, flat: torch.Tensor, nbytes: int) -> None:
        # Allocate on the h2d stream so the memory belongs to its pool (see Note).
        with self.on(self.h2d_stream):
            flat.untyped_storage().resize_(nbytes)

    def can_free(self, block) -> bool:
        return True  # a CUDA tensor's memory cannot be shared with numpy

    def free(self, flat: torch.Tensor, after=()) -> None:
        # The next allocation on the h2d stream may reuse this memory at once:
        # the h2d stream must first be ordered after every reader of it.
        for event in after:
            if event is not None:
                _wait_event(event, self.h2d_stream)
        with self.on(self.h2d_stream):
            flat.untyped_storage().resize_(0)

    def h2d(self, device_flat: torch.Tensor, host: torch.Tensor, after=(), seg=None):
        """Copy `host` up into `device_flat` after the events `after`: the
        (start, end) marks. `seg`: the weights segment whose page it is, which
        a helper may keep (None: a page that is not kept)."""
        for event in after:
            # The destination may still be read by compute (a reused slot).
            if event is not None:
                _wait_event(event, self.h2d_stream)
        self.helper_link_bytes = self.helper_memory_bytes = 0
        with self.on(self.h2d_stream):
            start = self._record(self.h2d_stream, timing=True)
            if self.split is not None and self.split.splits(device_flat.numel()):
                # Over other GPUs too; the end is on the split's join stream.
                self._split_unjoined = self._split_copy(device_flat, host, start, seg)
                return start, self._split_unjoined
            device_flat.copy_(host, non_blocking=True)
            # Timed: the pager measures the copy and how long compute waited for it.
            return start, self._record(self.h2d_stream, timing=True)

    def _split_copy(self, device_flat, host, start, seg):
        """From the helper that keeps the page, else in shares over every
        link (then kept, where this is its place); the end."""
        kept_pages = self.kept_pages if seg is not None else None
        kept = kept_pages.find(seg) if kept_pages is not None else None
        if kept is not None and kept_pages is not None:
            self.helper_memory_bytes = device_flat.numel()
            return kept_pages.copy_up(kept, device_flat, start)
        split = cast(SplitFetch, self.split)  # (called only with a split)
        self.helper_link_bytes = split.helper_bytes(device_flat.numel())
        end = split.copy(device_flat, host, self.h2d_stream, start)
        return kept_pages.landed(seg, device_flat, end) if kept_pages is not None else end

    def h2d_encoded(self, device_flat: torch.Tensor, page: torch.Tensor, encoded, after=()):
        """Copy compressed `page` up piece by piece and decode each into
        `device_flat` (see [Note: staging and decoding compressed pages])."""
        h2d, decoder = self.h2d_stream, self.decode_stream
        for event in after:
            # The destination may still be read by compute (a reused slot).
            if event is not None:
                h2d.wait_event(event)
        start = self._record(h2d, timing=True)
        with self.on(h2d):
            for piece in encoded.pieces:
                src = page[piece.src : piece.src + piece.src_bytes]
                dst = device_flat[piece.dst : piece.dst + piece.dst_bytes]
                if piece.kind == "raw":
                    dst.copy_(src, non_blocking=True)
                    continue
                i = self._next_slot
                self._next_slot = (i + 1) % STAGING_SLOTS
                landed, read = self._staging_events[i]
                if self._staging_used[i]:
                    # The slot's previous piece must be decoded before it is overwritten.
                    h2d.wait_event(read)
                staged = self._staging[i][: piece.src_bytes]
                staged.copy_(src, non_blocking=True)
                landed.record(h2d)
                # The decoder reads the piece only once its copy has landed.
                decoder.wait_event(landed)
                with self.on(decoder):
                    decode_on_device(staged, piece, dst, self.fp8_kernels)
                    read.record(decoder)
                self._staging_used[i] = True
        # The end: every piece decoded and every raw piece copied.
        decoder.wait_event(self._record(h2d))
        return start, self._record(decoder, timing=True)

    def on(self, stream) -> _Current:
        """`with transport.on(stream):` makes `stream` current (as
        `torch.cuda.stream`, which costs ~15 us a switch: a fetch makes several)."""
        return _Current(stream, self.index)

    @property
    def staging_bytes(self) -> int:
        """Device bytes the staging ring holds (taken from the budget)."""
        return self.staging_slot_bytes * len(self._staging)

    def ensure_staging(self, nbytes: int) -> None:
        """A staging ring whose slots hold pieces of `nbytes` (at wrap)."""
        if nbytes <= self.staging_slot_bytes:
            return
        torch.cuda.synchronize(self.device)  # (wrap time) pieces in flight may still use the old ring
        with self.on(self.h2d_stream):
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(STAGING_SLOTS)]
        self._staging_events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(STAGING_SLOTS)]
        self._staging_used = [False] * STAGING_SLOTS
        self.staging_slot_bytes = nbytes

    def release_staging(self) -> None:
        """Free the ring (no model on the engine has compressed pages now)."""
        if not self._staging:
            return
        torch.cuda.synchronize(self.device)  # pieces in flight may still use it
        self._staging, self._staging_events, self._staging_used, self.staging_slot_bytes = [], [], [], 0

    def d2h(self, host: torch.Tensor, device_flat: torch.Tensor, after=()):
        for event in after:
            # The bytes to write back are final only once compute is done with them.
            if event is not None:
                self.d2h_stream.wait_event(event)
        with self.on(self.d2h_stream):
            start = self._record(self.d2h_stream, timing=True)
            host.copy_(device_flat, non_blocking=True)
            return start, self._record(self.d2h_stream, timing=True)

    def send_to_host(self, t: torch.Tensor, host: torch.Tensor | None = None):
        """Copy activation `t` to pinned host memory (`host`, or one lent by
        the pool until `give_host`) on the d2h stream; the host tensor and
        an event after the copy."""
        if host is None:
            # (its strides: a transposed view's copy is one run of bytes)
            host = self._pool().take(t.shape, t.stride(), t.dtype)
        # `t` is final only once compute has written it.
        self.d2h_stream.wait_event(self._record(self.compute_stream()))
        with self.on(self.d2h_stream):
            host.copy_(t, non_blocking=True)
            # The caller holds `t` until this event (see [Note: activations off the device]).
            return host, self._record(self.d2h_stream)

    def bring_to_device(self, host: torch.Tensor, written=None):
        """Copy `host` (written by the d2h copy `written`) to new device memory
        on the h2d stream; the device tensor and an event after the copy."""
        # (the strides it was saved with; compute's pool: used and freed there)
        device_t = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        # The new memory may have been freed by compute work still in flight.
        self.h2d_stream.wait_event(self._record(self.compute_stream()))
        if written is not None:
            # The host copy is complete only once the d2h copy has landed.
            self.h2d_stream.wait_event(written)
        with self.on(self.h2d_stream):
            device_t.copy_(host, non_blocking=True)
            # Used, compute waits for this event first; dropped unused: `forget_brought`.
            return device_t, self._record(self.h2d_stream)

    def give_host(self, host: torch.Tensor) -> None:
        """`host` (lent by `send_to_host`) is no longer used: its memory goes
        back to the pool."""
        if self._host_pool is not None:
            self._host_pool.give(host)

    def release_host_pool(self) -> None:
        """Unpin the pool's memory (no model on the engine now)."""
        if self._host_pool is not None:
            self._host_pool.close()
            self._host_pool = None

    def _pool(self) -> PinnedPool:
        if self._host_pool is None:
            self._host_pool = PinnedPool(self._pool_reads, self._after_pool_reads)
        return self._host_pool

    def _pool_reads(self):
        # (a chunk's pieces all came back: every copy in that reads them,
        # `bring_to_device` on the h2d stream, was queued before)
        return self._record(self.h2d_stream)

    def _after_pool_reads(self, reads) -> None:
        # Copies in may still be reading the pieces the chunk lent before:
        # the copies out into it come after them (not after the fetches queued since).
        self.d2h_stream.wait_event(reads)

    def forget_brought(self, device_t: torch.Tensor) -> None:
        """`device_t` (from `bring_to_device`) is dropped unused: its memory
        must not be reused before the copy into it is done."""
        device_t.record_stream(self.h2d_stream)

    def forget_sent(self, device_t: torch.Tensor) -> None:
        """`device_t` (given to `send_to_host`) is dropped: its memory must not
        be reused before the copy out has read it."""
        device_t.record_stream(self.d2h_stream)

    def side(self, fn, after=()):
        """Run `fn` (small kernels, e.g. norms of gradients about to leave) on
        the d2h stream; returns its result and an event after it."""
        for event in after:
            # fn reads tensors that compute may still be writing.
            if event is not None:
                self.d2h_stream.wait_event(event)
        with self.on(self.d2h_stream):
            return fn(), self._record(self.d2h_stream)

    def record_compute(self):
        """A timing event after the compute enqueued so far (a span's end, a stall's start)."""
        return self._record(self.compute_stream(), timing=True)

    def mark_compute(self):
        """A plain event after the compute enqueued so far, which others only
        wait for (cheaper to make and record than a timing one)."""
        return self._record(self.compute_stream())

    def mark_h2d(self, decoded: bool = False, last_copy=None):
        # Memory allocated on the h2d stream may have been freed by another
        # block whose write-back or last use the h2d stream waited for: compute
        # must wait on this mark before touching it, even when nothing was copied.
        # The end of the fetch's last plain copy is such a mark: those waits
        # were enqueued before the fetch, and nothing after the copy.
        unjoined, self._split_unjoined = self._split_unjoined, None
        if last_copy is not None and not decoded and (unjoined is None or last_copy is unjoined):
            return last_copy  # (a split copy's end comes after every copy before it)
        mark = self._record(self.h2d_stream, timing=True)
        if decoded:
            # The fetch decoded pages: it ends when the decode stream (after this mark) does.
            self.decode_stream.wait_event(mark)
            mark = self._record(self.decode_stream, timing=True)
        if unjoined is not None:
            # A split copy's shares may land after this mark: the fetch ends when they have.
            mark = self.split.join(mark)
        return mark

    def compute_waits(self, event) -> None:
        # Compute must not read a block before its fetch has landed.
        if event is not None:
            _wait_event(event, self.compute_stream())

    def new_flat(self, nbytes: int) -> torch.Tensor:
        with self.on(self.h2d_stream):
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            flat.untyped_storage().resize_(0)
        return flat

    @staticmethod
    def _record(stream, timing=False):
        event = _new_event(torch.cuda.Event, enable_timing=timing)
        _record_event(event, stream)
        return event


class _Current:
    """Makes a stream current for a `with` block, and the one before it
    current again after (cheaper than `torch.cuda.stream`)."""

    __slots__ = ("stream", "index", "before", "device_before")

    def __init__(self, stream, index: int):
        self.stream, self.index = stream, index

    def __enter__(self):
        self.device_before = torch._C._cuda_getDevice()  # (setting a stream makes its device current)
        self.before = torch._C._cuda_getCurrentStream(self.index)  # (stream id, device index, device type)
        s = self.stream
        torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        return self.stream

    def __exit__(self, *exc):
        stream_id, index, kind = self.before
        torch._C._cuda_setStream(stream_id=stream_id, device_index=index, device_type=kind)
        if self.device_before != index:
            torch._C._cuda_setDevice(self.device_before)
        return False
