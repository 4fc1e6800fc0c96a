"""A model whose every block is on the device runs its forwards with the
block hooks off ([Note: asleep]): `Sleep`, one per wrapped model, held by
its `Hooks`: when a forward may sleep, what holds the blocks while it and
the graph it built run, and sleep and wake themselves."""

from __future__ import annotations

import threading
import time
import weakref

import torch
from torch.utils._pytree import tree_flatten

from ..base.common import outside_compile


def _keeps_graph() -> bool:
    """The backward running now keeps its graph (`retain_graph=True`); True where torch cannot say."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else keep()


class Sleep:
    """When one model's forwards run with the block hooks off, and what
    holds its blocks meanwhile ([Note: asleep]).

    Args:
        pager: the model's `Pager`.
        install_block_hooks: puts a block's hooks back (its `Hooks`'), at wake.
    """

    # [Note: asleep]
    # When a forward starts and every page of every block is on the device
    # (each acquired since its fetch and none in use, no deferred update, no
    # trace), the block hooks can only count: they are removed for that
    # forward, so a model that fits its budget runs at the speed of the bare
    # model (a module with hooks takes PyTorch's slow call path; a host-bound
    # forward pays for it). Nothing may leave while such a forward runs
    # (`evictions_blocked`); the next forward that needs the hooks (a block
    # to fetch) installs them again before it starts.
    #
    # A forward that builds a graph (training) sleeps too when nothing its
    # backward would need the hooks for can happen (`can_train`):
    # every trainable block has its gradients' page, activations stay as
    # autograd saves them ("keep", or "auto" keeping all), no reducer, the
    # model alone on its engine, and under a budget that covers the process
    # and learns from the allocator (model/outside.py), a prediction of what
    # sits outside pager from the forward measured on fake tensors: a forward
    # asleep leaves autograd's activations where pager does not count them,
    # and the allocator's counters would take them for the caller's, so it
    # learns nothing (the forwards with hooks before it did, and the measure
    # counted the activations in the budget).
    # Its backward then has no pre-backward hooks to bring a block back, so
    # no block of the model may leave while the graph can still be read
    # (`graphs`): until a backward through one of its outputs ends
    # without keeping it (`retain_graph=False`), or it is dropped (the
    # outputs' hooks, which hold the mark, are freed). Gradients still go
    # into their pages (`GradPages.on_grad`), and the optimizer's step runs as on
    # the unwrapped model ([Note: a step asleep] in training/optim.py). A graph that
    # a forward asleep returns when that cannot be (a forward that started
    # with grad disabled enabled it) keeps the blocks until the next forward.

    def __init__(self, pager, install_block_hooks):
        self.pager = pager
        self.uses = pager.uses
        self.lock = pager.lock  # the engine's
        self._install_block_hooks = install_block_hooks
        self.forwards = 0  # forwards running asleep
        self.threads: dict[int, int] = {}  # thread -> its forwards running asleep
        self.held_for_graph = False  # a graph a forward asleep returned, that could not be held (see the Note)
        self.graphs: set = set()  # graphs built asleep that a backward may still read

    def blocks_evictions(self) -> bool:
        """No block of the model may leave now: a forward runs asleep, or a graph one built lives."""
        return self.forwards > 0 or self.held_for_graph or bool(self.graphs)

    def root_starts(self, grad: bool, first: bool) -> None:
        """A root forward starts (`first`: none in flight), before its mark:
        it sleeps if it can, else the blocks wake."""
        if first:
            self.held_for_graph = False
            self.sleep() if self.can_sleep() else self.wake()
        elif self.pager.asleep and grad and not self.can_train():
            self.wake()  # another thread's forward builds a graph: its blocks need their hooks

    def forward_runs(self) -> None:
        """A root forward that started asleep runs."""
        self.forwards += 1
        me = threading.get_ident()
        self.threads[me] = self.threads.get(me, 0) + 1

    def forward_ended(self, output) -> None:
        """A root forward that started asleep ended, with `output`."""
        self.forwards -= 1
        me = threading.get_ident()
        if self.threads.get(me, 0) > 1:
            self.threads[me] -= 1
        else:
            self.threads.pop(me, None)
        self.pager.engine.waiters.room_may_be_back()  # its blocks may leave again
        graph = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if graph and self.can_train():
            self._hold_for_backward(graph)
        elif graph:
            self.wake()
            self.held_for_graph = True  # see the Note

    def can_sleep(self) -> bool:
        """A forward starting now may run asleep (see the Note)."""
        return (
            self.pager.grad_pages.only_empty_pages_out()  # (all resident, but dropped empty grads pages)
            and not self.pager.tracer.enabled
            and all(b.settled and not b.deferred_steps and b.pins == b.resident_for_life for b in self.pager.blocks)
            and (not torch.is_grad_enabled() or self.can_train())
        )

    def outside_may_learn(self) -> bool:
        """What the process holds outside pager may be read now: not after a
        training forward asleep, nor while a graph one built lives (autograd's
        activations, which pager does not count, would look like the caller's)."""
        return self.pager.outside is not None and not self.graphs and not self.held_for_graph

    def can_train(self) -> bool:
        """A forward that builds a graph may run asleep (see the Note)."""
        pager = self.pager
        return (
            (pager.activations is None or pager.activations.all_kept)
            and pager.reducer is None
            # (learning from the allocator, autograd's activations would look like the caller's: model/outside.py;
            # where the measure predicted them beside what sits outside, the forward asleep learns nothing)
            and (pager.outside is None or not pager.outside.learns or pager.outside.prediction > 0)
            and len(pager.engine.owners) == 1
            # A first gradient of a block makes its page, which may need room.
            and all("grads" in b.segments or not any(p.requires_grad for p in b.params) for b in pager.all_blocks())
        )

    def _hold_for_backward(self, outputs: list) -> None:
        """Keep every block here while the graph of a forward that ran asleep
        may still be read (see the Note). The mark is a hook on each output:
        a backward through it ends the hold unless it keeps the graph, and
        the hook's end (the graph dropped) ends it too."""
        graphs, mark = self.graphs, object()

        def backward_ends():
            with self.lock:
                graphs.discard(mark)
                self.pager.engine.waiters.room_may_be_back()

        def reached(grad):
            if not _keeps_graph():
                torch.autograd.Variable._execution_engine.queue_callback(backward_ends)

        graphs.add(mark)
        for t in outputs:
            t.register_hook(outside_compile(reached))
        weakref.finalize(reached, graphs.discard, mark)  # (from any thread, at any time: no lock)

    def sleep(self) -> None:
        """Take the block hooks off: every block stays, its tensors exposed."""
        if not self.pager.asleep:
            for block in self.pager.blocks:
                for h in block.hook_handles:
                    h.remove()
                block.hook_handles = []
                if not self.pager.shared_mode:
                    self.uses.expose(block, everyone=True)  # nothing leaves while asleep: the tensors need no guard
            self.pager.asleep = True

    def wake(self) -> None:
        """Put the block hooks back, each idle block's tensors guarded."""
        if self.pager.asleep:
            self.pager.asleep = False  # first: accesses from now on are served ([Note: tensors and threads])
            me = threading.get_ident()
            while any(t != me for t in self.pager.asleep_readers):  # ...and other threads' that began asleep finish
                time.sleep(1e-5)
            self.pager.grad_pages.adopt_outside()  # before anything may leave ([Note: gradients outside ...])
            for block in self.pager.blocks:
                self.uses.track_kept_views(block, (), ("asleep",))  # views taken while its tensors were exposed
                self._install_block_hooks(block)
                if block.pins == 0:
                    self.uses.guard_idle(block)
                # Writes while asleep reached the tensors directly, and some
                # (CUDA's foreach zero) move no version counter: if the block
                # ever leaves, it is written back.
                block.mark_dirty()
