"""The room for blocks under an engine's budget, shared by its models, and
who leaves to make more: `Room`, one per engine.

[Note: sharing the room]
With several models on one engine, each model's kept set (the blocks that
stay across its forwards, [Note: why next use, and a kept set]) is chosen in
its share of the room: what every model holds for life, plus a streaming
window of two of the largest blocks, plus the rest in proportion to the
bytes each model used in the last `SHARE_WINDOW` requests (requests counted
as root forwards, each weighed by the model's bytes). A model that sits idle
drops out of the window and lends its room; alternating models get equal
shares. Blocks of a model with no forward in flight are evicted before those
of one running, so the streamed blocks an idle model left behind make room
first. A model's prefetch, once its own step holds nothing more to fetch,
goes on into the plan of the model predicted to come next (the one that
followed it last time), and where models are served in turn, kept sets
sit at the end of each plan: the streamed blocks of the next request land
while this one runs its kept tail (on the H100, two 7B-shaped models
alternating under 1.5 models' budget, the copy engine had idled through
each request's kept stretch). A model that mostly follows itself in the
window (a pipeline's transformer, 20-50 denoising steps after one call of
each text encoder) is its own next request: a kept tail would leave the
link idle through it but for the two blocks of the streaming window, so
its kept set is spread through its plan as a model's alone is ([Note: kept
blocks spread out] in engine/schedule.py; the FLUX.1-dev-shaped pipeline
at 8 GiB on the H200 had moved its 16.6 GB a step in 1.33x the link's time).

[Note: a dormant model's blocks]
A prefetch evicts only blocks whose next use comes after the one it
fetches, by their owner's schedule, and never kept ones. Between models
that is no measure: a text encoder idle since the start of a pipeline's
call has its next use at the start of its own plan (distance 0), so its
streamed blocks left behind and its kept set stayed through every denoising
step, and the transformer's prefetches found no room (a Flux-shaped
pipeline on the CPU device: the T5's kept set held a fifth of the room, and
each single block was fetched on demand at every step). So a model that is
dormant for a prefetch (not the prefetched block's, no forward in flight,
not the one predicted to run next: `next_owner`) gives up its idle blocks,
kept ones too, as if their next use were furthest: they come back, on
demand or prefetched, when that model runs again. Models served in turn
keep theirs: the next one is never dormant.

[Note: eviction order]
`make_room` evicts idle blocks until the bytes asked for fit: streamed
blocks (not in their owner's kept set) first, then kept ones, and kept ones
only for a use that needs the room now, never for a prefetch. Within each
group, a block whose next use by its owner's schedule is furthest goes
first (Belady's choice, where the order is known), then the one used least
recently; with several models, blocks of a model with no forward in flight
go before those of one running.

The two groups are kept as blocks change (`became_idle` when the last pin
goes or a prefetch lands, `not_idle` when pinned or gone), not found by a
scan of the resident blocks at each call: `make_room` runs at every use
that needs room, and with a known order the idle streamed blocks are the
few the streaming window just released, whatever the model's size (a scan
made the host time of a use grow with the number of blocks: 77 us at 256
blocks on the CPU device, 42 us at 16). The kept group is only ranked for a
use that needs room now. A change of an owner's kept set (its
`kept_version`) sorts the idle blocks again, once. A prefetch of a model
alone on its engine (asked about once or twice at every streamed use: the
walk's next fetch, then the one after, which finds nothing further to
evict) makes the same choice by `_room_ahead`, without what only several
models need (dormant models, the ranking by whether a model runs, every
owner asked whether its blocks may leave): 657 -> 620 lines of pager's
code a use at 256 blocks on the CPU device (test_engine's count).
"""

from __future__ import annotations

from collections import deque
from typing import cast

from ..base.budget import format_bytes
from ..base.common import SHARE_WINDOW, BudgetError

INF = float("inf")


