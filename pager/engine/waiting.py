"""Uses that wait for room other threads hold: `Waiters`, one per engine.

[Note: waiting for room]
Several threads may use blocks at once (a server's requests, one model or
several on one engine). A use that needs room which blocks in use by other
threads hold waits for them (the lock let go) instead of failing: the room
comes back as soon as one of them is released. Waiters are served in the
order they came (a first-come queue), except that a thread holding blocks
itself goes first (it is mid-use; making it queue behind a thread that waits
for its room would deadlock). A use fails at once with a BudgetError where
waiting cannot help: the room is held by this thread alone, or by nothing
that will be released (views kept, a graph held), or every thread holding
room is itself waiting (a deadlock, broken by failing the thread that finds
it); and after `wait_seconds` with a BudgetError that says who holds what.
A waiting thread counts as waiting only while its block still misses bytes:
threads that pinned the same block wait together, and once one of them has
brought it the others hold it resident while they wake (`_stuck`); counted
as waiting, they made a deadlock out of a moment.
"""

from __future__ import annotations

import threading
import time


class Waiters:
    """The first-come queue of threads waiting for room, and the wait itself.

    Args:
        engine: the `Engine` (its lock, room and resident blocks).
        wait_seconds: how long a use waits before it fails.
    """

    def __init__(self, engine, wait_seconds: float):
        self.engine = engine
        self.wait_seconds = wait_seconds
        self.back = threading.Condition(engine.lock)  # notified when room may have come back
        # Threads waiting for room, first come first: thread -> (block, kinds) it waits to bring.
        self.queue: dict = {}
        self.waits = 0  # uses that waited for room
        self.waited_seconds = 0.0
        self.timeouts = 0

    @property
    def waiting(self) -> set:
        """The threads waiting for room."""
        return set(self.queue)  # (its keys)

    def room_may_be_back(self) -> None:
        """Wake the uses waiting for room (a block went idle or left, a
        forward that kept blocks from leaving ended)."""
        if self.queue:
            self.back.notify_all()

    def room_for_use(self, block, kinds) -> int:
        """Make room for what `block` misses of `kinds`, waiting while other
        threads' uses hold it ([Note: waiting for room]). Returns the bytes
        still missing (0 if another thread fetched them meanwhile)."""
        me = threading.get_ident()
        started = None
        try:
            while True:
                missing = block.missing_bytes(kinds)
                if not missing:
                    return 0
                if not self.queue or next(iter(self.queue)) == me or self._held_by(me):  # (no scan while none waits)
                    if self.engine.room.make_room(missing, protect={block}):
                        return missing
                    holders = self._holders(me)
                    if not holders or holders <= self._stuck():
                        self.engine.room.raise_no_room(block, missing, deadlock=bool(holders))
                if started is None:
                    started = time.monotonic()
                    self.queue[me] = (block, kinds)
                    self.waits += 1
                left = started + self.wait_seconds - time.monotonic()
                if left <= 0:
                    self.timeouts += 1
                    self.engine.room.raise_no_room(block, missing, waited=time.monotonic() - started)
                self.back.wait(left)
        finally:
            if started is not None:
                self.waited_seconds += time.monotonic() - started
                del self.queue[me]
                self.back.notify_all()  # the next in the queue may try now

    def _stuck(self) -> set:
        """The waiting threads that still miss bytes. One whose block another
        thread has brought meanwhile (both had pinned it: it is resident and
        pinned for it too) goes on as soon as it wakes: it holds that block
        but is no part of a deadlock."""
        return {t for t, (block, kinds) in self.queue.items() if block.missing_bytes(kinds)}

    def _held_by(self, thread) -> bool:
        return any(thread in b.thread_pins for b in self.engine.resident if not b.resident_for_life)

    def _holders(self, me) -> set:
        """Threads other than `me` whose uses hold room that they will give
        back (None: blocks in use by a thread not known)."""
        out = set()
        for b in self.engine.resident:
            if b.pins > 0 and not b.resident_for_life:
                out |= set(b.thread_pins) if b.thread_pins else {None}
        for owner in self.engine.owners:
            if owner.evictions_blocked():
                out |= owner.blocking_threads()
        out.discard(me)
        return out
