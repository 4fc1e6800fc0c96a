"""Direct calls into a paged-out block: a module inside a block, called on
its own (not through the block), fetches the block for the call instead of
reading freed memory. `DirectCalls`, one per wrapped model."""

from __future__ import annotations

import torch

from ..base.block import Block
from ..base.common import WEIGHTS, dry_running, model_hook


class DirectCalls:
    """Guards on the modules inside each block, on while the block is paged out.

    Args:
        pager: the model's `Pager` (its blocks, lock, uses and hooks).
    """

    def __init__(self, pager):
        self.pager = pager
        self.uses = pager.uses
        # Blocks a direct call holds (pinned by a guard), and how many calls: their guards stay on meanwhile,
        # else the call's end would find its post-hook gone and never release the block.
        self.calls_open: dict[Block, int] = {}

    def install(self) -> None:
        """Guards for a module inside a block called on its own (not through
        the block): it fetches the block for the call instead of reading freed
        memory.

        [Note: guards only while paged out]
        A hook makes every call of its module take PyTorch's slow path (~10 us),
        and a direct call on a resident block is safe anyway. So a block's
        guards are installed when it is evicted and removed when it is next
        used through its own hooks: a model that stays resident pays nothing.
        Not while a direct call into it is open (another thread's, which
        holds it): that call's post-hook releases it, so the guards stay on
        until a use after it (`calls_open`)."""
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
                        # ([Note: a wrapped model is not pickled or copied])
                        pre, post = self._make_inner_pre(block, held), self._make_inner_post(block, held)
                        block.guards.append(InnerGuard(child, model_hook(pre), model_hook(post)))
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
                self.calls_open[block] = self.calls_open.get(block, 0) + 1
            held.append(True)

        return inner_pre

    def _make_inner_post(self, block: Block, held: list):
        def inner_post(module, args, output):
            if dry_running():
                return
            if held and held.pop():
                with self.pager.lock:
                    left = self.calls_open.pop(block) - 1
                    if left:
                        self.calls_open[block] = left
                    self.uses.release(block)
                    if torch.is_grad_enabled():
                        self.pager.hooks.register_pre_backward(block, output)

        return inner_post

    def guard(self, block: Block) -> None:
        if not block.guarded:
            for guard in block.guards:
                guard.on()
            block.guarded = True

    def unguard(self, block: Block) -> None:
        """Its guards off (it is used through its own hooks), but while a
        direct call into it is open (in another thread)."""
        if block.guarded and block not in self.calls_open:
            for guard in block.guards:
                guard.off()
            block.guarded = False


class InnerGuard:
    """The forward pre-hook and forward hook of one module inside a block,
    on while the block is paged out.

    [Note: guards put back under their own ids]
    A block's guards go on at each eviction and off at its next use. Put on
    by `register_forward_pre_hook` / `register_forward_hook` each time, they
    made two `RemovableHandle`s (two weakrefs each) a module: ~3 us a module,
    ~27 us an eviction of a 9-module decoder layer, a sixth of a small
    block's use (CPU, 64 layers 64 wide, a quarter resident). So each hook is
    registered once through PyTorch's API, for an id no other hook of the
    process has, and then taken off and put back under that id in the same
    dictionaries, with the same flag, as the API does (`Module.register_*`,
    `RemovableHandle.remove`): the module's `_call_impl` sees what a
    registration makes. A hook put back goes after the module's other
    forward hooks, as a new registration would."""

    __slots__ = ("module", "pre", "post", "pre_id", "post_id")

    def __init__(self, module: torch.nn.Module, pre, post):
        self.module, self.pre, self.post = module, pre, post
        pre_handle = module.register_forward_pre_hook(pre)
        post_handle = module.register_forward_hook(post, always_call=True)
        self.pre_id, self.post_id = pre_handle.id, post_handle.id
        pre_handle.remove()
        post_handle.remove()

    def on(self) -> None:
        module = self.module
        module._forward_pre_hooks[self.pre_id] = self.pre
        module._forward_hooks[self.post_id] = self.post
        module._forward_hooks_always_called[self.post_id] = True

    def off(self) -> None:
        module = self.module
        module._forward_pre_hooks.pop(self.pre_id, None)
        module._forward_hooks.pop(self.post_id, None)
        module._forward_hooks_always_called.pop(self.post_id, None)
