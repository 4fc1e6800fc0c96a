"""Direct calls into a paged-out block: a module inside a block, called on
its own (not through the block), fetches the block for the call instead of
reading freed memory. `DirectCalls`, one per wrapped model."""

from __future__ import annotations

import torch

from ..base.block import Block
from ..base.common import WEIGHTS, model_hook
from ..training.dry_run import dry_running


class DirectCalls:
    """Guards on the modules inside each block, on while the block is paged out.

    Args:
        pager: the model's `Pager` (its blocks, lock, uses and hooks).
    """

    def __init__(self, pager):
        self.pager = pager
        self.uses = pager.uses

    def install(self) -> None:
        """Guards for a module inside a block called on its own (not through
        the block): it fetches the block for the call instead of reading freed
        memory.

        [Note: guards only while paged out]
        A hook makes every call of its module take PyTorch's slow path (~10 us),
        and a direct call on a resident block is safe anyway. So a block's
        guards are installed when it is evicted and removed when it is next
        used through its own hooks: a model that stays resident pays nothing."""
        block_of = {id(b.module): b for b in self.pager.blocks}
        for block in self.pager.blocks:
            stack = [block.module]
            while stack:
                for child in stack.pop().children():
                    if id(child) in block_of:
                        continue  # a nested block has its own hooks
                    stack.append(child)
                    if child._parameters or child._buffers:
                        held: list = []
                        # (wrapped once: an eviction registers the same hooks again, no new wrapper each time)
                        # ([Note: a wrapped model is not pickled or copied])
                        pre, post = self._make_inner_pre(block, held), self._make_inner_post(block, held)
                        block.guards.append((child, model_hook(pre), model_hook(post)))
            self.guard(block)

    def _make_inner_pre(self, block: Block, held: list):
        def inner_pre(module, args):
            if dry_running():  # (a measure on fake tensors: nothing to fetch)
                return
            if block.pins > 0:  # called from within its block
                held.append(False)
                return
            with self.pager.lock:
                self.uses.acquire(block, WEIGHTS, record=False)
            held.append(True)

        return inner_pre

    def _make_inner_post(self, block: Block, held: list):
        def inner_post(module, args, output):
            if dry_running():
                return
            if held and held.pop():
                with self.pager.lock:
                    self.uses.release(block)
                    if torch.is_grad_enabled():
                        self.pager.hooks.register_pre_backward(block, output)

        return inner_post

    def guard(self, block: Block) -> None:
        if block.guard_handles is None:
            block.guard_handles = [
                h
                for module, pre, post in block.guards
                for h in (
                    module.register_forward_pre_hook(pre),
                    module.register_forward_hook(post, always_call=True),
                )
            ]

    def unguard(self, block: Block) -> None:
        if block.guard_handles is not None:
            for h in block.guard_handles:
                h.remove()
            block.guard_handles = None
