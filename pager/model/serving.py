"""Serving accesses to paged-out tensors: the blocks an access needs are
held on the device for its duration, then released. One `Serving` per
`Pager`. See [Note: paged-out tensors] in base/guards.py.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from ..base import guards, served
from ..base.budget import format_bytes
from ..base.common import EVERYONE

log = logging.getLogger("pager")
KINDS_ORDER = ("weights", "frozen", "grads", "state")


class Serving:
    """Accesses to a model's paged-out tensors, served: the blocks held on
    the device for the access, then released ([Note: paged-out tensors]).

    Args:
        pager: the model's `Pager` (its lock, uses and hooks).
    """

    def __init__(self, pager):
        self.pager = pager

    @contextmanager
    def serving(self, wanted: dict, expose: bool = False):
        """Hold the blocks in `wanted` ({block: kinds}) on the device for one
        access (their tensors stay guarded unless `expose`)."""
        pager = self.pager
        with pager.lock:
            pager.check_open()
            pager.uses.note_threads()
            # (a use waits for room other threads hold: [Note: waiting for room] in engine/waiting.py)
            held = self._acquire_all(wanted, EVERYONE if expose else False)
            pager.thread_state.serving = getattr(pager.thread_state, "serving", 0) + 1
        try:
            yield
        finally:
            with pager.lock:
                pager.thread_state.serving -= 1
                for block in held:
                    pager.uses.release(block)

    def _acquire_all(self, wanted: dict, expose) -> list:
        pager, held = self.pager, []
        try:
            for block, kinds in wanted.items():
                if (
                    block.part
                    and block.parent is not None
                    and block.parent.pins
                    and not block.parent.parts_merged
                    and pager.hooks.forward_marks()
                ):  # read during the parent's forward, not by another access
                    self._merge_parts(block.parent, block)
                kinds = tuple(k for k in KINDS_ORDER if k in kinds)
                missing = block.missing_bytes(kinds)
                pager.uses.acquire(block, kinds, record=False, expose=expose)
                held.append(block)
                if missing:
                    self._count_on_demand(block, missing)
        except BaseException:
            for block in held:
                pager.uses.release(block)
            raise
        return held

    def served(self, wanted: dict, result, writes: bool = False) -> None:
        """After an access: mark what it wrote dirty (some in-place ops, such as
        GradScaler's unscale, do not move version counters), remember views it
        handed out; if it built a graph, bring its blocks back before that
        graph's backward."""
        if writes:
            self.mark_written(wanted)
        for seg, t in served.aliases_in(result, wanted):
            guards.remember_alias(seg, t)
        if torch.is_grad_enabled():
            for block in wanted:
                # (a frozen block too: the backward of what it computed reads its weights)
                self.pager.hooks.register_pre_backward(block, result)

    @staticmethod
    def mark_written(wanted: dict) -> None:
        """The segments of `wanted` were written in place: write them back when
        they leave, whatever their version counters say (CUDA's foreach zero
        and GradScaler's unscale leave them alone)."""
        for block, kinds in wanted.items():
            for kind in kinds:
                seg = block.segments.get(kind)
                if seg is not None and seg.resident:
                    seg.force_dirty = True

    def _merge_parts(self, parent, part) -> None:
        """`parent`'s forward read `part`'s tensors without calling it: from its
        next use on, its parts are acquired (and prefetched) with it, as one
        block ([Note: splitting large blocks] in model/discover.py)."""
        # Taken up at the parent's next acquisition: it is pinned now, and its
        # release must let go of exactly what its acquisition took.
        parent.parts_merged = True
        self.pager.warn_once(
            f"merge:{parent.name}",
            "pager: the forward of block %r reads the tensors of %r without calling it; "
            "its parts are fetched together with it from now on (as one block).",
            parent.name,
            part.name,
        )

    def _count_on_demand(self, block, nbytes: int) -> None:
        block.stats.on_demand += 1
        self.pager.counters.on_demand += 1
        self.pager.warn_once(  # (once a model: `stats().on_demand` and each block's count the rest)
            "on_demand",
            "pager: a tensor of block %r was used while the block was paged out, "
            "so it was fetched on demand (%s; compute waits for the copy). This is how reads between steps "
            "(logging, EMA, a debugger) are served; in a hot loop, touch blocks' tensors inside their "
            "forward, or raise the budget so they stay resident. Later ones are counted in "
            "stats().on_demand, not logged.",
            block.name,
            format_bytes(nbytes),
        )
