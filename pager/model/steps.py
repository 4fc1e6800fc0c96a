"""The step boundary of one wrapped model: `Steps`.

A step begins with a root forward that no other forward of the model
overlaps (or, with several threads, with the forward of the thread that
records it). Then the scheduler's recording of the last step becomes the
plan, the kept set is chosen again for the room there is, and advice that
needs a few steps of history is given. The end of each request counts the
state it carried on the device (a KV cache) against the budget.
"""

from __future__ import annotations

import threading
import time

import torch

from ..base.budget import format_bytes
from ..base.common import NEVER_RAN_STEPS, STALL_SHARE, STALL_WINDOW_STEPS
from .carried import carried_bytes
from .step_needs import least_room_bytes


class Steps:
    """Where one step ends and the next begins, and what changes there.

    Args:
        pager: the model's `Pager` (its scheduler, engine, counters).
    """

    def __init__(self, pager):
        self.pager = pager
        self.recorder = None  # the thread whose forward this step records ([Note: one recorded request at a time])
        self.step_misses = 0
        self.expect_used = False  # `expect` was called this step
        self._unsaid_change = False  # the last step's order changed, unannounced, with misses
        self._kept_key = None  # what the kept set was chosen for (start_step)
        self._window = (time.perf_counter(), 0.0)  # (start, stall seconds at start)
        self._least_room_of = None  # the total_bytes that `pager.least_room` was computed for
        self._bytes_at_start = 0  # the total_bytes at the last step's start

    def start_step(self) -> None:
        """A new step begins: the last one's order becomes the plan, the kept set is chosen again."""
        self.recorder = threading.get_ident()  # [Note: one recorded request at a time]
        self.pager.tracer.new_step()
        changed = self.pager.scheduler.start_step()
        if changed:
            self.pager.counters.order_changes += 1
        # A change that costs fetches on demand two steps running is a pattern.
        # A step in which pages appeared (optimizer state made by the first
        # update, gradients by the first backward) is no part of one: with
        # gradient accumulation the first update's uses fall in one step of
        # several passes, and the next pass differs from it once only. (A
        # supernet's candidate that first runs makes pages too: its step does
        # not count, which delays the advice until each has run once.)
        grew, self._bytes_at_start = self.pager.total_bytes != self._bytes_at_start, self.pager.total_bytes
        unsaid = changed and self.step_misses > 0 and not self.expect_used and not grew
        if unsaid and self._unsaid_change:
            self.pager.warn_once(
                "order",
                "pager: the order of blocks changed between steps (%d fetches on demand in the last "
                "step); if it changes every step (a NAS supernet's sampled path), say what comes next with "
                "pager.of(model).expect(modules) so it is prefetched.",
                self.step_misses,
            )
        self._unsaid_change = unsaid
        self.step_misses, self.expect_used = 0, False
        self._advise()
        # The kept set depends on the plan, the room for blocks and the
        # blocks' sizes: chosen again only when one of them changed (the room
        # in steps of 1/64 of the budget: activations vary a little by pass).
        if self._least_room_of != self.pager.total_bytes:  # a segment appeared (grads, optimizer state)
            self.pager.least_room, self._least_room_of = least_room_bytes(self.pager), self.pager.total_bytes
        # With other models on the engine, in this one's share of the room
        # ([Note: sharing the room] in engine/room.py).
        engine = self.pager.engine
        shared = len(engine.owners) > 1
        fixed = self.pager.fixed_bytes() if shared else None
        room = engine.room.kept_room(self.pager, fixed)
        step = room * 64 // max(self.pager.budget_bytes, 1)
        # Sharing with models served in turn: kept blocks last, so that a request's kept tail overlaps the
        # next request's fetches ([Note: sharing the room] in engine/room.py); alone, or where the model
        # mostly follows itself (a pipeline's denoising steps), inference spreads them out ([Note: kept
        # blocks spread out] in engine/schedule.py).
        if shared and engine.room.runs_in_turn(self.pager):
            order = "late"
        else:
            order = "spread" if self.pager.scheduler.reads_only() else "early"
        key = (len(self.pager.scheduler.plan), self.pager.budget_bytes, step, self.pager.total_bytes, order)
        if self.pager.carried_bytes:
            # A KV cache grows at every token: the kept set is chosen for the
            # least room of this step of 1/64, so that it (and the streaming
            # window) still fits when the cache has grown up to the next step,
            # where it is chosen again (else prefetches find no room and
            # blocks are fetched on demand until then).
            room = min(room, step * self.pager.budget_bytes // 64)
        if changed or key != self._kept_key:
            self.pager.scheduler.choose_kept(
                room, lambda b: b.nbytes(), fixed if fixed is not None else self.pager.fixed_bytes(), order
            )
            self._kept_key = key
            self._warn_if_activations_crowd(room)
        self.pager.counters.steps += 1

    def _warn_if_activations_crowd(self, room: int) -> None:
        reserve = 0 if self.pager.activations is None else self.pager.activations.ledger.reserve()
        if not reserve or self.pager.budget_bytes - reserve >= self.pager.least_room:
            return  # (no activations held: inference, or what else crowds blocks is named where it is seen)
        self.pager.warn_once(
            "activations_crowd",
            "pager: activations held %s on the device in the last training pass, which leaves "
            "less of the %s budget than the %s that blocks need at least; blocks take that much anyway, so the "
            'step exceeds the budget. Raise the budget, use activations="recompute" (it holds least), or '
            "a smaller batch.",
            format_bytes(reserve),
            format_bytes(self.pager.budget_bytes),
            format_bytes(self.pager.least_room),
        )

    def _advise(self) -> None:
        """Warnings that need a few steps of history (each at most once)."""
        steps = self.pager.counters.steps
        if steps == NEVER_RAN_STEPS + 1:
            idle = [b for b in self.pager.blocks if b.uses == 0]
            if idle:
                self.pager.warn_once(
                    "never_ran",
                    "pager: %d block(s) never ran in %d steps (%s%s), holding %s of host pages; if "
                    "they are unused, leave them out of the model (NAS candidates not yet sampled are expected).",
                    len(idle),
                    NEVER_RAN_STEPS,
                    ", ".join(b.name for b in idle[:4]),
                    ", ..." if len(idle) > 4 else "",
                    format_bytes(sum(b.nbytes() for b in idle)),
                )
        # Stalls are judged over windows of steps, the first one starting after
        # the first step (whose fetches are the unavoidable cold start).
        if steps == 2 or (steps > 2 and (steps - 2) % STALL_WINDOW_STEPS == 0):
            if self.pager.transport.is_cuda:
                self.pager.engine.meter.resolve(wait=False)
            start, stall_at_start = self._window
            now, stall = time.perf_counter(), self.pager.counters.stall_seconds
            if steps > 2 and now > start and stall - stall_at_start > STALL_SHARE * (now - start):
                self.pager.warn_once(
                    "stalls",
                    "pager: compute waited for transfers %.0f%% of the last %d steps; a larger budget "
                    "keeps more blocks resident (pager.plan(model, budget) shows what moves), and smaller blocks "
                    "(blocks=...) overlap better.",
                    100 * (stall - stall_at_start) / (now - start),
                    STALL_WINDOW_STEPS,
                )
            self._window = (now, stall)

    # [Note: one recorded request at a time]
    # A step's recording is the order of one forward (and what follows it),
    # the plan of the next. Forwards of one model from several threads (a
    # server's requests) interleave block by block: recorded together, the
    # plan is a mix of two orders, and when the model is never idle (some
    # forward always in flight, so the root depth never returns to 0) no
    # step ever starts and the recording grows without bound. So the thread
    # whose forward starts a step is its recorder; another thread's forward
    # that starts while a recorded one is in flight runs unrecorded (its uses
    # are counted, not observed), and one that starts while none is starts
    # the next step.
    def another_request(self) -> None:
        """A thread's forward starts while other forwards of this model run."""
        if self.recorder is None:
            self.start_step()
        else:
            self.pager.thread_state.unrecorded = True

    def expect(self, modules) -> None:
        """The next forward uses the blocks of `modules`, in that order
        (`Pager.expect`): the scheduler plans for that path."""
        by_module = {id(b.module): b for b in self.pager.blocks}
        path = []
        for m in modules:
            if id(m) not in by_module:
                raise ValueError(
                    f"pager: expect() got a {type(m).__name__} that is not a block of this model; "
                    f"pass block modules (pager.of(model).block_names() lists them)."
                )
            path.append(by_module[id(m)])
        self.pager.scheduler.expect_path(path, training=torch.is_grad_enabled())
        self.expect_used = True

    def recording(self) -> bool:
        """Uses on this thread go into the step's recording."""
        return not getattr(self.pager.thread_state, "unrecorded", False)

    def note_carried(self, args, kwargs) -> None:
        """The state this forward carried on the device counts against the
        budget from now on ([Note: carried state] in model/carried.py)."""
        nbytes = carried_bytes((*args, *kwargs.values()), self.pager.device.type)
        if nbytes != self.pager.carried_bytes:
            grew = nbytes > self.pager.carried_bytes
            self.pager.carried_bytes = nbytes
            self.pager.counters.peak_carried_bytes = max(self.pager.counters.peak_carried_bytes, nbytes)
            if grew:
                self.pager.engine.room.make_room(0, protect=())  # idle blocks leave until blocks and state fit
            if self.pager.budget_bytes < self.pager.least_room + nbytes:
                self.pager.warn_once(
                    "carried_crowd",
                    "pager: the state a forward carries on the device (a KV cache: %s) leaves "
                    "less of the %s budget than the %s that blocks need at least; blocks take that much anyway, "
                    "so the model holds more than the budget. Raise the budget, or use a smaller batch or a "
                    "shorter context.",
                    format_bytes(nbytes),
                    format_bytes(self.pager.budget_bytes),
                    format_bytes(self.pager.least_room),
                )
