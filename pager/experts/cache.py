"""Device slots for experts: `ExpertCache`, one per layout (the same tensors'
shapes and dtypes), shared by every experts module of that layout, so that
the layers whose experts are used most hold the most. See [Note: experts
paged one by one] in experts/table.py.

[Note: which experts stay]
A decode token uses k of each layer's E experts; some experts are chosen far
more often than others, and which ones drifts slowly. Least recently used
alone would let one prompt's rare experts push the often-used ones out, so
the slots are kept as a segmented LRU: an expert comes in on probation; used
again while it is held, it is promoted to the protected segment (at most
four fifths of the slots; the least recently used protected expert is put
back on probation to make room). A slot is taken from the probation
segment's least recently used expert first, from the protected segment's
only when probation holds none that may go: an expert used once leaves
before one used repeatedly, and an often-used expert that stops being used
still leaves in time. Every operation is a dictionary's, whatever the
number of slots. The experts of the call being served never leave (a call
never routes to more than the cache holds: experts/table.py runs such a
call by chunks of tokens).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

PROTECTED_SHARE = (4, 5)  # the protected segment's most, of the slots
# Fetching ahead ([Note: experts fetched ahead] in experts/ahead.py) is judged by
# windows of this many experts copied ahead: where fewer than this share of
# them were then used, it pauses for this many calls, then tries again.
AHEAD_WINDOW = 256
AHEAD_LEAST_USED = 0.5
AHEAD_PAUSE_CALLS = 4096


class ExpertCache:
    """`capacity` slots, each holding one expert's tensors (one per `layout`
    entry), on `device`.

    Args:
        layout: ((shape of one expert's tensor, dtype), ...), in the order of
            the experts module's parameters.
        capacity: slots.
        device: where.

    Example (inside pager):
        >>> cache = ExpertCache((((32, 16), torch.float32), ((16, 16), torch.float32)), 8, torch.device("cpu"))
        >>> slots, misses = cache.hold(0, [1, 5], fill)  # fill(slot, key) copies an expert in
    """

    def __init__(self, layout: tuple, capacity: int, device: torch.device):
        self.layout, self.capacity, self.device = layout, capacity, device
        self.tensors = [torch.empty((capacity, *shape), dtype=dtype, device=device) for shape, dtype in layout]
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors) if capacity else 0
        self._probation: OrderedDict = OrderedDict()  # key -> slot, least recently used first
        self._protected: OrderedDict = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._protected_most = max(1, capacity * PROTECTED_SHARE[0] // PROTECTED_SHARE[1])
        self.released_event: torch.cuda.Event | None = None  # on CUDA: the last call's end (ExpertTable._after)
        self._ahead: dict = {}  # key copied ahead and not used since -> its window ([Note: experts fetched ahead])
        self._in_flight: set = set()  # keys copied ahead that no call has waited for yet
        self._free_in_flight = False  # a free slot's copy ahead may still run (`forget`)
        self.ahead_used = 0  # experts copied ahead that a call then used
        self._window = [0, 0]  # experts copied ahead in this window, and of them used
        self._windows = 0  # windows judged so far
        self.ahead_paused = 0  # calls left before fetching ahead is tried again (0: on)
        self.ahead_stream = torch.cuda.Stream(device) if device.type == "cuda" and capacity else None
        self.ahead_event: torch.cuda.Event | None = None  # on CUDA: the end of the last copies ahead
        self.lock = threading.RLock()  # held by a call from its pre-hook to its post-hook (experts/table.py)

    def device_bytes(self) -> int:
        return self.expert_bytes * self.capacity

    def hold(self, base: int, experts: list, fill, wait_ahead=None) -> tuple[list, int]:
        """The slots of `experts` (keys `base + expert`), in their order,
        each filled by `fill(slot, key)` where it was not held; and how many
        were not. At most `capacity` experts (the caller checks).
        `wait_ahead()` is called first where a slot used or taken was copied
        ahead and not yet waited for ([Note: experts fetched ahead] in
        experts/ahead.py)."""
        keys = [base + e for e in experts]
        slots: list = [None] * len(keys)
        missed = []
        if self.ahead_paused:
            self.ahead_paused -= 1
        for i, key in enumerate(keys):
            slot = self._touch(key)
            if slot is None:
                missed.append(i)
            else:
                slots[i] = slot
        waits = bool(self._in_flight) and any(k in self._in_flight for k in keys)
        if missed:
            current = set(keys)
            for i in missed:
                if self._free:
                    slots[i] = self._free.pop()
                    waits = waits or self._free_in_flight
                else:
                    victim, slots[i] = self._victim(current)
                    waits = waits or victim in self._in_flight
                self._probation[keys[i]] = slots[i]
        if waits:
            if wait_ahead is not None:
                wait_ahead()
            self._in_flight.clear()
            self._free_in_flight = False
        for n, i in enumerate(missed):
            try:
                fill(slots[i], keys[i])
            except BaseException:
                self.drop([keys[j] for j in missed[n:]])  # (not filled: not held)
                raise
        return slots, len(missed)

    def take_ahead(self, base: int, experts: list, protect: set) -> list:
        """Slots for those of `experts` not held, to be filled ahead of their
        use: (slot, key) pairs; never a slot of `protect` (the keys of the
        call running) or of another of them. They count as copied ahead
        until a call waits for them (`hold`)."""
        out: list = []
        if self.ahead_paused:
            return out
        taken = set(protect)
        for e in experts:
            key = base + e
            if key in self._probation or key in self._protected:
                continue
            taken.add(key)
            if self._free:
                slot = self._free.pop()
            else:
                found = self._victim_or_none(taken)  # (one copied ahead: ordered on the same stream)
                if found is None:
                    break  # (a cache of a call's experts or little more: no room ahead)
                slot = found[1]
            self._probation[key] = slot
            self._ahead[key] = self._windows
            self._in_flight.add(key)
            out.append((slot, key))
        self._judge_ahead(len(out))
        return out

    def _judge_ahead(self, copied: int) -> None:
        """Count `copied` experts copied ahead; at the end of a window, pause
        fetching ahead where too few of the window's were used (a routing
        the next router does not predict: their copies only cost the link
        and the slots)."""
        window = self._window
        window[0] += copied
        if window[0] >= AHEAD_WINDOW:
            if window[1] < AHEAD_LEAST_USED * window[0]:
                self.ahead_paused = AHEAD_PAUSE_CALLS
            window[0] = window[1] = 0
            self._windows += 1

    def _touch(self, key: int):
        slot = self._protected.get(key)
        if slot is not None:
            self._protected.move_to_end(key)
            return slot
        if key in self._ahead:  # (copied ahead, used for the first time: not yet used again)
            if self._ahead.pop(key) == self._windows:  # (one copied in a window judged already: not this one's)
                self._window[1] += 1
            self.ahead_used += 1
            slot = self._probation.pop(key)
            self._probation[key] = slot
            return slot
        slot = self._probation.pop(key, None)
        if slot is None:
            return None
        self._protected[key] = slot  # used again while held: promoted
        if len(self._protected) > self._protected_most:
            old, old_slot = self._protected.popitem(last=False)
            self._probation[old] = old_slot
        return slot

    def _victim(self, current: set) -> tuple[int, int]:
        """(key, slot) of the expert to leave: see the Note."""
        found = self._victim_or_none(current)
        if found is None:
            raise AssertionError("pager: an expert cache smaller than one call's experts")  # (never: see table.py)
        return found

    def _victim_or_none(self, current: set) -> tuple[int, int] | None:
        for segment in (self._probation, self._protected):
            for key in segment:
                if key not in current:
                    self._ahead.pop(key, None)
                    return key, segment.pop(key)
        return None

    def drop(self, keys: list) -> None:
        """Forget `keys` whose slots were taken but not filled (a copy failed): their slots are free."""
        for key in keys:
            for segment in (self._probation, self._protected):
                slot = segment.pop(key, None)
                if slot is not None:
                    self._free.append(slot)
            self._ahead.pop(key, None)

    def forget(self, base: int, count: int) -> None:
        """Drop the experts `base` .. `base + count - 1` (their host tensors changed)."""
        for segment in (self._probation, self._protected):
            for key in [k for k in segment if base <= k < base + count]:
                self._free.append(segment.pop(key))
                self._ahead.pop(key, None)
                self._free_in_flight = self._free_in_flight or key in self._in_flight

    def held(self) -> int:
        return len(self._probation) + len(self._protected)
