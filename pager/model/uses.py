"""What a use of a block does: `Uses`, one per wrapped model.

A use pins a block (and the blocks it borrows tied tensors from) on the
device: the engine brings its pages, compute waits for them, its tensors are
opened to the threads using it, updates deferred to this use run, and its
gradients are exposed. Releasing it unpins it, guards its tensors again and
marks its last use for the copy stream. Views of its weights that a use leaves
behind are tracked here ([Note: views kept from a use] in base/views.py).
"""

from __future__ import annotations

import time
from itertools import chain

from ..base import guards, saving, views
from ..base.block import Block
from ..base.common import EVERYONE, STEP, WEIGHTS, _record_range
from ..base.threads import other_threads


class Uses:
    """Acquire and release a model's blocks for compute, and what rides on a use.

    Args:
        pager: the model's `Pager` (its engine, hooks, scheduler, counters).

    Example (inside pager; the hooks do this around a block's forward):
        >>> uses.acquire(block, WEIGHTS)
        >>> ...  # the block's forward
        >>> uses.release(block)
    """

    def __init__(self, pager):
        self.pager = pager
        self.engine = pager.engine
        self._tick = 0  # uses so far: each block's `last_use_tick` orders them

    def acquire(self, block: Block, kinds, record: bool = True, expose=True) -> None:
        """Make `kinds` of `block` (and its deps) usable by compute; pin them.
        With `expose`, its tensors are open to this thread while it stays
        pinned (a use; `EVERYONE`: they get their own class whatever the
        threads); a served access keeps them guarded ([Note: paged-out tensors]).

        On failure nothing stays pinned."""
        if block.parts_merged and block.pins == 0 and not block.merged_deps:
            block.merged_deps = True  # its parts come with it from now on (Serving._merge_parts)
            block.deps = block.deps + [
                b for b in self.pager.blocks if b.part and b.parent is block and b not in block.deps
            ]
            self.pager.prefetch_frontier.reset()  # (a walk skips blocks with none: [Note: the prefetch frontier])
        done = []
        try:
            for dep in block.deps:
                self.acquire(dep, kinds, record, expose)
                done.append(dep)
            self._acquire_one(block, kinds, record, expose)
        except BaseException:
            for dep in done:
                self.release(dep)
            raise

    def _acquire_one(self, block: Block, kinds, record: bool, expose) -> None:
        if "grads" in kinds:
            self.pager.grad_pages.ensure_segment(block)
        if record:
            if (
                self.pager.steps.recording()
            ):  # (not another request's: [Note: one recorded request at a time] in model/steps.py)
                self.pager.scheduler.observe(block, kinds)
            self.pager.direct_calls.unguard(block)  # used through its own hooks: guards not needed while resident
        if block.deferred_steps:
            kinds = STEP  # its pending update runs first: it needs gradients and state too
        miss = self.engine.bring(block, kinds, all_resident=self.pager.all_resident)
        if record:
            self._count_use(block, miss=miss)
        if expose or block.deferred_steps:
            # (the optimizer's update runs on the tensors themselves)
            self.expose(block, everyone=expose == EVERYONE)
        if block.deferred_steps:
            self.run_deferred(block)
            if not expose and block.pins == 1:
                self.guard_idle(block)
        self.pager.grad_pages.expose(block)
        self.pager.grad_pages.apply_pending(block)
        if block.pins == 1:
            block.compute_start = self.pager.tracer.stamp()
        self._tick += 1
        block.last_use_tick = self._tick
        block.settled = True

    def can_use_resident(self, block: Block) -> bool:
        """True when a forward use of `block` is bookkeeping only.

        [Note: the resident fast path]
        When every page of every block is on the device, this block has been
        acquired since its last fetch (compute waited, gradients exposed,
        pending scaling applied) and it has no deps, deferred update or trace
        to keep, acquiring it changes nothing but counters: `use_resident`
        does just that. A model that fits its budget then pays for two hook
        calls per block and no CUDA call."""
        return (
            self.pager.all_resident
            and block.settled
            and not block.deps
            and not block.deferred_steps
            and not self.pager.tracer.enabled
        )

    def use_resident(self, block: Block) -> None:
        if self.pager.steps.recording():
            self.pager.scheduler.observe(block, WEIGHTS)
        self.pager.direct_calls.unguard(block)
        self.engine.pin(block)
        self.expose(block)
        self._count_use(block, miss=False)
        self._tick += 1
        block.last_use_tick = self._tick

    def _count_use(self, block: Block, miss: bool) -> None:
        block.uses += 1
        if miss:
            block.stats.misses += 1
            self.pager.counters.misses += 1
            self.pager.steps.step_misses += 1
        else:
            block.stats.hits += 1
            self.pager.counters.hits += 1

    def expose(self, block: Block, everyone: bool = False) -> None:
        """Its resident tensors are open to the threads using it: they get
        their own class, only while it is in use (see [Note: paged-out
        tensors] in base/guards.py). With other threads about, they keep the guard
        and only the threads that pinned the block pass it unserved ([Note:
        tensors and threads] in base/served.py); `everyone` (the pager going to sleep) gives
        them their own class all the same."""
        if not everyone:
            self.note_threads()
        for seg in block.segments.values():
            if seg.resident and not seg.exposed:
                if self.pager.shared_mode and not everyone:
                    guards.open_to_pinning_threads(seg)
                else:
                    guards.expose(seg)

    def note_threads(self) -> None:
        """Enter the shared mode once a second Python thread exists; blocks in
        use then stop being exposed to every thread ([Note: tensors and threads] in base/served.py)."""
        if self.pager.shared_mode or not other_threads():
            return
        self.pager.shared_mode = True
        for block in self.pager.all_blocks():
            if block.resident_for_life:
                continue
            for seg in block.segments.values():
                if seg.exposed:
                    guards.guard(seg)
                    if block.pins > 0 and seg.resident:
                        guards.open_to_pinning_threads(seg)

    def guard_idle(self, block: Block) -> None:
        if not block.resident_for_life:
            for seg in block.segments.values():
                guards.guard(seg)

    def run_deferred(self, block: Block, make_room: bool = True) -> None:
        """Apply the optimizer updates deferred to this use of `block` (resident,
        compute ordered after its fetch), oldest first; `make_room`: for
        their temporaries (`OptimizerLink.apply`)."""
        with _record_range("deferred_step", block.name):
            while block.deferred_steps:
                d = block.deferred_steps[0]
                d.link.apply(block, d, make_room)
                block.deferred_steps.pop(0)

    def apply_deferred(self, blocks) -> None:
        """Every update of `blocks` deferred to their next use, applied now
        (`Pager.apply_deferred`; the lock held), after the updates running
        on the host and the owners' ones."""
        self.pager.host_steps.wait_all()  # (updates running on the host: [Note: the optimizer step on the host])
        if self.pager.owners is not None:
            self.pager.owners.wait_all()  # (updates by the blocks' owners: [Note: block owners])
        for block in blocks:
            if block.deferred_steps:
                self.acquire(block, STEP, record=False)
                self.release(block)

    def release(self, block: Block) -> None:
        for dep in block.deps:
            self.release(dep)
        self.engine.unpin(block)
        if block.pins == 0:
            if not self.pager.asleep:
                self.guard_idle(block)  # from now on, accesses from outside are served
            # Everything on the device: nothing is fetched and nothing evicted;
            # an eviction after all (set_budget, a new segment) orders itself
            # after a fresh event. Saves an event per use.
            traced = self.pager.tracer.enabled
            self.engine.idle(block, mark=traced or not self.pager.all_resident, timed=traced)
            if traced:
                end = block.last_use_event if self.pager.transport.is_cuda else time.perf_counter()
                self.pager.tracer.span("compute", block.name, block.compute_start, end)

    def track_kept_views(self, block: Block, places, use) -> None:
        """Remember views of `block`'s weights that its use left behind (an
        output, an attribute, a list a hook keeps): they are guarded with the
        block from now on. See [Note: views kept from a use] in base/views.py."""
        segs = block.weight_segments
        if block.module is None or block.resident_for_life or not segs or not segs[0].resident:
            return
        for seg in segs:
            if views.has_unknown_views(seg, use):
                break
        else:
            return  # (the common case, a reference count a segment: no view beyond what this kind of use leaves)
        # Alone, every object is searched, and what stays unaccounted for is
        # autograd's (learned). With other threads, what stays unaccounted for
        # is a view kept where pager cannot look (autograd's are counted: see
        # [Note: autograd's saved views, counted] in base/saving.py), or autograd's where they
        # could not be counted: either way the block must stay while they live.
        # Under other saved-tensor hooks (checkpointing's recomputation in the
        # backward) the excess is what they hold, found by a search too: so no
        # search, and the block stays while the excess lives (its backward).
        alone = not other_threads()
        searchable = alone and use[-1] != saving.OTHERS
        found, unaccounted = views.track_kept_views(
            segs, chain(places, block.module.modules()), use, search_all=searchable, learn=searchable
        )
        if found:
            self.pager.warn_once(
                f"kept:{block.name}",
                "pager: a view of the weights of block %r was kept from its %s (an output, "
                "an attribute or a list that holds it); it is served from now on, and fetches the block on "
                "demand once the block has left. Keep a copy (`.clone()`) to avoid the fetches.",
                block.name,
                use[0],
            )
        if unaccounted and not searchable:
            block.unaccounted_use = use  # checked again when it is to leave (see [Note: views kept from a use])

    def keeps_unknown_views(self, block: Block) -> bool:
        """Chosen to leave: are views of its weights still unaccounted for
        since a use with other threads about? Then it must stay."""
        use = block.unaccounted_use
        if use is None:
            return False
        if any(views.has_unknown_views(w, use) for w in block.weight_segments):
            self.pager.warn_once(
                f"kept-stays:{block.name}",
                "pager: block %r stays on the device while views of its weights kept "
                "from its %s exist somewhere pager cannot search while other threads run (or autograd's saved "
                "views, which pager cannot count under other saved-tensor hooks or before torch 2.8). Keep "
                "copies (`.clone()`) of what a forward keeps.",
                block.name,
                use[0],
            )
            return True
        block.unaccounted_use = None
        return False

    def may_leave(self, block: Block) -> bool:
        """`block` was chosen to leave: False if it must stay (views of it kept
        where pager cannot look); a deferred update whose bytes are here is
        applied now, as this thread's use."""
        if self.pager.asleep:
            # (no sleeping forward runs: evictions wait for it) guard the idle tensors first
            self.pager.hooks.sleep.wake()
        if self.keeps_unknown_views(block):
            return False
        if block.deferred_steps and not block.missing_bytes(STEP):
            # Prefetched for an update, but leaving unused: the bytes are here, so
            # apply it now (a gradient the user sets meanwhile must not overwrite its page).
            self.engine.wait(block)
            self.engine.pin(block)  # the update is this thread's use (in the shared mode, what lets it pass the guard)
            try:
                self.expose(block)  # (guarded again as it leaves)
                self.run_deferred(block, make_room=False)  # (room is being made: this block's own leaves next)
            finally:
                self.engine.unpin(block)
        return True
