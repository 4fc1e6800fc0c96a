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
"""

from __future__ import annotations

from itertools import chain, islice

from ..base.common import PREFETCH_WINDOW, STEP, WEIGHTS, _record_range
from ..training.host_step import host_update_landed


def prefetch(pager) -> None:
    """Fetch the next uses of `pager`'s model that have room (see the Note)."""
    if not pager.prefetch_depth or pager.all_resident:
        return  # off, or nothing left to fetch
    engine = pager.engine
    disk = engine.host.disks.get(pager) if engine.host.disks else None
    if disk is not None:  # pages further ahead start coming from disk ([Note: the disk tier])
        disk.read_ahead(_upcoming(pager))
    alone = len(engine.owners) == 1
    uses = None if alone else islice(_upcoming(pager), PREFETCH_WINDOW)
    peek = pager.scheduler.peek
    awaiting = pager.host_steps.state_room.awaiting
    fetched = 0
    for distance in range(PREFETCH_WINDOW):
        # (alone, by index into the plan: no iterator made at every use)
        use = peek(distance) if uses is None else next(uses, None)
        if use is None:
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
        elif kinds is WEIGHTS and not block.deps and block.weights.resident:
            continue  # the common case once the working set is resident
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
        if not engine.room.make_room(
            missing, protect=(block, *block.deps) if block.deps else (block,), within=distance
        ):
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
