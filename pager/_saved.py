"""What a block's forward saves for its backward: counted, kept, or sent to host memory.

A block's forward that builds a graph may run under pager's saved-tensor
hooks (`saving`): autograd hands each tensor it saves to `_pack`, which
decides what the graph holds instead, and `_unpack` gives it back to the
backward.

[Note: autograd's saved views, counted]
With several Python threads the search of every object is out
([Note: views kept from a use] in _paged.py), so what a forward that builds a
graph leaves unaccounted for could be autograd's saved views (expected) or a
view a user keeps somewhere pager cannot look (which must keep the block on
the device). To tell them apart, the forward of a block runs, in the shared
mode, under the hooks, whose pack gives autograd its own detached alias of
each tensor it saves and remembers those on a block's storage (`seg.saved`,
weakly): they are counted, and what remains is the user's. (Packing the
tensor itself would leak: an output saved by its own node would hold itself.)
Autograd checks that a saved tensor was not changed in place only without
hooks, so `_unpack` checks the version itself. Where other hooks are already
on top (torch.utils.checkpoint, save_on_cpu: the user's policy wins), or torch
cannot say (before 2.8), nothing is counted, and the block stays until the
count drops (its backward).

[Note: activations off the device]
With `activations="offload"`, each activation a training forward saves (a
contiguous tensor on the device of at least `OFFLOAD_MIN_BYTES`; not a
block's own weights, which page with the block) is copied to pinned host
memory on the d2h stream as soon as compute has written it. The graph holds
a `Sent` instead; it belongs to the block whose forward ran last (ops between
blocks too: a `tanh` after a block is undone right before that block's
backward). Its device memory is let go once the copy has read it: when its
event is seen complete, or, once more than a block's worth is being copied
out, at once after making compute wait for the copy (compute is the only
stream that allocates from that memory's pool, so reuse is then ordered after
the copy; `record_stream` would hold it until a later allocation happens to
notice, and the allocator reserves more meanwhile). When the backward reaches
a block (its pre-backward hook), the activations of that block and of the
block before it (the next one backward) are copied back on the h2d stream, so
the copy of one overlaps the backward of the other; an activation that was
not brought ahead is brought when autograd asks for it. A copy on the host is
the value as it was saved, so an in-place change after the forward cannot
corrupt the gradient (autograd would refuse it; here it is simply not seen).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from contextlib import contextmanager

import torch

from ._paged import entry_of, unguarded

OFFLOAD_MIN_BYTES = 1 << 20  # smaller activations stay: a copy costs more than it frees
BRING_AHEAD_BLOCKS = 1  # at a block's backward, the activations of this many blocks before it come back too
KEEP_LAST_BLOCKS = 1  # the last blocks of a forward keep their activations on the device
IN_FLIGHT_MIN_BYTES = 64 << 20  # device bytes being copied out before compute waits for the oldest


class _Frame:
    """One `begin_saving` in a thread: whether it pushed the hooks, whose
    hooks are on top while it lasts, and what pack does with activations."""

    __slots__ = ("pushed", "hooks", "offload", "below")

    def __init__(self, pushed, hooks, offload, below):
        self.pushed, self.hooks, self.offload, self.below = pushed, hooks, offload, below


_tls = threading.local()


def begin_saving(count: bool, offload=None) -> None:
    """In this thread, until the matching `end_saving`, run what autograd
    saves through pager's hooks if `count` (saved views of blocks' storage
    are counted) or `offload` (an `ActivationOffload`: activations leave the
    device), unless other saved-tensor hooks are on top (see the Notes).
    Called for every use, so that each `end_` pairs with its `begin_`."""
    top = _top_hooks()
    active = getattr(_tls, "active", None)
    pushed = bool((count or offload is not None) and top is None)
    if pushed:
        torch._C._autograd._push_saved_tensors_default_hooks(_pack, _unpack)
    if pushed or (top is not None and top is not _UNKNOWN and top[0] is _pack):
        hooks = OURS
    else:
        hooks = OTHERS if top is not None and top is not _UNKNOWN else None
    frame = _Frame(pushed, hooks, offload, active)
    if pushed:
        _tls.active = frame
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(frame)


def end_saving():
    """Close the matching `begin_saving`. Returns which hooks were on: `OURS`
    (autograd's saved views of blocks were counted), `OTHERS` (the user's,
    e.g. checkpointing's recomputation: what they hold is unknown), or None."""
    frame = _tls.stack.pop()
    if frame.pushed:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        _tls.active = frame.below
    return frame.hooks


@contextmanager
def saving(count: bool):
    begin_saving(count)
    try:
        yield
    finally:
        end_saving()


_UNKNOWN = object()
OURS, OTHERS = "ours", "others"


def _top_hooks():
    """The saved-tensor hooks on top in this thread (None: none), or
    `_UNKNOWN` where torch cannot say or hooks are disabled."""
    hooks = torch._C._autograd
    top = getattr(hooks, "_top_saved_tensors_default_hooks", None)
    if top is None or not hooks._saved_tensors_hooks_is_enabled():
        return _UNKNOWN
    try:
        return top(True)
    except TypeError:  # (no `ignore_is_tracing` argument in some versions)
        return top()


def _pack(t):
    frame = _tls.active
    entry = entry_of(t)
    if entry is None and frame.offload is not None and frame.offload.wants(t):
        return frame.offload.send(t)
    with unguarded():
        saved = t.detach()  # shares the version counter
    if entry is not None:
        entry[2].saved.append(weakref.ref(saved))
    return saved, saved._version


def _unpack(packed):
    if isinstance(packed, Sent):
        return packed.offload.bring(packed)
    saved, version = packed
    if saved._version != version:  # autograd checks this itself only without hooks
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{saved.type()} {list(saved.shape)}] is at version {saved._version}; expected "
            f"version {version} instead. (Checked by pager's saved-tensor hooks, as autograd does.)")
    return saved


