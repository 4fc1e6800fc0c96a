"""Activations sent to host memory and brought back for the backward (`activations="offload"`).

[Note: activations off the device]
With `activations="offload"`, each activation a training forward saves (a
dense tensor on the device of at least `OFFLOAD_MIN_BYTES`: contiguous, or a
permutation of its storage's bytes, as attention's transposed q, k and v,
which go and come back with their strides, each copy one run of bytes; not a
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
not brought ahead is brought when autograd asks for it. One whose device
memory is still held for its copy out (the forward's last sends, when the
backward begins before the link has carried them) is not copied back: the
backward uses the device tensor itself, unchanged since it was saved (its
version), compute first waiting for the copy out to have read it, as for
any memory it frees ("reused": no copy in, and one block's activations held
once, not twice, where the forward meets the backward). A copy on the host is
the value as it was saved, so an in-place change after the forward cannot
corrupt the gradient (autograd would refuse it; here it is simply not seen).
A tensor that a block's forward saves several times (a norm's output saved
by the q, k and v projections) is copied out once and brought back once; its
device copy stays while later saves' unpacks are still to ask for it.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque

import torch

from ..base.registry import unguarded
from .dry_run import _dense
from .ledger import tensor_bytes
from .saved_bytes import (
    BRING_AHEAD_BLOCKS,  # at a block's backward, the activations of this many blocks before it come back too
    IN_FLIGHT_MIN_BYTES,  # device bytes being copied out before compute waits for the oldest
)

OFFLOAD_MIN_BYTES = 1 << 20  # smaller activations stay: a copy costs more than it frees
KEEP_LAST_BLOCKS = 1  # the last blocks of a forward keep their activations on the device


class Sent:
    """An activation on the host, as the graph holds it (see the Note); one
    for every save of the same tensor in a block's forward."""

    __slots__ = (
        "offload",
        "host",
        "written_event",
        "device",
        "ready_event",
        "saves",
        "left",
        "handed",
        "outgoing",
        "reused",
        "__weakref__",
    )

    def __init__(self, offload, host, written_event):
        self.offload, self.host, self.written_event = offload, host, written_event
        self.device = None  # brought back ahead of the backward, not yet asked for
        self.ready_event = None  # `device` holds the bytes (h2d), or its copy out has read them (`reused`)
        self.outgoing = None  # the device tensor's `_Outgoing` while it is held for its copy out
        self.reused = False  # `device` is the forward's own tensor, not a copy
        self.saves = self.left = 1  # saves that hold it; of those, unpacks still to come in this backward
        self.handed = None  # the device copy given to autograd, while other saves will ask for it

    def unpack(self):
        return self.offload.bring(self)

    def __del__(self):
        transport = self.offload.transport
        if self.device is not None:  # brought, never asked for (the graph went): may still be landing
            (transport.forget_sent if self.reused else transport.forget_brought)(self.device)
            self.offload.ledger.sub(tensor_bytes(self.device))
        elif self.handed is not None:
            self.offload.ledger.sub(tensor_bytes(self.handed))
        transport.give_host(self.host)  # (no view of it is left; a copy in still reading it is waited for: the Note)


class _Outgoing:
    """A device tensor held until its copy out (`event`) has read it."""

    __slots__ = ("tensor", "event", "nbytes", "version", "sent")

    def __init__(self, tensor, event, nbytes: int, sent):
        self.tensor, self.event, self.nbytes = tensor, event, nbytes
        self.version = tensor._version  # (reused only unchanged since it was saved)
        self.sent = weakref.ref(sent)


