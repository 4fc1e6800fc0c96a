"""Copy and stall timings: bytes counted at once, seconds when the CUDA
events around each copy (or wait) have completed, per block and its owner.

[Note: timings resolved as they complete]
Each copy and each wait of compute for a fetch leaves a pair of timing
events. They are turned into seconds a few at a time, oldest first, as new
pairs arrive (`RESOLVE_PER_PAIR` completed pairs per new one): the events
of one stream complete in order, so the oldest pending pair is the first
to look at, and the host never waits for one. Resolving all pending pairs
at once (as an earlier meter did every 1024 pairs) took tens of ms of
host time at one use every ten decode tokens of a 7B model, and kept
thousands of events alive long enough to reach the garbage collector's
oldest generation (a 200 ms full collection in a decode run).
"""

from __future__ import annotations

from collections import deque

from .transport import event_method

RESOLVE_PER_PAIR = 2  # completed pairs turned into seconds per new pair (more than one: the queue drains)
# The counters of each direction (no name made per copy)
_FIELDS = {"h2d": ("h2d_bytes", "h2d_seconds"), "d2h": ("d2h_bytes", "d2h_seconds")}
# torch.cuda.Event's C methods, called directly (its Python wrappers add a frame each; see engine/transport.py)
_query = event_method("query")
_elapsed_ms = event_method("elapsed_time")


class Meter:
    """Counts what the engine's copies moved and how long they (and compute's
    waits for them) took.

    Args:
        cuda: times come as CUDA event pairs (else as `time.perf_counter` values).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._stalls: deque = deque()  # (block, compute arrived, fetch landed)
        self._copies: deque = deque()  # (block, its seconds counter, start, end)

    def copied(self, block, direction: str, start, end, nbytes: int) -> None:
        """A copy of `nbytes` of `block`, "h2d" or "d2h", from `start` to `end`."""
        bytes_field, seconds_field = _FIELDS[direction]
        _add(block, bytes_field, nbytes)
        if self.cuda:
            self._copies.append((block, seconds_field, start, end))
            self._resolve_copies(RESOLVE_PER_PAIR)
        else:
            _add(block, seconds_field, end - start)
            if direction == "h2d":  # the CPU device copies synchronously: compute waited
                _add(block, "stall_seconds", end - start)

    def stalled(self, block, arrive, landed) -> None:
        """Compute reached `block` at event `arrive`; its fetch lands at `landed`."""
        self._stalls.append((block, arrive, landed))
        self._resolve_stalls(RESOLVE_PER_PAIR)

    def resolve(self, wait: bool = True) -> None:
        """Turn timing-event pairs into seconds: stalls (compute arrived, fetch
        landed) and copy durations. With wait=False only pairs already complete
        are taken (no host sync)."""
        if wait:
            for _block, _field, _start, end in self._copies:
                end.synchronize()
            for _block, arrive, landed in self._stalls:
                arrive.synchronize()
                landed.synchronize()
        self._resolve_copies(len(self._copies))
        self._resolve_stalls(len(self._stalls))

    def _resolve_copies(self, most: int) -> None:
        copies = self._copies
        while most > 0 and copies and _query(copies[0][3]):
            block, seconds_field, start, end = copies.popleft()
            _add(block, seconds_field, _elapsed_ms(start, end) / 1e3)
            most -= 1

    def _resolve_stalls(self, most: int) -> None:
        stalls = self._stalls
        while most > 0 and stalls and _query(stalls[0][1]) and _query(stalls[0][2]):
            block, arrive, landed = stalls.popleft()
            ms = _elapsed_ms(arrive, landed)
            if ms > 0:
                _add(block, "stall_seconds", ms / 1e3)
            most -= 1


def _add(block, field: str, value) -> None:
    """Add to a counter of `block` and the same one of its owner."""
    setattr(block.stats, field, getattr(block.stats, field) + value)
    counters = block.owner.counters
    setattr(counters, field, getattr(counters, field) + value)
