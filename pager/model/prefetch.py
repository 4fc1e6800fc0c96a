"""Prefetch: while a block computes, the next uses' pages come in on the copy
stream, as far as the room allows.

[Note: prefetch]
After each use, `prefetch` walks the uses the scheduler predicts next (at
most `PREFETCH_WINDOW`), skipping what is resident, and fetches up to
`prefetch_depth` of them: each only if the engine can make room for it
without evicting a block whose next use comes sooner or one of the kept
set (`make_room(within=distance)`), and,
under a disk tier, only once its page is in host memory (the thread that
runs compute never waits for the disk). With several models on one engine,
the walk goes on into the plan of the model predicted to run next
([Note: sharing the room] in engine/room.py).

[Note: the prefetch frontier]
In a repeating order much of the window is already resident, and the walk
used to look again at the same resident blocks at every use (the walk,
with the fetches and evictions it makes, was 43% of a streamed use's host
time at 256 blocks of a 64-wide layer on the CPU device). So a model alone
on its engine remembers how far the walk found nothing to do
(`Frontier`): the uses up to there were resident weights with nothing
deferred, and stay so until a block leaves other than for this walk's own
room (a prefetch evicts only blocks whose next use is further than the
one it fetches: never one before the frontier; a fetch that finds the
device out of memory evicts every idle block, and then the frontier does
not hold), a new step starts, an update is deferred to a block's use or
given to the host or another rank, or a block takes its parts as deps
(`Frontier.reset`: the walk ahead of a backward's last uses reaches into
the next forward, whose first blocks an optimizer step then defers
updates to). The next walk starts there. The engine counts departures
(`Engine.departures`); the scheduler, its steps and its plan. Where most
of the model stays resident the gain is largest (256 such blocks, nine
tenths resident: 44-49 -> 35-43 us a use); at half, none measurable.
"""

from __future__ import annotations

from itertools import chain, islice

from ..base.common import PREFETCH_WINDOW, STEP, WEIGHTS, _record_range
from ..training.host_step import host_update_landed


class Frontier:
    """How far ahead of its scheduler's position a model's prefetch walk
    found nothing to do, and when (see [Note: the prefetch frontier])."""

    __slots__ = ("plan", "step", "departures", "pos", "until", "moved", "own")

    def __init__(self):
        self.plan, self.step, self.departures, self.pos, self.until = None, -1, -1, 0, 0
        self.moved = False  # by the walk now running (stamped with the departures after it: `walked`)
        self.own = 0  # blocks that walk evicted to make room: none before the frontier

    def reset(self) -> None:
        """A block's state that a walk reads changed outside it (an update
        deferred to its use, given to the host or to another rank; parts
        taken as deps): the next walk starts at the next use."""
        self.plan = None

    def start(self, scheduler, engine) -> int:
        """The distance the walk may start at: 0 unless nothing changed since
        the last walk but the scheduler's position, moving on."""
        if (
            self.plan is not scheduler.plan
            or self.step != scheduler.steps
            or self.departures != engine.departures
            or scheduler.expected
            or not self.pos <= scheduler.pos <= self.until
        ):
            return 0
        return self.until - scheduler.pos

    def reached(self, scheduler, engine, distance: int) -> None:
        """The walk found the uses before `distance` resident with nothing to do."""
        if scheduler.expected:
            return
        self.plan, self.step = scheduler.plan, scheduler.steps
        self.pos, self.until = scheduler.pos, scheduler.pos + distance
        self.departures, self.own, self.moved = engine.departures, 0, True

    def walked(self, engine) -> None:
        """The walk is over: if the only blocks that left since `reached` are
        those it evicted for room (all further than the frontier), the
        frontier holds from the departures counted now; if others left too
        (a fetch out of device memory evicts every idle block), it does not."""
        if self.moved:
            if engine.departures == self.departures + self.own:
                self.departures = engine.departures
            else:
                self.plan = None
            self.moved = False


