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
number of slots. The experts of the call being served never leave (the
cache holds at least one layer's experts).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

PROTECTED_SHARE = (4, 5)  # the protected segment's most, of the slots


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
        self.released_event = None  # on CUDA: the end of the last call's kernels (ExpertTable._after)
        self.lock = threading.RLock()  # held by a call from its pre-hook to its post-hook (experts/table.py)

    def device_bytes(self) -> int:
        return self.expert_bytes * self.capacity

    def hold(self, base: int, experts: list, fill) -> tuple[list, int]:
        """The slots of `experts` (keys `base + expert`), in their order,
        each filled by `fill(slot, key)` where it was not held; and how many
        were not. At most `capacity` experts (the caller checks)."""
        keys = [base + e for e in experts]
        slots: list = [None] * len(keys)
        missed = []
        for i, key in enumerate(keys):
            slot = self._touch(key)
            if slot is None:
                missed.append(i)
            else:
                slots[i] = slot
        if missed:
            current = set(keys)
            for i in missed:
                slot = self._free.pop() if self._free else self._victim(current)
                fill(slot, keys[i])
                self._probation[keys[i]] = slot
                slots[i] = slot
        return slots, len(missed)

    def _touch(self, key: int):
        slot = self._protected.get(key)
        if slot is not None:
            self._protected.move_to_end(key)
            return slot
        slot = self._probation.pop(key, None)
        if slot is None:
            return None
        self._protected[key] = slot  # used again while held: promoted
        if len(self._protected) > self._protected_most:
            old, old_slot = self._protected.popitem(last=False)
            self._probation[old] = old_slot
        return slot

    def _victim(self, current: set) -> int:
        for segment in (self._probation, self._protected):
            for key in segment:
                if key not in current:
                    return segment.pop(key)
        raise AssertionError("pager: an expert cache smaller than one call's experts")  # (wrap sizes it)

    def forget(self, base: int, count: int) -> None:
        """Drop the experts `base` .. `base + count - 1` (their host tensors changed)."""
        for segment in (self._probation, self._protected):
            for key in [k for k in segment if base <= k < base + count]:
                self._free.append(segment.pop(key))

    def held(self) -> int:
        return len(self._probation) + len(self._protected)
