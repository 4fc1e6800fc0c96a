"""The pages of a model's gradients: `GradPages`, one per wrapped model.

A block's gradients live in its "grads" segment, made at its first backward
(`ensure_segment`). While the block is resident, `param.grad` is the device
view of its slot; when it leaves, it becomes a `PagedOutGrad` ([Note: a
stand-in for gradients that are not on the device] in training/grads.py),
and comes back at the block's next use, with the operations recorded
meanwhile replayed (`apply_pending`).
"""

from __future__ import annotations

import torch

from ..base import guards
from ..base.block import Block, PageState, Segment
from ..base.common import _locked
from .grads import PagedOutGrad, replay


class GradPages:
    """Gradients into and out of their pages, for one model's blocks.

    Args:
        pager: the model's `Pager` (it makes segments and maps parameters to slots).
    """

    def __init__(self, pager):
        self.pager = pager
        self.lock = pager.lock  # (for `_locked`) the engine's, shared by its models
        self.dropped_bytes = 0  # of grads pages dropped empty and not made again since

    def ensure_segment(self, block: Block) -> None:
        if "grads" in block.segments or not block.trainable:
            return  # (made already; or none of its parameters requires grad, as wrap found and keeps it)
        trainable = [(n, p) for n, p in zip(block.param_names, block.params) if p.requires_grad]
        if not trainable:
            return
        seg = self.pager.new_segment(block, "grads", trainable)
        seg.params = [p for _n, p in trainable]
        seg.names = [n for n, _p in trainable]
        for i, p in enumerate(seg.params):
            self.pager.grad_slots[id(p)] = (block, i)

    def arriving(self, block: Block, seg: Segment) -> None:
        """Before fetching a grads page: is any gradient in it still wanted?

        [Note: gradients are exposed only after compute waits]
        A fetch (often a prefetch) only copies the page in; `param.grad` stays
        a PagedOutGrad until the block is acquired and compute has waited on the
        copy (`expose`). Otherwise user code between a prefetch and the
        use (zero_grad(set_to_none=False), a read) would race the copy."""
        if seg.dropped:  # made again: see only_empty_pages_out
            seg.dropped = False
            self.dropped_bytes -= seg.nbytes
        present = False
        for i, p in enumerate(seg.params):
            if isinstance(p.grad, PagedOutGrad) and p.grad.segment is seg:
                present = True
            else:
                seg.pending.pop(i, None)
        seg.host_valid = present or bool(block.deferred_steps)  # a deferred update reads the page
        if not seg.host_valid:
            seg.summaries = {}  # the device copy will hold no gradient worth describing

    def drop_unset(self) -> None:
        """[Note: gradients set to None leave the device]
        `zero_grad()` (set_to_none=True) tells autograd to start the next
        gradients afresh, and frees them in the unwrapped model, so that the
        forward's activations have their room. A resident block keeps its
        grads page, so at a budget that holds everything the forward would
        peak higher than the unwrapped model by every gradient. So at each
        training forward of a model whose pages are all on the device, the
        grads pages of blocks not in use (the remainder too) whose gradients
        are all None are dropped (no write-back, their pages marked empty);
        the model then trains asleep with its gradients outside their pages
        (the Note below). Where blocks stream, the budget bounds the peak and
        nothing is dropped: a dropped page would come back at the backward,
        taking room from blocks fetched ahead. (A pending deferred update
        reads its page: such a page stays.)"""
        pager = self.pager
        if not self.only_empty_pages_out():
            return  # blocks stream: the budget bounds the peak, and their pages come and go anyway
        with guards.unguarded():  # (reading .grad of idle blocks' parameters: no guard to pass)
            for block in [b for b in pager.engine.resident if b.owner is pager]:
                seg = block.segments.get("grads")
                if (
                    seg is not None
                    and seg.resident
                    and block.pins == block.resident_for_life  # (not in use)
                    and not block.deferred_steps
                    and all(p.grad is None for p in seg.params)
                ):
                    pager.engine.drop(block, seg)
                    seg.dropped = True
                    self.dropped_bytes += seg.nbytes

    # [Note: gradients outside their pages, asleep]
    # A pager may sleep through a training step with grads pages dropped
    # (`only_empty_pages_out`): every other page is on the device, and the
    # room the dropped pages left is the room their gradients take, so
    # gradients stay where autograd makes them (`on_grad`), as in the
    # unwrapped model, and the step reads them there. When the pager wakes
    # (a forward that needs the hooks, a block chosen to leave), they move
    # into their pages (`adopt_outside`) before anything may leave. (Asleep
    # training needs the model alone on its engine, so that room is there.)
    def only_empty_pages_out(self) -> bool:
        """Every page of the model is on the device but grads pages dropped
        empty (none dropped: every page)."""
        return self.pager.resident_bytes + self.dropped_bytes == self.pager.total_bytes

    def adopt_outside(self) -> None:
        """Gradients autograd made while the pager slept into their pages (see the Note)."""
        pager = self.pager
        for block in pager.all_blocks():
            seg = block.segments.get("grads")
            if seg is None or seg.resident or not _outside(seg):
                continue
            pager.uses.acquire(block, ("grads",), record=False)
            try:
                self.gather(seg)
            finally:
                pager.uses.release(block)

    def expose(self, block: Block) -> None:
        seg = block.segments.get("grads")
        if seg is None or not seg.resident:
            return
        for i, p in enumerate(seg.params):
            if isinstance(p.grad, PagedOutGrad) and p.grad.segment is seg:
                p.grad = seg.tensors[i]

    def apply_pending(self, block: Block) -> None:
        seg = block.segments.get("grads")
        if seg is None or not seg.resident or not seg.pending:
            return
        with torch.no_grad(), guards.unguarded():
            for i, ops in seg.pending.items():
                if seg.params[i].grad is seg.tensors[i]:
                    replay(seg.tensors[i], ops)
        seg.pending.clear()

    def gather(self, seg: Segment) -> None:
        """Bring gradients that autograd or the user put elsewhere into the page."""
        for i, p in enumerate(seg.params):
            g = p.grad
            if g is not None and g is not seg.tensors[i] and not isinstance(g, PagedOutGrad):
                with torch.no_grad(), guards.unguarded():
                    seg.tensors[i].copy_(g)
                p.grad = seg.tensors[i]

    def page_out(self, block: Block, seg: Segment) -> None:
        present = False
        for i, p in enumerate(seg.params):
            if p.grad is seg.tensors[i]:
                p.grad = PagedOutGrad(p, seg.names[i], self.pager, block, seg, i)
                present = True
            elif isinstance(p.grad, PagedOutGrad) and p.grad.segment is seg:
                present = True  # fetched but never exposed: the page still holds it
        seg.host_valid = present or bool(block.deferred_steps)

    def on_grad(self, param: torch.Tensor) -> None:
        """A gradient of `param` accumulated (its post-accumulate-grad hook): into its page."""
        slot = self.pager.grad_slots.get(id(param))
        if slot is not None:
            seg = slot[0].segments["grads"]
            if self.pager.asleep and not seg.resident and not seg.host_valid:
                return  # its page was dropped: the gradient stays as autograd made it ([Note: gradients outside ...])
            if seg.state is PageState.RESIDENT:
                view, grad = seg.tensors[slot[1]], param.grad
                if grad is view:
                    return  # accumulated in its page (held by this backward: nothing to change)
                if self.pager.asleep and seg.exposed and not torch.is_grad_enabled():
                    view.copy_(grad)  # (nothing leaves while the pager sleeps: no lock, no acquire)
                    param.grad = view
                    return
        self._into_page(param)

    @_locked
    def _into_page(self, param: torch.Tensor) -> None:
        block, i = self.pager.grad_slots.get(id(param), (None, None))
        if block is None:
            block = self.pager.param_blocks[id(param)]
            if "grads" in block.segments:
                raise RuntimeError(unfrozen_message(block, param))
            self.ensure_segment(block)
            block, i = self.pager.grad_slots[id(param)]
        seg = block.segments["grads"]
        acquired = not seg.resident  # a gradient for a block not acquired for backward
        if acquired:
            self.pager.uses.acquire(block, ("grads",), record=False)
        try:
            view = seg.tensors[i]
            if param.grad is not view:
                with torch.no_grad(), guards.unguarded():
                    view.copy_(param.grad)
                param.grad = view
        finally:
            if acquired:
                self.pager.uses.release(block)


def _outside(seg: Segment) -> bool:
    """Some gradient of `seg` is a tensor of autograd's, not in its page."""
    return any(
        p.grad is not None and not isinstance(p.grad, PagedOutGrad) and p.grad is not t
        for p, t in zip(seg.params, seg.tensors)
    )


def unfrozen_message(block, param) -> str:
    """The error for a gradient of a parameter that did not require grad when
    its block's gradient page was laid out (at the block's first backward)."""
    name = next((n for n, p in zip(block.param_names, block.params) if p is param), "?")
    return (
        f"pager: {name!r} (block {block.name!r}) has a gradient, but it did not require grad when the "
        f"block's gradient page was laid out, at its first backward; the page has no room for it. To change "
        f"which parameters train after training started, unwrap and wrap again: pager.unwrap(model), set "
        f"requires_grad, then pager.wrap(model, ...) (the optimizer keeps its state; it is attached again at "
        f"its next step). Parameters unfrozen before their block's first backward need nothing."
    )
