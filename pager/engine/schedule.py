"""The order blocks are used in, and what it predicts.

Each step (one root forward and whatever follows it: backward, optimizer step)
appends every block acquisition to `recording`. When the next step starts, the
recording becomes the `plan`, and the position in it advances with each
acquisition. Upcoming acquisitions are: what the user said to expect, then the
rest of the plan, then the plan once more (the next step).

[Note: why next use, and a kept set]
With a cyclic order (a layer stack run step after step), LRU evicts exactly the
block needed soonest and so moves every block every step. Evicting the block
whose next use lies furthest ahead (Belady) is optimal for demand paging, but
a prefetcher that fetches the next block as soon as there is a victim whose
next use is later still degenerates into a sliding window over the stack. So
when a plan is known we split the budget: a *kept* set of blocks that stay
resident across steps, and a streaming room of two blocks (the one computing
and the one in flight) through which all other blocks pass. Bytes moved per
step are then the plan's bytes less the kept bytes, the least that any schedule
with one block of look-ahead can move.

[Note: kept blocks spread out]
Which blocks of one size are kept does not change the bytes a step moves,
but it changes when the copy engine can work. While compute (or the host)
runs through kept blocks, at most the two streaming slots can be filling:
a run of kept blocks longer than two blocks' copying leaves the link idle.
A decode step on the H100 showed it: its kept set, the earliest layers'
MLP parts, made a host-bound stretch with the 180 MB window drained before
each of those layers' attention parts (~1.1 ms idle each). So where a plan
only reads weights, the kept blocks of each size are spread evenly through
it. Training keeps the earliest (its measured figures), and models sharing
an engine keep the latest (so that a request's kept tail overlaps the next
request's fetches).

[Note: steps in a cycle of orders]
A step begins at each root forward, so gradient accumulation makes steps of
two orders in a cycle: micro-steps' forward and backward, then the last
micro-step's with the optimizer's step after it (with three micro-steps,
A A B A A B). The last recording alone would predict each step by the one
before, and miss where they differ (the optimizer's step, and the forward
after it): two order changes and a miss or two a step on the CPU device with
two micro-steps. So the orders of the last `2 * MAX_PERIOD` steps (a hash
of each recording) are searched for the cycle, of up to `MAX_PERIOD` steps,
that the most recent of them follow longest, seen at least twice; the
coming step is predicted by the step one cycle before it. Longest, not
shortest: two equal steps in a longer cycle (A A B) repeat with a cycle of
one; and the most recent, not all remembered, so that a step of warm-up or
one evaluation forward does not hide the cycle for 16 steps. A step of one
order every time, or of a new order each time (a supernet's path), is
predicted by the last recording, as before. Once per step: the hash reads
the recording once, and the rest compares integers.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from itertools import chain, islice

from ..base.common import BACKWARD, WEIGHTS

INF = float("inf")
MAX_PERIOD = 8  # steps: the longest cycle of orders recognized (gradient accumulation's micro-steps)


class Scheduler:
    def __init__(self):
        self.plan: list = []
        self.recording: list = []
        self.pos = 0
        self.expected: list = []
        self._kept: frozenset = frozenset()
        self.kept_version = 0  # counts changes of `kept` (the room sorts idle blocks by it: engine/room.py)
        self._positions: dict = {}  # block -> its indices in `plan` (for `distance_to`)
        self._positions_of = None  # the plan they index
        self._history: deque = deque(maxlen=2 * MAX_PERIOD)  # (hash, recording) of the last steps
        self._plan_key = None  # the hash of `plan`
        self.steps = 0  # steps started (a prefetch's frontier holds within one: model/prefetch.py)

    @property
    def kept(self) -> frozenset:
        """The blocks that stay resident across steps ([Note: why next use, and a kept set])."""
        return self._kept

    @kept.setter
    def kept(self, blocks) -> None:
        self._kept = frozenset(blocks)
        self.kept_version += 1

    def start_step(self) -> bool:
        """Make the last step's recording the plan, or, where the last steps'
        orders repeat in a cycle, the one a cycle before the coming step
        ([Note: steps in a cycle of orders]). True if the step's order was
        not the one predicted."""
        recording = self.recording
        changed = False
        if recording:
            key = hash(tuple(recording))
            changed = bool(self.plan) and key != self._plan_key
            self._history.append((key, recording))
            self._plan_key, self.plan = self._history[-self._period()]
        self.recording = []
        self.pos = 0
        self.steps += 1
        return changed

    def _period(self) -> int:
        """The cycle, in steps, that the most recent steps' orders follow
        longest, seen at least twice (1 where none: the last order predicts
        the next); ties go to the shorter."""
        keys = [key for key, _recording in self._history]
        n, best, longest = len(keys), 1, 0
        for period in range(1, min(MAX_PERIOD, n // 2) + 1):
            run = 0  # steps, from the last back, equal to the one a cycle before
            while run < n - period and keys[n - 1 - run] == keys[n - 1 - run - period]:
                run += 1
            if run >= period and run > longest:
                best, longest = period, run
        return best

    def expect(self, uses: list) -> None:
        """The next acquisitions will be `uses` ((block, kinds) pairs), in this order."""
        self.expected = list(uses)

    def expect_path(self, path: list, training: bool) -> None:
        """The next forward uses the blocks of `path`, in this order (`Pager.expect`);
        in `training`, its backward then reaches the trainable ones in the
        reverse of the order they finish in (last step's, on another path, is
        no guide). Blocks kept for last step's order but not on this path may go."""
        uses: list = [(b, WEIGHTS) for b in path]
        if training:
            uses += [(b, BACKWARD) for b in reversed(_finish_order(path)) if b.trainable]
        self.expect(uses)
        self.kept &= set(path)

    def observe(self, block, kinds) -> bool:
        """Record a use of `block` (needing segments `kinds`); True if predicted."""
        self.recording.append((block, kinds))
        if self.expected:
            if self.expected[0][0] is block:
                self.expected.pop(0)
                return True
            for i, (b, _k) in enumerate(self.expected):
                if b is block:
                    del self.expected[: i + 1]
                    return False
        if self.pos < len(self.plan) and self.plan[self.pos][0] is block:
            self.pos += 1
            return True
        # Off the plan: resynchronise on the block's next occurrence, if any.
        for i in range(self.pos, len(self.plan)):
            if self.plan[i][0] is block:
                self.pos = i + 1
                break
        return False

    def peek(self, distance: int):
        """The predicted use `distance` acquisitions from now (0: the next), as
        `upcoming()` lists them, or None past its end; no iterator made
        (prefetch asks at every use)."""
        expected = len(self.expected)
        if distance < expected:
            return self.expected[distance]
        i = self.pos + distance - expected
        n = len(self.plan)
        if i >= n:
            i -= n
        return self.plan[i] if i < n else None

    def upcoming(self):
        """Predicted (block, kinds) uses from now on, nearest first (lazy)."""
        return chain(self.expected, islice(self.plan, self.pos, None), self.plan)

    def reads_only(self) -> bool:
        """The plan only reads weights (inference: no gradients, no optimizer state)."""
        return all(kinds == WEIGHTS for _b, kinds in self.plan)

    def upcoming_this_step(self):
        """The predicted uses left in this step (lazy)."""
        return chain(self.expected, islice(self.plan, self.pos, None))

    def distance_to(self, block) -> float:
        """Acquisitions until `block`'s next predicted use: its first index in
        `upcoming()` (inf if none). A bisection in the plan, so that choosing a
        victim costs no walk of the plan (which made a forward of many small
        blocks host-bound)."""
        for i, (b, _kinds) in enumerate(self.expected):
            if b is block:
                return i
        if self._positions_of is not self.plan:
            self._positions = {}
            for i, (b, _kinds) in enumerate(self.plan):
                self._positions.setdefault(b, []).append(i)
            self._positions_of = self.plan
        positions = self._positions.get(block)
        if not positions:
            return INF
        k = bisect_left(positions, self.pos)
        ahead = positions[k] - self.pos if k < len(positions) else len(self.plan) - self.pos + positions[0]
        return len(self.expected) + ahead

    def choose_kept(self, budget_bytes: int, size_of, fixed_bytes: int, order: str = "early") -> None:
        """Pick the blocks of the plan that stay resident across steps: the
        largest first, leaving a streaming room of two of the largest
        streamed blocks. Among blocks of one size, `order` says which first:
        "early" in the plan, "late" ([Note: sharing the room] in engine/room.py),
        or "spread" evenly through it ([Note: kept blocks spread out])."""
        blocks = list(dict.fromkeys(b for b, _k in self.plan))
        if not blocks:
            self.kept = set()
            return
        rank = (
            _spread_ranks(blocks, size_of)
            if order == "spread"
            else {b: (i if order == "late" else -i) for i, b in enumerate(blocks)}
        )
        by_size = sorted(blocks, key=lambda b: (size_of(b), rank[b]), reverse=True)
        total = sum(size_of(b) for b in blocks)
        if fixed_bytes + total <= budget_bytes:
            self.kept = set(blocks)
            return
        kept, kept_bytes, largest_streamed = set(), 0, 0
        for i, block in enumerate(by_size):
            next_size = size_of(by_size[i + 1]) if i + 1 < len(by_size) else 0
            room = 2 * max(largest_streamed, next_size)
            if fixed_bytes + kept_bytes + size_of(block) + room <= budget_bytes:
                kept.add(block)
                kept_bytes += size_of(block)
            else:
                largest_streamed = max(largest_streamed, size_of(block))
        self.kept = kept


def _spread_ranks(blocks, size_of) -> dict:
    """Ranks (higher first) such that, among blocks of one size, every
    prefix of the order is spread evenly through the plan: positions taken
    in bit-reversed order (the first, the middle, the quarters, ...)."""
    groups: dict = {}
    for b in blocks:
        groups.setdefault(size_of(b), []).append(b)
    rank = {}
    for members in groups.values():
        bits = max(1, (len(members) - 1).bit_length())
        order = sorted(range(len(members)), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))
        for r, i in enumerate(order):
            rank[members[i]] = -r
    return rank


def _finish_order(blocks):
    """The order in which calls to `blocks` (in call order) return: a nested
    block (a NAS candidate) returns before the block around it."""
    out: list = []
    open_: list = []
    for b in blocks:
        while open_ and not _encloses(open_[-1], b):
            out.append(open_.pop())
        open_.append(b)
    return out + open_[::-1]


def _encloses(outer, block) -> bool:
    while block.parent is not None:
        block = block.parent
        if block is outer:
            return True
    return False
