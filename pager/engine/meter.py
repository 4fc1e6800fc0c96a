"""Copy and stall timings: bytes counted at once, seconds when the CUDA
events around each copy (or wait) have completed, per block and its owner."""

from __future__ import annotations

EVENTS_BEFORE_RESOLVE = 1024  # pending event pairs before completed ones are turned into seconds


class Meter:
    """Counts what the engine's copies moved and how long they (and compute's
    waits for them) took.

    Args:
        cuda: times come as CUDA event pairs (else as `time.perf_counter` values).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._stalls: list = []  # (block, compute arrived, fetch landed)
        self._copies: list = []  # (block, direction, start, end)

    def copied(self, block, direction: str, start, end, nbytes: int) -> None:
        """A copy of `nbytes` of `block`, "h2d" or "d2h", from `start` to `end`."""
        _add(block, f"{direction}_bytes", nbytes)
        if self.cuda:
            self._copies.append((block, direction, start, end))
            if len(self._copies) > EVENTS_BEFORE_RESOLVE:
                self.resolve(wait=False)
        else:
            _add(block, f"{direction}_seconds", end - start)
            if direction == "h2d":  # the CPU device copies synchronously: compute waited
                _add(block, "stall_seconds", end - start)

    def stalled(self, block, arrive, landed) -> None:
        """Compute reached `block` at event `arrive`; its fetch lands at `landed`."""
        self._stalls.append((block, arrive, landed))
        if len(self._stalls) > EVENTS_BEFORE_RESOLVE:
            self.resolve(wait=False)

    def resolve(self, wait: bool = True) -> None:
        """Turn timing-event pairs into seconds: stalls (compute arrived, fetch
        landed) and copy durations. With wait=False only pairs already complete
        are taken (no host sync)."""
        stalls, copies = [], []
        for block, arrive, done in self._stalls:
            if not wait and not (arrive.query() and done.query()):
                stalls.append((block, arrive, done))
                continue
            arrive.synchronize()  # both ends must have completed
            done.synchronize()
            ms = arrive.elapsed_time(done)
            if ms > 0:
                _add(block, "stall_seconds", ms / 1e3)
        for block, direction, start, end in self._copies:
            if not wait and not end.query():
                copies.append((block, direction, start, end))
                continue
            end.synchronize()
            _add(block, f"{direction}_seconds", start.elapsed_time(end) / 1e3)
        self._stalls, self._copies = stalls, copies


def _add(block, field: str, value) -> None:
    """Add to a counter of `block` and the same one of its owner."""
    setattr(block.stats, field, getattr(block.stats, field) + value)
    counters = block.owner.counters
    setattr(counters, field, getattr(counters, field) + value)
