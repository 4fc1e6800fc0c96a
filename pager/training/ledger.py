"""The device bytes of activations that pager's saved-tensor hooks hold:
`Ledger`, one per `Activations` ([Note: one budget] in training/activations.py)."""

from __future__ import annotations

import threading


class Ledger:
    """Device bytes of activations that pager's saved-tensor hooks hold
    ([Note: one budget]): now (`live`), at most since `reset_peak` (`peak`),
    and at most in the last finished training pass (`last_pass_peak`).
    Safe from autograd's threads."""

    def __init__(self, device):
        self.device = device
        self.live = self.peak = self.pass_peak = self.last_pass_peak = 0
        # Of `live`: activations whose copy out is under way. How many are at
        # a given moment depends on the link's timing, up to `flight_cap`;
        # while a forward may still send (`sending`), a pass's peak counts the
        # queue as full, so that the next pass's reserve holds however the
        # copies happen to run then. Once the backward has begun the queue
        # only drains: what is still in it counts as it is.
        self.flight = self.flight_cap = 0
        self.sending = True
        self.blocks = 0  # device bytes of blocks now (`note_blocks`)
        self.planned = 0  # the most a pass holds by the plan (`plan`)
        self.beside = 0  # what a pass holds beside activations, bounded by pager (experts' copies): in `reserve`
        # block -> what its forwards in this pass dropped, to be recomputed in
        # its backward; and of that, what blocks whose backward has begun will
        # recompute (counted in `reserve` until each recomputation has run)
        self.dropped: dict = {}
        self.coming = 0
        self.peak_with_blocks = 0  # most of blocks and activations together, since `reset_peak`
        self._storages: dict = {}  # data_ptr -> [holders, nbytes] of kept storages (one storage counts once)
        self._lock = threading.Lock()

    def add(self, nbytes: int, flight: int = 0) -> None:
        with self._lock:
            self.live += nbytes
            self.flight += flight
            full = max(self.flight, self.flight_cap) if self.sending else self.flight
            self.pass_peak = max(self.pass_peak, self.live - self.flight + full)
            self.peak = max(self.peak, self.live)
            self.peak_with_blocks = max(self.peak_with_blocks, self.live + self.blocks)

    def note_blocks(self, nbytes: int) -> None:
        """Blocks hold `nbytes` on the device now (for `peak_with_blocks`)."""
        self.blocks = nbytes
        self.peak_with_blocks = max(self.peak_with_blocks, self.live + nbytes)

    def reset_peak(self) -> None:
        self.peak, self.peak_with_blocks = self.live, self.live + self.blocks

    def sub(self, nbytes: int, flight: int = 0) -> None:
        with self._lock:
            self.live -= nbytes
            self.flight -= flight

    def hold(self, t) -> int:
        """Count `t`'s storage (once, however many tensors hold it); the key to `let_go`."""
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            entry = self._storages.get(key)
            if entry is not None:
                entry[0] += 1
                return key
            self._storages[key] = [1, storage.nbytes()]
        self.add(storage.nbytes())
        return key

    def let_go(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[0] -= 1
            if entry[0]:
                return
            del self._storages[key]
        self.sub(entry[1])

    def pass_ends(self) -> None:
        """A training pass (forward and backward) ended: its peak is the reserve now."""
        with self._lock:
            self.last_pass_peak, self.pass_peak = self.pass_peak, self.live
            self.dropped.clear()
            self.coming = 0
            self.sending = True

    def recompute_comes(self, block) -> bool:
        """`block`'s backward begins: True if its recomputation, still to
        run, makes the reserve larger than it was ([Note: one budget])."""
        before = self.reserve()
        self.coming += self.dropped.pop(block, 0)
        return self.reserve() > before

    def grew(self) -> bool:
        """Activations hold more now than the reserve blocks left them (a pass
        larger than the plan and the last, or one that could not be
        planned): blocks fetched before may hold their room."""
        return self.live > max(self.last_pass_peak, self.planned)

    def recomputed(self, nbytes: int) -> None:
        """A recomputation that dropped `nbytes` has run (what it kept is in `live`)."""
        self.coming = max(self.coming - nbytes, 0)

    def plan(self, nbytes: int) -> None:
        """Activations will hold at most `nbytes` in a pass (measured on fake
        tensors: [Note: activations, the automatic choice]): the least
        reserve from now on, whatever a pass measures."""
        self.planned = nbytes

    def reserve(self) -> int:
        """The share of the budget that activations (and what a pass holds beside them) take from blocks."""
        return max(self.last_pass_peak, self.planned, self.live + self.coming) + self.beside


def tensor_bytes(t) -> int:
    """The bytes of `t`'s elements (what a saved activation takes)."""
    return t.numel() * t.element_size()