class Sent:
    """An activation on the host, as the graph holds it (see the Note)."""

    __slots__ = ("offload", "host", "written_event", "device", "ready_event", "__weakref__")

    def __init__(self, offload, host, written_event):
        self.offload, self.host, self.written_event = offload, host, written_event
        self.device = None       # brought back ahead of the backward, not yet asked for
        self.ready_event = None  # on the h2d stream: `device` holds the bytes

    def __del__(self):
        if self.device is not None:  # brought, never asked for (the graph went): may still be landing
            self.offload.transport.forget_brought(self.device)


class ActivationOffload:
    """Sends the activations that forwards save to pinned host memory and
    brings them back for the backward ([Note: activations off the device]).

    Args:
        transport: the pager's transport (its streams and copies).
        stats: the pager's `Stats` (activations_* counters).
        min_bytes: activations smaller than this stay on the device.
        keep_last: the last blocks of a forward (in the previous forward's
            order) whose activations stay on the device.
    """

    def __init__(self, transport, stats, min_bytes: int = OFFLOAD_MIN_BYTES, keep_last: int = KEEP_LAST_BLOCKS):
        self.transport = transport
        self.stats = stats
        self.min_bytes = min_bytes
        self.keep_last = keep_last
        self.bring_ahead = BRING_AHEAD_BLOCKS
        self._order: list = []  # blocks in the order this forward reached them
        self._stay: set = set()  # blocks whose activations stay (the last ones of the previous forward)
        self._lock = threading.Lock()  # unpack runs on autograd's threads
        self._groups: list = []  # [block, [weakref to Sent], bytes] per forward of a block, in forward order
        self._forward_block = None  # the block whose forward ran last: what is saved now belongs to it
        # Device tensors being copied out, oldest first: (tensor, event, bytes).
        self._in_flight: deque = deque()
        self._in_flight_bytes = 0
        self._in_flight_cap = IN_FLIGHT_MIN_BYTES  # grows to the largest block's activations

    def forward_reaches(self, block) -> None:
        """The forward enters `block` (None: a new forward, before its first block)."""
        if block is None:
            # The last blocks' activations are the backward's first need:
            # sending them out and straight back would only cost link time.
            self._stay = set(self._order[-self.keep_last:]) if self.keep_last and self._order else set()
            self._order = []
        elif not self._order or self._order[-1] is not block:
            self._order.append(block)
        self._forward_block = block

    def wants(self, t) -> bool:
        return (self._forward_block not in self._stay and t.device == self.transport.device
                and t.layout == torch.strided and t.is_contiguous() and _nbytes(t) >= self.min_bytes)

    def send(self, t) -> Sent:
        with unguarded():
            host, written = self.transport.send_to_host(t)
        sent = Sent(self, host, written)
        nbytes = _nbytes(host)
        with self._lock:
            block = self._forward_block
            if not self._groups or self._groups[-1][0] is not block:
                self._prune()
                self._groups.append([block, [], 0])
            group = self._groups[-1]
            group[1].append(weakref.ref(sent))
            group[2] += nbytes
            self._in_flight_cap = max(self._in_flight_cap, group[2])
            self.stats.activations_sent_bytes += nbytes
            if written is not None:
                self._in_flight.append((t, written, nbytes))
                self._in_flight_bytes += nbytes
            self._settle()
        return sent

    def _settle(self) -> None:
        """Let go of device tensors whose copy out is done; past the cap, of the
        oldest ones anyway, compute first waiting for their copy (so that the
        memory may be reused at once: see [Note: activations off the device])."""
        q = self._in_flight
        while q and q[0][1].query():
            self._in_flight_bytes -= q.popleft()[2]
        while self._in_flight_bytes > self._in_flight_cap:
            _t, event, nbytes = q.popleft()
            # Compute reuses this memory only after the copy out has read it.
            self.transport.compute_waits(event)
            self._in_flight_bytes -= nbytes

    def bring(self, sent: Sent) -> torch.Tensor:
        with self._lock:
            if sent.device is None:
                self._start_bringing(sent)
            else:
                self.stats.activations_ahead_bytes += _nbytes(sent.host)
            device, event = sent.device, sent.ready_event
            sent.device = sent.ready_event = None  # the backward holds it now; freed after its use
        self.transport.compute_waits(event)  # the bytes must have landed
        return device

    def backward_reaches(self, block) -> None:
        """`block`'s backward is about to run: bring its activations and the
        previous block's (next backward) ahead of autograd's asking."""
        with self._lock:
            self._settle()
            i = next((i for i in range(len(self._groups) - 1, -1, -1) if self._groups[i][0] is block), None)
            if i is None:
                return
            for _block, refs, _nbytes_ in self._groups[max(i - self.bring_ahead, 0): i + 1]:
                for ref in refs:
                    sent = ref()
                    if sent is not None and sent.device is None:
                        self._start_bringing(sent)
            # Done with; so is the one before, if it is of ops before the first block.
            del self._groups[i - 1 if i and self._groups[i - 1][0] is None else i: i + 1]

    def _start_bringing(self, sent: Sent) -> None:
        sent.device, sent.ready_event = self.transport.bring_to_device(sent.host, sent.written_event)
        self.stats.activations_brought_bytes += _nbytes(sent.host)

    def _prune(self) -> None:
        """Forget forwards whose graph is gone (no backward came)."""
        self._groups = [g for g in self._groups if any(r() is not None for r in g[1])]


def _nbytes(t) -> int:
    return t.numel() * t.element_size()