class ActivationOffload:
    """Sends the activations that forwards save to pinned host memory and
    brings them back for the backward ([Note: activations off the device]).

    Args:
        transport: the pager's transport (its streams and copies).
        stats: the pager's `Stats` (activations_* counters).
        ledger: the `Ledger` of device bytes (being copied out, brought back).
        min_bytes: activations smaller than this stay on the device.
        keep_last: the last blocks of a forward (in the previous forward's
            order) whose activations stay on the device.
    """

    def __init__(self, transport, stats, ledger, min_bytes: int = OFFLOAD_MIN_BYTES, keep_last: int = KEEP_LAST_BLOCKS):
        self.transport = transport
        self.stats = stats
        self.ledger = ledger
        self.min_bytes = min_bytes
        self.keep_last = keep_last
        self.views = True  # saved views that are not contiguous but dense leave too ("auto" may keep them)
        self.bring_ahead = BRING_AHEAD_BLOCKS
        self._order: list = []  # blocks in the order this forward reached them
        self.order: list = []  # ... the last forward did
        self._stay: set = set()  # blocks whose activations stay (the last ones of the previous forward)
        self._lock = threading.Lock()  # unpack runs on autograd's threads
        self._groups: list = []  # [block, [weakref to Sent], bytes] per forward of a block, in forward order
        self._forward_block = None  # the block whose forward ran last: what is saved now belongs to it
        self._by_view: dict = {}  # what the last group sent, by view (`_sent_already`)
        # Device tensors being copied out, oldest first (`_Outgoing`);
        # their bytes are the ledger's `flight`, their cap its `flight_cap`.
        self._in_flight: deque = deque()

    def forward_reaches(self, block) -> None:
        """The forward enters `block` (None: a new forward, before its first block)."""
        if block is None:
            # The last blocks' activations are the backward's first need:
            # sending them out and straight back would only cost link time.
            self.order = self._order or self.order
            self._stay = set(self.order[-self.keep_last :]) if self.keep_last else set()
            self._order = []
            self.ledger.sending = True
        elif not self._order or self._order[-1] is not block:
            self._order.append(block)
        self._forward_block = block

    def stays(self, block) -> bool:
        """Whether `block`'s activations stay on the device (one of the last of a forward)."""
        return block in self._stay

    def wants(self, t) -> bool:
        return (
            self._forward_block not in self._stay
            and t.device == self.transport.device
            and t.layout == torch.strided
            and (t.is_contiguous() or self.views and _dense(t))
            and tensor_bytes(t) >= self.min_bytes
        )

    def send(self, t) -> Sent:
        again = self._sent_already(t)
        if again is not None:
            return again
        with unguarded():
            host, written = self.transport.send_to_host(t)
        sent = Sent(self, host, written)
        nbytes = tensor_bytes(host)
        with self._lock:
            block = self._forward_block
            if not self._groups or self._groups[-1][0] is not block:
                self._prune()
                self._groups.append([block, [], 0])
                self._by_view.clear()
            self._by_view[_view_key(t)] = (weakref.ref(t.untyped_storage()), t._version, weakref.ref(sent))
            group = self._groups[-1]
            group[1].append(weakref.ref(sent))
            group[2] += nbytes
            self.stats.activations_sent_bytes += nbytes
            if written is not None:  # (else the copy is done: nothing in flight, no cap to count)
                # The cap grows to the largest block's activations.
                self.ledger.flight_cap = max(IN_FLIGHT_MIN_BYTES, self.ledger.flight_cap, group[2])
                # Its memory, not its graph: a graph node's hooks hold the pager,
                # which holds this queue (a cycle through C++ that gc cannot break).
                with unguarded():
                    sent.outgoing = _Outgoing(t.detach(), written, nbytes, sent)
                self._in_flight.append(sent.outgoing)
                self.ledger.add(nbytes, flight=nbytes)
            self._settle()
        return sent

    def _sent_already(self, t):
        """The `Sent` of the same view of the same storage, unchanged, saved
        before in this block's forward (a norm's output saved by q, k and v):
        it is copied once and brought back once for all of its saves."""
        with self._lock:
            if not self._groups or self._groups[-1][0] is not self._forward_block:
                return None
            entry = self._by_view.get(_view_key(t))
            # The storage object itself (not its address, which a new tensor may reuse) and its version.
            sent = (
                entry[2]()
                if entry is not None and entry[0]() is t.untyped_storage() and entry[1] == t._version
                else None
            )
            if sent is not None:
                sent.saves += 1
                sent.left += 1
            return sent

    def _settle(self, cap: int | None = None) -> None:
        """Let go of device tensors whose copy out is done; past `cap` (the
        in-flight cap by default), of the oldest ones anyway, compute first
        waiting for their copy (so that the memory may be reused at once: see
        [Note: activations off the device])."""
        q, ledger = self._in_flight, self.ledger
        while q and q[0].event.query():
            self._let_go(q.popleft())
        cap = max(IN_FLIGHT_MIN_BYTES, ledger.flight_cap) if cap is None else cap
        while ledger.flight > cap:
            out = q.popleft()
            # Compute reuses this memory only after the copy out has read it.
            self.transport.compute_waits(out.event)
            self._let_go(out)

    def _let_go(self, out: _Outgoing) -> None:
        self.ledger.sub(out.nbytes, flight=out.nbytes)
        sent = out.sent()
        if sent is not None:
            sent.outgoing = None

    def pass_ends(self) -> None:
        """The backward ended: every copy out was ordered before it; compute
        waits for those still under way, and their device memory is let go."""
        with self._lock:
            self._settle(cap=0)

    def bring(self, sent: Sent) -> torch.Tensor:
        with self._lock:
            device = sent.handed
            if device is None:
                if sent.device is None:
                    self._start_bringing(sent)
                elif not sent.reused:
                    self.stats.activations_ahead_bytes += tensor_bytes(sent.host)
                device, event = sent.device, sent.ready_event
                sent.device = sent.ready_event = None  # the backward holds it now; freed after its use
                # Brought: the bytes must have landed (a later save's unpack
                # gets it after this wait). Reused: compute frees it after its
                # use, and reuses the memory only after the copy out has read it.
                self.transport.compute_waits(event)
            sent.left -= 1
            sent.handed = device if sent.left > 0 else None  # kept for the saves still to ask
            if sent.left <= 0:
                sent.left = sent.saves  # (a retained graph's next backward asks again)
                self.ledger.sub(tensor_bytes(device))
        assert device is not None  # (handed, or just brought)
        return device

    def backward_reaches(self, block) -> None:
        """`block`'s backward is about to run: bring its activations and the
        previous block's (next backward) ahead of autograd's asking."""
        with self._lock:
            self.ledger.sending = False  # (the forward is over: the queue only drains)
            i = next((i for i in range(len(self._groups) - 1, -1, -1) if self._groups[i][0] is block), None)
            if i is None:
                self._settle()
                return
            coming = [
                sent
                for _block, refs, _nbytes_ in self._groups[max(i - self.bring_ahead, 0) : i + 1]
                for sent in (ref() for ref in refs)
                if sent is not None and sent.device is None and sent.handed is None
            ]
            for sent in coming:  # (before `_settle` lets them go: used where they are)
                if sent.outgoing is not None:
                    self._start_bringing(sent)
            self._settle()
            for sent in coming:
                if sent.device is None:
                    self._start_bringing(sent)
            # Done with; so is the one before, if it is of ops before the first block.
            del self._groups[i - 1 if i and self._groups[i - 1][0] is None else i : i + 1]

    def _start_bringing(self, sent: Sent) -> None:
        """`sent` to the device: the forward's own tensor if it is still there
        for its copy out and unchanged (see the Note), else a copy in."""
        out = sent.outgoing
        if out is not None and out.tensor._version == out.version:
            self._in_flight.remove(out)
            sent.outgoing = None
            sent.device, sent.ready_event, sent.reused = out.tensor, out.event, True
            self.ledger.sub(0, flight=out.nbytes)  # (no longer counted as copied out: held for the backward)
            self.stats.activations_reused_bytes += out.nbytes
            return
        sent.device, sent.ready_event = self.transport.bring_to_device(sent.host, sent.written_event)
        sent.reused = False
        self.stats.activations_brought_bytes += tensor_bytes(sent.host)
        self.ledger.add(tensor_bytes(sent.host))

    def _prune(self) -> None:
        """Forget forwards whose graph is gone (no backward came)."""
        self._groups = [g for g in self._groups if any(r() is not None for r in g[1])]


def _view_key(t) -> tuple:
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype
