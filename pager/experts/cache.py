"""Device slots for experts: `ExpertCache`, one per layout (the same tensors'
shapes and dtypes), shared by every experts module of that layout, so that
the layers whose experts are used most hold the most. See [Note: experts
paged one by one] in experts/table.py.

[Note: which experts stay]
A decode token uses k of each layer's E experts; some experts are chosen far
more often than others, and which ones drifts slowly. Least recently used
alone keeps nothing where a token's experts over all layers outnumber the
slots (a Mixtral-8x7B-shaped model under 24 GiB: 64 experts a token, about
50 slots): every expert leaves before it is used again, none is ever hit.
So the slots are kept by use counts over recent tokens, admitted as
TinyLFU does (Einziger et al., 2017): every use of an expert counts (the
counts of experts not held too), and every `AGE_USES` uses per slot the
counts halve (lazily: a count carries the period it was last written in).
An expert that misses comes into the `_recent` segment (an eighth of the
slots, or the experts one token routes to in a layer where those are more
(a decode call's misses; a prompt's many do not grow it); least recently
used first); when a slot is needed and `_recent` is full, its least
recently used expert and the `_frequent` segment's least recently used one
compete: the one used less often leaves (on a tie, the
one in `_frequent` stays). So a set of experts used more often than the
rest stays whatever passes through, and where every expert is used alike
(uniform routing) a fixed set stays, hit at the rate of its share. Every
operation is a dictionary's, and a search for a victim passes over at most
the experts of the call being served, which never leave (a call never routes
to more than the cache holds: experts/table.py runs such a call by chunks of
tokens). Copies ahead ([Note: experts fetched ahead]) take free slots or
`_recent`'s, never `_frequent`'s: a prediction does not push out an expert
kept for its counts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .host import ColdExperts

RECENT_SHARE = 8  # the `_recent` segment holds at most 1/8 of the slots (at least one)
AGE_USES = 16  # use counts halve every this many uses per slot ([Note: which experts stay])
# Fetching ahead ([Note: experts fetched ahead] in experts/ahead.py) is judged by
# windows of this many experts copied ahead: where fewer than this share of
# them were then used, it pauses for this many calls, then tries again.
AHEAD_WINDOW = 64
AHEAD_LEAST_USED = 0.5
AHEAD_PAUSE_CALLS = 16384


class ExpertCache:
    """`capacity` slots, each holding one expert's tensors (one per `layout`
    entry), on `device`.

    Args:
        layout: ((shape of one expert's tensor, dtype), ...), in the order of
            the experts module's parameters.
        capacity: slots.
        device: where.
        least: the fewest slots it runs with (one token's experts in a
            layer: `shrink` goes no lower).
        cold_experts: where a call's experts the slots lack run: "auto",
            "host" or "device" (`wrap`'s `cold_experts`).

    Example (inside pager):
        >>> cache = ExpertCache((((32, 16), torch.float32), ((16, 16), torch.float32)), 8, torch.device("cpu"))
        >>> slots, misses = cache.hold(0, [1, 5], fill)  # fill(slot, key) copies an expert in
    """

    def __init__(self, layout: tuple, capacity: int, device: torch.device, least: int = 1, cold_experts="device"):
        self.layout, self.capacity, self.device, self.least = layout, capacity, device, min(least, capacity)
        self.expert_bytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in layout)
        # where the experts it lacks run ([Note: cold experts on the host] in experts/host.py)
        self.cold = ColdExperts(cold_experts, device.type == "cuda")
        self._recent_most = max(1, capacity // RECENT_SHARE)  # (grown to one token's experts: `hold`)
        self._counts: dict = {}  # key -> (uses, the aging period they were counted in)
        self._uses = 0
        self._slots(capacity)
        self.released_event: torch.cuda.Event | None = None  # on CUDA: the last call's end (ExpertTable._after)
        self.ahead_used = 0  # experts copied ahead that a call then used
        self._window = [0, 0]  # experts copied ahead in this window, and of them used
        self._windows = 0  # windows judged so far
        self.ahead_paused = 0  # calls left before fetching ahead is tried again (0: on)
        self.ahead_stream = torch.cuda.Stream(device) if device.type == "cuda" and capacity else None
        self.ahead_event: torch.cuda.Event | None = None  # on CUDA: the end of the last copies ahead
        self.lock = threading.RLock()  # held by a call from its pre-hook to its post-hook (experts/table.py)

    def _slots(self, capacity: int) -> None:
        """`capacity` empty slots (their tensors new)."""
        self.capacity = capacity
        device = self.device
        self.tensors = [torch.empty((capacity, *shape), dtype=dtype, device=device) for shape, dtype in self.layout]
        self._recent: OrderedDict = OrderedDict()  # key -> slot, least recently used first: come in lately
        self._frequent: OrderedDict = OrderedDict()  # key -> slot, least recently used first: kept for their counts
        self._free = list(range(capacity - 1, -1, -1))
        self._recent_most = max(1, min(self._recent_most, capacity // 2))
        self._age_uses = max(1, AGE_USES * capacity)
        self._ahead: dict = {}  # key copied ahead and not used since -> its window ([Note: experts fetched ahead])
        self._in_flight: set = set()  # keys copied ahead that no call has waited for yet
        self._free_in_flight = False  # a free slot's copy ahead may still run (`forget`)

    def device_bytes(self) -> int:
        return self.expert_bytes * self.capacity

    def shrink(self, capacity: int) -> int:
        """Hold `capacity` slots from now on (at least `least`), every
        expert dropped (use counts kept); returns the device bytes given up.
        Between calls (the lock is taken)."""
        capacity = max(capacity, self.least)
        if capacity >= self.capacity:
            return 0
        with self.lock:
            before = self.device_bytes()
            if self.device.type == "cuda":
                # Copies ahead (on `ahead_stream`) and fills may still write into
                # the slots, and kernels of the last call read them: all done
                # before their memory goes back to the allocator (rare: once
                # per budget a training step needs).
                torch.cuda.synchronize(self.device)
            self.tensors = []  # (the old slots freed before the new are made)
            self._slots(capacity)
            return before - self.device_bytes()

    def hold(self, base: int, experts: list, fill, wait_ahead=None, per_token: int = 0) -> tuple[list, int]:
        """The slots of `experts` (keys `base + expert`), in their order,
        each filled by `fill(slot, key)` where it was not held; and how many
        were not. At most `capacity` experts (the caller checks).
        `wait_ahead()` is called first where a slot used or taken was copied
        ahead and not yet waited for ([Note: experts fetched ahead] in
        experts/ahead.py). `per_token`: the experts one token routes to in
        a layer (k), which `_recent` holds at least."""
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
        if per_token > self._recent_most:  # (`_recent` holds a decode call's misses: one token's experts)
            self._recent_most = max(self._recent_most, min(per_token, self.capacity // 2))
        if missed:
            current = set(keys)
            for i in missed:
                if self._free:
                    slots[i] = self._free.pop()
                    waits = waits or self._free_in_flight
                else:
                    victim, slots[i] = self._victim(current)
                    waits = waits or victim in self._in_flight
                self._recent[keys[i]] = slots[i]
                self._settle(current)
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
            if key in self._recent or key in self._frequent:
                continue
            taken.add(key)
            if self._free:
                slot = self._free.pop()
            else:
                # (a copy ahead pushes out only an expert come in lately; one
                # copied ahead before is ordered on the same stream)
                found = self._first_not_in(self._recent, taken)
                if found is None:
                    break  # (no room ahead: a cache of a call's experts or little more)
                slot = self._leave(self._recent, found)
            self._recent[key] = slot
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
        """`key`'s use counted; its slot, if held."""
        self._count(key, 1)
        slot = self._frequent.get(key)
        if slot is not None:
            self._frequent.move_to_end(key)
            return slot
        slot = self._recent.get(key)
        if slot is None:
            return None
        self._recent.move_to_end(key)
        if key in self._ahead:  # (copied ahead, used for the first time)
            if self._ahead.pop(key) == self._windows:  # (one copied in a window judged already: not this one's)
                self._window[1] += 1
            self.ahead_used += 1
        return slot

    def _count(self, key: int, add: int) -> int:
        """`key`'s uses over recent ones (halved every aging period since they were counted), plus `add`."""
        period = self._uses // self._age_uses
        uses, counted = self._counts.get(key, (0, period))
        uses = (uses >> min(period - counted, 62)) + add
        if add:
            self._uses += add
            self._counts[key] = (uses, period)
        return uses

    def _settle(self, current: set) -> None:
        """`_recent` beyond its share passes its least recently used experts
        to `_frequent` while that has room (free slots filling, or after a
        prefill's call took every slot)."""
        while len(self._recent) > self._recent_most and len(self._frequent) < self.capacity - self._recent_most:
            key = self._first_not_in(self._recent, current)
            if key is None:
                return
            self._frequent[key] = self._recent.pop(key)

    def _victim(self, current: set) -> tuple[int, int]:
        """(key, slot) of the expert to leave for one of `current` that
        missed: see the Note."""
        recent = self._first_not_in(self._recent, current) if len(self._recent) >= self._recent_most else None
        frequent = self._first_not_in(self._frequent, current)
        if recent is not None and frequent is not None:
            if self._count(recent, 0) > self._count(frequent, 0):  # (admitted: it takes the other's place)
                self._frequent[recent] = self._recent.pop(recent)
                recent = None
            else:
                frequent = None
        if frequent is not None:
            return frequent, self._leave(self._frequent, frequent)
        if recent is None:
            recent = self._first_not_in(self._recent, current)
            if recent is None:
                raise AssertionError("pager: an expert cache smaller than one call's experts")  # (never: table.py)
        return recent, self._leave(self._recent, recent)

    def _leave(self, segment: OrderedDict, key: int) -> int:
        self._ahead.pop(key, None)
        return segment.pop(key)

    @staticmethod
    def _first_not_in(segment: OrderedDict, current: set):
        """The least recently used key of `segment` not in `current` (a pass over at most `current`'s)."""
        for key in segment:
            if key not in current:
                return key
        return None

    def drop(self, keys: list) -> None:
        """Forget `keys` whose slots were taken but not filled (a copy failed): their slots are free."""
        for key in keys:
            for segment in (self._recent, self._frequent):
                slot = segment.pop(key, None)
                if slot is not None:
                    self._free.append(slot)
            self._ahead.pop(key, None)

    def forget(self, base: int, count: int) -> None:
        """Drop the experts `base` .. `base + count - 1` (their host tensors changed)."""
        for segment in (self._recent, self._frequent):
            for key in [k for k in segment if base <= k < base + count]:
                self._free.append(segment.pop(key))
                self._ahead.pop(key, None)
                self._free_in_flight = self._free_in_flight or key in self._in_flight

    def held(self) -> int:
        return len(self._recent) + len(self._frequent)

    def wait_ahead(self) -> None:
        # A slot a call uses or takes was copied ahead on the side stream:
        # compute (and copies into it) must not start before that copy ends.
        if self.ahead_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ahead_event)

    @property
    def copying_ahead(self) -> bool:
        """Copies ahead may be under way (no call has waited for them yet)."""
        return bool(self._in_flight)

    def holds(self, key: int) -> bool:
        """Whether `key` is in a slot (copied ahead included)."""
        return key in self._recent or key in self._frequent

    def uses(self, key: int) -> int:
        """`key`'s use count over recent uses ([Note: which experts stay])."""
        return self._count(key, 0)

    def count_use(self, key: int) -> None:
        """A use of `key` that took no slot (computed on the host:
        [Note: cold experts on the host] in experts/host.py)."""
        self._count(key, 1)


def caches_of(tables: list) -> list:
    """The caches of experts' `tables`, each once."""
    return list({id(t.cache): t.cache for t in tables}.values())


def shrink_caches(caches: list, nbytes: int) -> int:
    """Give up at least `nbytes` of `caches`' device memory where they hold
    that beyond their least, the caches holding most beyond it giving first
    (each by whole slots); returns the bytes given up."""
    freed = 0
    for cache in sorted(caches, key=lambda c: (c.least - c.capacity) * c.expert_bytes):
        if freed >= nbytes:
            break
        slots = -(-(nbytes - freed) // max(1, cache.expert_bytes))
        freed += cache.shrink(cache.capacity - slots)
    return freed