def prefetch(pager) -> None:
    """Fetch the next uses of `pager`'s model that have room (see the Note)."""
    if not pager.prefetch_depth or pager.all_resident:
        return  # off, or nothing left to fetch
    try:
        _walk(pager)
    finally:
        pager.prefetch_frontier.walked(pager.engine)


def _walk(pager) -> None:
    engine = pager.engine
    disk = engine.host.disks.get(pager) if engine.host.disks else None
    if disk is not None:  # pages further ahead start coming from disk ([Note: the disk tier])
        disk.read_ahead(_upcoming(pager))
    alone = len(engine.owners) == 1
    uses = None if alone else islice(_upcoming(pager), PREFETCH_WINDOW)
    scheduler = pager.scheduler
    peek = scheduler.peek
    awaiting = pager.host_steps.state_room.awaiting
    # (alone, with no update running elsewhere: [Note: the prefetch frontier])
    frontier = pager.prefetch_frontier
    clear = uses is None and disk is None and pager.owners is None and not awaiting and not pager.host_steps.updating()
    # (`clear`: every use so far resident with nothing to do)
    start = frontier.start(scheduler, engine) if clear else 0
    fetched = 0
    for distance in range(start, PREFETCH_WINDOW):
        # (alone, by index into the plan: no iterator made at every use)
        use = peek(distance) if uses is None else next(uses, None)
        if use is None:
            if clear:
                frontier.reached(scheduler, engine, distance)
            return
        block, kinds = use
        if block.host_update is not None and not host_update_landed(block):
            return  # its optimizer update is still running on the host (what comes after it waits its turn)
        if block in awaiting:
            return  # ... or not given yet ([Note: the state off the device] in training/state_room.py)
        if block.owner_update is not None and not pager.owners.landed(block):
            return  # its owner (another rank) has not published its update yet
        if block.deferred_steps:
            kinds = STEP  # its pending update runs at this use
        elif (kinds is WEIGHTS or not block.trainable) and not block.deps and block.weights.resident:
            continue  # the common case once the working set is resident (a frozen block's backward needs no more)
        if clear:
            frontier.reached(scheduler, engine, distance)
            clear = False
        if "grads" in kinds:
            block.owner.grad_pages.ensure_segment(block)
            if getattr(block.segments.get("grads"), "dropped", False):
                # (empty: made at its use, [Note: gradients set to None leave the device])
                kinds = tuple(k for k in kinds if k != "grads")
        missing = block.missing_bytes(kinds)
        for dep in block.deps:
            missing += dep.missing_bytes(WEIGHTS)
        if not missing:
            continue
        if disk is not None and not engine.host.ready(block, kinds):
            return  # its page is still being read: the thread that runs compute does not wait for the disk
        departed, protect = engine.departures, (block, *block.deps) if block.deps else (block,)
        roomy = engine.room.make_room(missing, protect=protect, within=distance)
        frontier.own += engine.departures - departed  # (only further blocks: see `Frontier.walked`)
        if not roomy:
            return
        for dep in block.deps:
            if dep.missing_bytes(WEIGHTS):
                engine.fetch(dep, WEIGHTS)
        with _record_range("prefetch", block.name):
            engine.fetch(block, kinds)
        block.stats.prefetches += 1
        block.owner.counters.prefetches += 1
        fetched += 1
        if fetched >= pager.prefetch_depth:
            return
    if clear:
        frontier.reached(scheduler, engine, PREFETCH_WINDOW)  # (the whole window: start <= it)


def _upcoming(pager):
    """The uses to prefetch for: this model's; with other models on the
    engine, the rest of this step, then the plan of the model predicted
    to run next ([Note: sharing the room] in engine/room.py)."""
    if len(pager.engine.owners) == 1:
        return pager.scheduler.upcoming()
    after = pager.engine.room.next_owner(pager)
    if after is pager:
        return pager.scheduler.upcoming()
    theirs = ((b, k) for b, k in after.scheduler.plan if k is WEIGHTS and not b.deferred_steps)
    return chain(pager.scheduler.upcoming_this_step(), theirs)