class Room:
    """What blocks may hold on the device, each model's share, and eviction.

    Args:
        engine: the `Engine` whose budget, owners and resident blocks it reads.
    """

    def __init__(self, engine):
        self.engine = engine
        self.requests: deque = deque(maxlen=SHARE_WINDOW)  # the owners of the last root forwards
        # The blocks that may leave, kept up to date as blocks are pinned,
        # unpinned, fetched and evicted ([Note: eviction order]).
        self.idle_streamed: dict = {}  # idle, not in their owner's kept set (an ordered set)
        self.idle_kept: dict = {}  # idle, in their owner's kept set
        self._sorted_for: dict = {}  # owner -> the `kept_version` of its scheduler the sets were sorted by

    # ---------------------------------------------------------- idle blocks
    def became_idle(self, block) -> None:
        """`block` is resident and no use pins it: it may leave from now on
        (unless it is resident for life)."""
        if block.resident_for_life or block in self.idle_streamed or block in self.idle_kept:
            return
        (self.idle_kept if block in block.owner.scheduler.kept else self.idle_streamed)[block] = None

    def not_idle(self, block) -> None:
        """`block` is pinned, has left, or stays for life: it may not leave now."""
        if self.idle_streamed.pop(block, 0) is not None:
            self.idle_kept.pop(block, None)

    def _sort_by_kept(self) -> None:
        """Sort the idle blocks again where an owner's kept set changed."""
        owners = self.engine.owners
        if all(self._sorted_for.get(o) == o.scheduler.kept_version for o in owners):
            return
        idle = {**self.idle_streamed, **self.idle_kept}
        self.idle_streamed = {b: None for b in idle if b not in b.owner.scheduler.kept}
        self.idle_kept = {b: None for b in idle if b in b.owner.scheduler.kept}
        self._sorted_for = {o: o.scheduler.kept_version for o in owners}

    def idle_blocks(self, protect=()) -> list:
        """The resident blocks that may leave now, but those in `protect`:
        not in use, not resident for life, their owner not running asleep.
        A scan (for the rare paths: out of memory, a new budget)."""
        blocked = self._blocked_owners()
        return [
            b
            for b in self.engine.resident
            if (b in self.idle_streamed or b in self.idle_kept) and b not in protect and b.owner not in blocked
        ]

    def _blocked_owners(self) -> list:
        """Owners none of whose blocks may leave now (a forward asleep):
        asked once per owner, not per block."""
        return [o for o in self.engine.owners if o.evictions_blocked()]

    def room_bytes(self) -> int:
        """What blocks may hold on the device: the budget, less what owners'
        activations take ([Note: one budget] in training/activations.py) or
        an update holds beside the pages while it runs, the larger
        ([Note: the step's room] in training/step_room.py), the
        state their forwards carry, their row caches and, under
        `budget_covers="process"`, what the process holds outside pager
        ([Note: a budget that covers the process] in model/outside.py), never less than
        the least that runs (the largest owner's `least_room`)."""
        owners = self.engine.owners
        if len(owners) == 1:  # (asked at every use that needs room: no lists made)
            owner = owners[0]
            acts = owner.activation_reserve_bytes()
            if (
                acts is None
                and not owner.step_bytes
                and not owner.carried_bytes
                and not owner.row_bytes
                and not owner.outside_bytes
            ):
                return self.usable_bytes()
            # (an update holds nothing of the activations' room while it runs: the larger of the two)
            reserved = max(acts or 0, owner.step_bytes) + owner.carried_bytes + owner.row_bytes + owner.outside_bytes
            return max(self.usable_bytes() - reserved, owner.least_room)
        reserves = [
            max(r or 0, o.step_bytes)
            for o, r in ((o, o.activation_reserve_bytes()) for o in owners)
            if r is not None or o.step_bytes
        ]
        reserves += [o.carried_bytes for o in owners if o.carried_bytes]
        reserves += [o.row_bytes for o in owners if o.row_bytes]
        outside = max((o.outside_bytes for o in owners), default=0)  # (each saw the same process: the most, once)
        if outside:
            reserves.append(outside)
        if not reserves:
            return self.usable_bytes()
        return max(self.usable_bytes() - sum(reserves), max(o.least_room for o in owners))

    def spare_bytes(self, owner) -> int:
        """What the budget holds beyond every block of every owner with all
        its pages, and beyond what else is reserved (`owner`'s carried state
        and row caches, other owners' activations): the room `owner` may keep
        activations in without taking any from blocks ([Note: activations,
        the automatic choice] in training/activations.py)."""
        others = sum(max(o.activation_reserve_bytes() or 0, o.step_bytes) for o in self.engine.owners if o is not owner)
        others += sum(o.carried_bytes + o.row_bytes for o in self.engine.owners)
        others += max((o.outside_bytes for o in self.engine.owners), default=0)
        return self.usable_bytes() - self.engine.total_bytes - others

    def usable_bytes(self) -> int:
        """The budget less the staging ring of compressed pages (if any), never
        less than the least room that runs."""
        staging = self.engine.transport.staging_bytes
        if not staging:
            return self.engine.budget_bytes
        return max(self.engine.budget_bytes - staging, max((o.least_room for o in self.engine.owners), default=0))

    def next_owner(self, owner):
        """The owner whose request is predicted to follow `owner`'s current
        one: the one that followed it last time (itself if none did)."""
        requests = self.requests
        for i in range(len(requests) - 2, -1, -1):
            if requests[i] is owner:
                return requests[i + 1] if requests[i + 1] in self.engine.owners else owner
        return owner

    def runs_in_turn(self, owner) -> bool:
        """Whether `owner`'s requests in the window are followed by another
        model's at least as often as by its own (models served in turn), not
        mostly by its own (a pipeline's denoising steps): then its kept set
        sits at the end of its plan ([Note: sharing the room])."""
        requests = self.requests
        own = other = 0
        for i in range(len(requests) - 1):
            if requests[i] is owner:
                if requests[i + 1] is owner:
                    own += 1
                else:
                    other += 1
        return other >= own

    def note_request(self, owner) -> None:
        """A root forward of `owner` starts: it counts towards its share of
        the room ([Note: sharing the room])."""
        if len(self.engine.owners) > 1:
            self.requests.append(owner)

    def kept_room(self, owner, fixed_bytes: int | None) -> int:
        """The room `owner` chooses its kept set in ([Note: sharing the
        room]); `fixed_bytes`: what it holds for life (needed only when
        sharing)."""
        room = self.room_bytes()
        if len(self.engine.owners) == 1:
            return room
        fixed = self.engine.fixed_bytes()
        window = 2 * max(
            (b.nbytes() for o in self.engine.owners for b in o.blocks if not b.resident_for_life), default=0
        )
        spare = max(0, room - fixed - window)
        weight = {o: 0 for o in self.engine.owners}
        for o in self.requests:
            if o in weight:
                weight[o] += o.total_bytes
        total = sum(weight.values())
        share = spare * weight[owner] // total if total else spare // len(self.engine.owners)
        return cast(int, fixed_bytes) + window + share  # (given whenever the room is shared)

    def make_room(self, nbytes: int, protect, within: int | None = None) -> bool:
        """Evict until `nbytes` more fit. With `within`, only evict blocks whose
        next use is further than `within` uses away (by their owner's
        schedule), and never kept ones. Looks only at idle blocks, streamed
        ones first: at a use in a repeating order, a few ([Note: eviction order])."""
        room = self.room_bytes()
        if self.engine.resident_bytes + nbytes <= room:
            return True
        self._sort_by_kept()
        if within is not None and len(self.engine.owners) == 1:
            return self._room_ahead(nbytes, protect, within, room)
        return self._room_among(nbytes, protect, within, room)

    def _room_among(self, nbytes: int, protect, within: int | None, room: int) -> bool:
        """`make_room`'s choice over every owner's idle blocks, `room` the
        room blocks have now ([Note: eviction order])."""
        several = len(self.engine.owners) > 1  # (alone, every block's owner is as busy as the others')
        dormant = self._dormant(protect) if several and within is not None else frozenset()
        if within is not None and not self.idle_streamed and not dormant:
            return False  # (a prefetch takes no kept block but a dormant model's: nothing may go)
        blocked = self._blocked_owners()
        usable = self.usable_bytes()
        if room < usable and within is None:
            # Activations crowd the blocks: what is in use must still run
            # (over the room, within the budget; the owner warns) rather than fail.
            # (a scan of the idle blocks: only for a use that needs room now)
            idle_bytes = sum(
                b.device_bytes()
                for g in (self.idle_streamed, self.idle_kept)
                for b in g
                if b not in protect and b.owner not in blocked
            )
            in_use = self.engine.resident_bytes - idle_bytes
            held = sum(o.step_bytes for o in self.engine.owners)  # (an update's: held now, not a reserve)
            room = min(usable - held, max(room, in_use + nbytes))
            if self.engine.resident_bytes + nbytes <= room:
                return True
        # Streamed blocks first, furthest next use first; kept ones only for a
        # use that needs the room now, or, for a prefetch, a dormant model's.
        for kept in (False, True):
            # (a dormant model's kept blocks listed only where the streamed ones did not make room)
            group = self.idle_streamed if not kept else self.idle_kept if within is None else self._kept_of(dormant)
            ranked = sorted(
                (
                    (
                        several and not b.owner.busy(),
                        INF if b.owner in dormant else b.owner.scheduler.distance_to(b),
                        -b.last_use_tick,
                        b,
                    )
                    for b in group
                    if b not in protect and b.owner not in blocked
                ),
                key=lambda r: r[:3],
                reverse=True,
            )
            for _idle, distance, _tick, b in ranked:
                if within is not None and distance <= within:
                    return False
                self.engine.evict(b)
                if self.engine.resident_bytes + nbytes <= room:
                    return True
        return False

    def _room_ahead(self, nbytes: int, protect, within: int, room: int) -> bool:
        """`make_room` for a prefetch of a model alone on its engine (at
        every streamed use): the general path's choice without what only
        several models need. Its idle streamed blocks (a few: [Note: eviction
        order]) whose next use is further than `within`, furthest first, then
        the least recently used, leave until `nbytes` more fit."""
        owner = self.engine.owners[0]
        if not self.idle_streamed or owner.evictions_blocked():
            return False
        distance_to = owner.scheduler.distance_to
        further = [
            (d, -b.last_use_tick, b) for b in self.idle_streamed if b not in protect and (d := distance_to(b)) > within
        ]
        if not further:
            return False
        further.sort(key=lambda r: r[:2], reverse=True)  # (stable, as the general path's: ties in the set's order)
        for _distance, _tick, b in further:
            self.engine.evict(b)
            if self.engine.resident_bytes + nbytes <= room:
                return True
        return False

    def _dormant(self, protect) -> frozenset:
        """The models whose blocks a prefetch for `protect`'s first block may
        take whatever their own schedules say ([Note: a dormant model's
        blocks]): neither its model, nor one with a forward in flight, nor the
        one predicted to run after it."""
        requester = protect[0].owner
        after = self.next_owner(requester)
        return frozenset(o for o in self.engine.owners if o is not requester and o is not after and not o.busy())

    def _kept_of(self, owners) -> list:
        """The idle blocks of `owners`' kept sets (few: a dormant model's)."""
        return [b for o in owners for b in o.scheduler.kept if b in self.idle_kept]

    def raise_no_room(self, block, missing: int, *, waited: float | None = None, deadlock: bool = False):
        """Raise the BudgetError for `block`, which needs `missing` bytes that
        the blocks in use (named in it) do not leave; `waited`: after waiting
        that long for them; `deadlock`: their threads all wait for room too."""
        pinned = [b for b in self.engine.resident if b.pins > 0 or b.resident_for_life or b.unaccounted_use]
        several = len(self.engine.owners) > 1
        held = ", ".join(
            f"{b.owner.name + ':' if several else ''}{b.name} ({format_bytes(b.device_bytes())}"
            f"{', views of it kept' if b.unaccounted_use and not b.pins else ''})"
            for b in pinned[:6]
        )
        acts = self.engine.budget_bytes - self.room_bytes()
        why = ""
        if waited is not None:
            why = (
                f" after waiting {waited:.1f} s for other requests to release them (wait_seconds="
                f"{self.engine.waiters.wait_seconds:g})"
            )
        elif deadlock:
            why = " by requests that all wait for room themselves (each holds blocks the others need)"
        raise BudgetError(
            f"pager: block {block.name!r} needs {format_bytes(missing)} more on {self.engine.device}, but "
            f"{format_bytes(self.engine.resident_bytes)} of the {format_bytes(self.engine.budget_bytes)} budget "
            "is held "
            f"by blocks in use{why}: {held}"
            + (
                f" (and activations or carried state such as a KV cache take {format_bytes(acts)} of it)"
                if acts > 0
                else ""
            )
            + ". Raise the budget, "
            + ("run fewer requests at once or allow a longer wait, " if why else "")
            + "or use smaller blocks (blocks=...)."
        )

    def forget(self, owner) -> None:
        """`owner` left the engine: its requests no longer count."""
        while owner in self.requests:
            self.requests.remove(owner)
