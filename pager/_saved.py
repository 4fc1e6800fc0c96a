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
With `activations="offload"`, each activation a block's forward saves (a
contiguous tensor on the device of at least `OFFLOAD_MIN_BYTES`; not the
block's own weights, which page with the block) is copied to pinned host
memory on the d2h stream as soon as compute has written it, and its device
memory goes back to the allocator once that copy has read it (record_stream:
these tensors belong to the compute stream's pool, unlike blocks' storage).
The graph holds a `Sent` instead. When the backward reaches a block (its
pre-backward hook), the activations of that block and of the block before it
(the next one backward) are copied back on the h2d stream, so the copy of one
overlaps the backward of the other; an activation that was not brought ahead
is brought when autograd asks for it. A copy on the host is the value as it
was saved, so an in-place change after the forward cannot corrupt the
gradient (autograd would refuse it; here it is simply not seen).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch

from ._paged import entry_of, unguarded

OFFLOAD_MIN_BYTES = 1 << 20  # smaller activations stay: a copy costs more than it frees


class _Frame:
    """One `begin_saving` in a thread: whether it pushed the hooks, and what
    its pack does with activations."""

    __slots__ = ("pushed", "offload", "block", "below")

    def __init__(self, pushed, offload, block, below):
        self.pushed, self.offload, self.block, self.below = pushed, offload, block, below


_tls = threading.local()


def begin_saving(count: bool, offload=None, block=None) -> None:
    """In this thread, until the matching `end_saving`, run what autograd
    saves through pager's hooks if `count` (saved views of blocks' storage
    are counted) or `offload` (an `ActivationOffload`: `block`'s activations
    leave the device), unless other saved-tensor hooks are on top (see the
    Notes). Called for every use, so that each `end_` pairs with its `begin_`."""
    pushed = False
    if (count or offload is not None) and _no_other_hooks():
        torch._C._autograd._push_saved_tensors_default_hooks(_pack, _unpack)
        pushed = True
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    active = getattr(_tls, "active", None)
    frame = _Frame(pushed, offload, block, active)
    if pushed:
        _tls.active = frame
    stack.append(frame)


def end_saving() -> bool:
    """Close the matching `begin_saving`; True if the hooks were on."""
    frame = _tls.stack.pop()
    if frame.pushed:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        _tls.active = frame.below
    return frame.pushed


@contextmanager
def saving(count: bool):
    begin_saving(count)
    try:
        yield
    finally:
        end_saving()


def _no_other_hooks() -> bool:
    hooks = torch._C._autograd
    top = getattr(hooks, "_top_saved_tensors_default_hooks", None)
    if top is None or not hooks._saved_tensors_hooks_is_enabled():
        return False
    try:
        return top(True) is None
    except TypeError:  # (no `ignore_is_tracing` argument in some versions)
        return top() is None


def _pack(t):
    frame = _tls.active
    entry = entry_of(t)
    if entry is None and frame.offload is not None and frame.offload.wants(t):
        return frame.offload.send(t, frame.block)
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


class ActivationOffload:
    """Sends the activations blocks' forwards save to pinned host memory and
    brings them back for their backward ([Note: activations off the device]).

    Args:
        transport: the pager's transport (its streams and copies).
        stats: the pager's `Stats` (activations_* counters).
        min_bytes: activations smaller than this stay on the device.
    """

    def __init__(self, transport, stats, min_bytes: int = OFFLOAD_MIN_BYTES):
        self.transport = transport
        self.stats = stats
        self.min_bytes = min_bytes
        self._lock = threading.Lock()  # unpack runs on autograd's threads
        self._groups: list = []  # [block, [weakref to Sent]] per forward of a block, in forward order

    def wants(self, t) -> bool:
        return (t.device == self.transport.device and t.layout == torch.strided and t.is_contiguous()
                and _nbytes(t) >= self.min_bytes)

    def send(self, t, block) -> Sent:
        with unguarded():
            host, written = self.transport.send_to_host(t)
        sent = Sent(self, host, written)
        with self._lock:
            if not self._groups or self._groups[-1][0] is not block:
                self._prune()
                self._groups.append((block, []))
            self._groups[-1][1].append(weakref.ref(sent))
            self.stats.activations_sent_bytes += _nbytes(host)
        return sent

    def bring(self, sent: Sent) -> torch.Tensor:
        with self._lock:
            if sent.device is None:
                self._start_bringing(sent)
            else:
                self.stats.activations_ahead_bytes += _nbytes(sent.host)
            device, event = sent.device, sent.ready_event
            sent.device = sent.ready_event = None  # the backward holds it now; freed after its use
        self.transport.compute_waits(event)
        return device

    def backward_reaches(self, block) -> None:
        """`block`'s backward is about to run: bring its activations and the
        previous block's (next backward) ahead of autograd's asking."""
        with self._lock:
            i = next((i for i in range(len(self._groups) - 1, -1, -1) if self._groups[i][0] is block), None)
            if i is None:
                return
            for _block, refs in self._groups[max(i - 1, 0): i + 1]:
                for ref in refs:
                    sent = ref()
                    if sent is not None and sent.device is None:
                        self._start_bringing(sent)
            del self._groups[i]

    def _start_bringing(self, sent: Sent) -> None:
        sent.device, sent.ready_event = self.transport.bring_to_device(sent.host, sent.written_event)
        self.stats.activations_brought_bytes += _nbytes(sent.host)

    def _prune(self) -> None:
        """Forget forwards whose graph is gone (no backward came)."""
        self._groups = [(b, refs) for b, refs in self._groups if any(r() is not None for r in refs)]


def _nbytes(t) -> int:
    return t.numel() * t.element_size()
