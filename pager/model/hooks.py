"""Hooks: the root's forward (where a step starts, `model/steps.py`), each
block's forward and backward; whether a forward runs with the block hooks
off is `Sleep`'s (model/asleep.py); gradients as they accumulate go into
their pages through `GradPages.on_grad` (training/grad_pages.py)."""

from __future__ import annotations

import logging
import sys
import threading
from types import FrameType

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..base import saving, served
from ..base.block import Block
from ..base.budget import format_bytes
from ..base.common import BACKWARD, WEIGHTS, BudgetError, _locked, dry_running, model_hook, outside_compile
from ..training import recompute
from ..training.checkpoint import StateDicts
from .asleep import Sleep
from .structure import Structure

log = logging.getLogger("pager")


# [Note: pager under torch.compile]
# pager's hooks do host work (fetches, waits, the budget's bookkeeping) that
# no graph can hold, so they run eagerly, outside every compiled graph
# (`outside_compile`): dynamo breaks the graph at each and compiles what lies
# between, so a block's forward is one graph, and a paged-out tensor's guard
# is never traced. A block compiled by itself (`module.compile()`, FSDP2's
# pattern) runs its hooks, then its graph; under `torch.compile(model)`,
# dynamo gives up on the root's loop over the layers at the first hook (a
# graph break in a loop) and compiles each block's call as it comes: the
# same graphs. The class swaps of the guards happen in the hooks, so a
# compiled graph always sees the tensors' own classes: no recompilation as
# blocks page in and out. With activations under the budget, a block's
# first pre-hook, traced where it is compiled, marks whether its forward runs
# compiled (`_compile_mark`).
# Activations offloaded or recomputed need a block compiled by itself: under
# `torch.compile(model)` the code between blocks is compiled with pager's
# saved-tensor hooks on (they are not traceable: dynamo runs them on fake
# tensors), and a recomputation in the backward would run uncompiled and
# save other tensors than the compiled graph did; `for_block` in
# training/activations.py refuses it, naming the fix.
def _compile_mark(block: Block):
    def mark(module, args):
        if dry_running():
            return
        block.under_compile = torch.compiler.is_compiling()  # (traced: True where this call is compiled)

    return mark


def _advise(pager) -> None:
    """At the first forward: a model that fits its budget (as it is then) is
    told so if it runs inference; a training step (gradients enabled, or an
    optimizer attached) may still page its gradients and state, and its user
    has nothing to change: said at INFO."""
    total, pager.fits_advice = pager.fits_advice, None
    budget = pager.engine.budget_bytes - pager.outside_bytes  # (what the process holds beside it: model/outside.py)
    if total > budget:
        return
    training = torch.is_grad_enabled() or bool(pager.optimizers)
    (log.info if training else log.warning)(
        "pager: the whole model (%s) fits the budget (%s%s): inference needs no paging (it stays resident "
        "after the first forward, as fast as unwrapped).",
        format_bytes(total),
        format_bytes(pager.engine.budget_bytes),
        f", less {format_bytes(pager.outside_bytes)} the process holds outside pager" if pager.outside_bytes else "",
    )


def _calls_of(module) -> int:
    """How many calls of `module` are on this thread's Python stack (each
    enters `Module._wrapped_call_impl`, `__call__`)."""
    calls = 0
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_wrapped_call_impl" and frame.f_locals.get("self") is module:
            calls += 1
        frame = frame.f_back
    return calls


class Hooks:
    """One model's hooks: the root's forward (it starts steps through
    `Steps`), each block's forward and backward (whether they run is its
    `Sleep`'s), and gradients as they accumulate. Held by its `Pager`.

    Args:
        pager: the model's `Pager` (its blocks, uses and engine).
    """

    def __init__(self, pager):
        self.pager = pager
        self.uses = pager.uses  # (acquire and release: the hooks' every call)
        self.lock = pager.lock  # (for `_locked`) the engine's, shared by its models
        self.handles: list = []  # every hook handle but the blocks' own (`Block.hook_handles`)
        self.root_depth = 0
        self.backward_holds: dict[Block, int] = {}
        self._final_callback_queued = False
        self.backward_passes = 0  # ended backward passes (end_of_backward)
        self.sleep = Sleep(pager, self._install_block_hooks)  # forwards with the block hooks off (model/asleep.py)

    def remove(self) -> None:
        """Take every hook off (unwrap)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def install(self) -> None:
        root = self.pager.model
        # (hooks on the user's modules refuse pickling and deepcopy: [Note: a wrapped model is not pickled or copied])
        self.handles.append(root.register_forward_pre_hook(model_hook(self._root_pre_forward), with_kwargs=True))
        self.handles.append(
            root.register_forward_hook(model_hook(self._root_post_forward), with_kwargs=True, always_call=True)
        )
        for block in self.pager.blocks:
            self._install_block_hooks(block)
        self.pager.direct_calls.install()
        self.structure = Structure(self.pager)
        self.structure.snapshot()
        for block in self.pager.all_blocks():
            for p in block.params:
                if p.requires_grad:
                    self.handles.append(
                        p.register_post_accumulate_grad_hook(outside_compile(self.pager.grad_pages.on_grad))
                    )
        self.handles += StateDicts(self.pager).install()

    def _install_block_hooks(self, block: Block) -> None:
        # Ours first among pre-hooks (a user's hook on the block may read its
        # weights: they must be here) and last among post-hooks.
        module = block.module
        assert module is not None  # (the remainder, which has none, is never hooked)
        block.hook_handles = [
            module.register_forward_pre_hook(model_hook(self._make_pre_forward(block)), with_kwargs=True, prepend=True),
            module.register_forward_hook(model_hook(self._make_post_forward(block)), always_call=True),
        ]
        if self.pager.activations is not None:  # (what reads the mark: training/activations.py)
            mark = model_hook(_compile_mark(block), traced=True)
            block.hook_handles.append(module.register_forward_pre_hook(mark, prepend=True))

    def forward_marks(self) -> list:
        # Per thread, for each root forward in flight: (whether it started
        # asleep, how many saving frames were open below its own).
        marks = getattr(self.pager.thread_state, "marks", None)
        if marks is None:
            marks = self.pager.thread_state.marks = []
        return marks

    @_locked
    def _root_pre_forward(self, module, args, kwargs):
        if recompute.recomputing() or dry_running():
            return  # a block whose forward runs again is not a new forward; a measure is none
        if self.forward_marks():  # (a nested forward, or one interrupted: see the Note)
            self._end_interrupted_forwards(module, len(self.forward_marks()) - (_calls_of(module) - 1))
        # Ops between blocks save activations too; ended by the post-hook,
        # which is always called ([Note: activations off the device]).
        if self.root_depth == 0 and self.sleep.outside_may_learn():
            self.pager.outside.forward_starts()  # (before the policy: what the caller holds crowds it)
        acts = self.pager.activations if torch.is_grad_enabled() else None
        if acts is not None and self.root_depth == 0:
            try:  # (the policy from what this forward will save: [Note: activations, the automatic choice])
                acts.plan_pass(args, kwargs)
            except Exception as e:  # (torch runs the always-called post-hook after an Exception only)
                self.pager.thread_state.refused = True  # (it has nothing to end)
                if isinstance(e, BudgetError) and self.pager.outside is not None:
                    self.pager.outside.refused()  # (measured again at the next forward)
                raise
            acts.pass_starts()  # (before the ops before the first block)
        offload, recomputation = acts.between_blocks() if acts is not None else (None, None)
        saving.begin_saving(False, offload, recomputation, ledger=acts.ledger if acts is not None else None)
        self.pager.check_open()
        self.uses.note_threads()
        outermost = not self.forward_marks()  # this thread's own request starts
        if outermost:
            self.pager.engine.room.note_request(self.pager)
        if self.root_depth == 0:
            if self.pager.fits_advice is not None:
                _advise(self.pager)
            if self.pager.reducer is not None and torch.is_grad_enabled():
                self.pager.reducer.forward_starts()
            self.structure.check()
            self._release_stale_backward_holds()
            if torch.is_grad_enabled():
                self.pager.grad_pages.drop_unset()  # ([Note: gradients set to None leave the device])
                self.pager.host_steps.forward_starts()
            self.pager.steps.start_step()
            self.sleep.root_starts(torch.is_grad_enabled(), first=True)
            if self.pager.asleep and acts is not None:
                # Training asleep: every block keeps its activations ("auto")
                # and none can leave, so autograd keeps them as without pager:
                # this forward's saves need no hooks of ours (the top frame is
                # the one begun above).
                saving.end_saving()
                saving.begin_saving(False)
        else:
            if outermost:
                self.pager.steps.another_request()
            self.sleep.root_starts(torch.is_grad_enabled(), first=False)
        self.forward_marks().append((self.pager.asleep, saving.depth() - 1))  # (less the frame begun above)
        if self.pager.asleep:
            self.sleep.forward_runs()
            self.pager.counters.resident_forwards += 1
            self.pager.counters.resident_uses += len(self.pager.scheduler.plan)
        self.root_depth += 1

    # [Note: a forward interrupted]
    # Module calls run always-called forward hooks after an `Exception` only:
    # a KeyboardInterrupt (Ctrl-C in a notebook) or SystemExit in a forward
    # skips the root's post-hook, leaving its saving frame (pager's
    # saved-tensor hooks on for every later autograd op of the thread, any
    # model's) and its marks. The next root forward of this thread finds
    # more marks than calls of the root on its stack, besides its own (a
    # nested forward has its outer call there: looked for only when a mark
    # is left, a walk of the Python stack) and ends the extra ones as their
    # post-hook would have: the frames above each one's depth first.
    # (A block interrupted in its own forward keeps its pin: its post-hook
    # did not run either, and nothing says which use it was.)
    def _end_interrupted_forwards(self, module, n: int) -> None:
        if n <= 0:
            return
        log.warning("pager: a forward of %s ended without its hooks (interrupted): its state is reset", self.pager.name)
        for _ in range(n):
            saving.end_saving_to(self.forward_marks()[-1][1] + 1)
            self._root_post_forward(module, (), {}, None)
        for table in self.pager.expert_tables:  # (an experts call it ended: its lock, its parameters)
            table.interrupted()

    @_locked
    def _root_post_forward(self, module, args, kwargs, output):
        if recompute.recomputing() or dry_running():
            return
        if getattr(self.pager.thread_state, "refused", False):  # its pre-hook raised before it began
            self.pager.thread_state.refused = False
            return
        saving.end_saving()
        self.root_depth = max(0, self.root_depth - 1)
        if self.root_depth == 0:
            self.pager.host_steps.forward_ends()
        marks = self.forward_marks()
        if len(marks) <= 1:  # this thread's request ends
            self.pager.steps.note_carried(args, kwargs)
            self.pager.thread_state.unrecorded = False
            if self.pager.steps.recorder == threading.get_ident():
                self.pager.steps.recorder = None
        trained_asleep = bool(marks) and marks[-1][0] and torch.is_grad_enabled()
        if self.root_depth == 0 and self.sleep.outside_may_learn() and not trained_asleep:
            self.pager.outside.forward_ended()  # ([Note: a budget that covers the process] in model/outside.py)
        if marks and marks.pop()[0]:  # (it started asleep)
            self.sleep.forward_ended(output)

    def _release_stale_backward_holds(self) -> None:
        # A backward that raised never ran its final callback: its blocks are
        # still held. No backward runs across a new root forward, so let go.
        if self.backward_holds:
            log.debug("pager: releasing blocks held by a backward that did not finish")
            self.end_of_backward(finished=False)

    def _make_pre_forward(self, block: Block):
        def pre_forward(module, args, kwargs):
            if dry_running():
                return None
            again = recompute.recomputing()  # its forward again, in its backward: the block is held
            grad = torch.is_grad_enabled() and not again
            if not again:
                # Ended by the post-hook, which is always called
                # ([Note: autograd's saved views, counted] in base/saving.py).
                acts = self.pager.activations if grad else None
                if acts is not None:
                    acts.forward_reaches(block)
                # (quantized weights' Python kernels leave Python views of them in the graph: counted)
                offload, recomputation = acts.for_block(block, args, kwargs) if acts is not None else (None, None)
                saving.begin_saving(
                    (self.pager.shared_mode or block.quantized) and grad,
                    offload,
                    recomputation,
                    ledger=acts.ledger if acts is not None else None,
                )
            with self.lock:
                if self.uses.can_use_resident(block) and not again:
                    self.uses.use_resident(block)
                else:
                    try:
                        self.uses.acquire(block, WEIGHTS, record=not again)
                    except BaseException:
                        block.unpinned_calls += 1  # the post-hook (always called) must not release
                        raise
                    if grad and self.pager.activations is not None:
                        self._room_for_activations(block, backward=False)
                    self.pager.prefetch()
                if grad and self.pager.reducer is not None:
                    self.pager.reducer.forward_use(block)
            if grad:
                # A frozen block too: its backward (the input's gradient) holds it until then.
                return self._register_post_backward(block, args, kwargs)
            return None

        return pre_forward

    def _make_post_forward(self, block: Block):
        def post_forward(module, args, output):
            if dry_running():
                return None
            again = recompute.recomputing()
            frame = None if again else saving.end_saving()
            with self.lock:
                if block.unpinned_calls:
                    block.unpinned_calls -= 1
                    return None
                if frame is not None:  # (not again)
                    self.uses.track_kept_views(block, (output,), ("forward", torch.is_grad_enabled(), frame.hooks))
                    if frame.ledger is not None:
                        self.pager.activations.forward_saved(block, frame.saved_bytes)
                self.uses.release(block)
            if torch.is_grad_enabled() and not again:
                self.register_pre_backward(block, output)
            return None

        return post_forward

    def register_pre_backward(self, block: Block, output) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        fired = [-1]  # the backward pass it fired in: once per pass (a retained graph's second pass too)

        def pre_backward(grad):
            if fired[0] != self.backward_passes:
                fired[0] = self.backward_passes
                self._pre_backward(block)
            return grad

        for t in tensors:
            t.register_hook(outside_compile(pre_backward))

    @_locked
    def _pre_backward(self, block: Block) -> None:
        if not self._final_callback_queued:
            self._final_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
            if self.pager.outside is not None:
                self.pager.outside.backward_starts()  # (before this hook's own work)
            if self.pager.reducer is not None:
                self.pager.reducer.backward_starts()
        self.uses.acquire(block, BACKWARD)
        self.backward_holds[block] = self.backward_holds.get(block, 0) + 1
        if self.pager.activations is not None:
            self.pager.activations.backward_reaches(block)
            self._room_for_activations(block, backward=True)
        self.pager.prefetch()

    def _room_for_activations(self, block: Block, backward: bool) -> None:
        """Where activations will hold more than when the resident blocks were
        fetched (a pass larger than the last, a recomputation about to run),
        those blocks leave as for a fetch ([Note: one budget] in training/activations.py)."""
        ledger = self.pager.activations.ledger
        more = ledger.recompute_comes(block) if backward else False  # (counts its recomputation: always asked)
        if more or ledger.grew():
            self.pager.engine.room.make_room(0, protect=(block, *block.deps))

    def _register_post_backward(self, block: Block, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        outs = served.PostBackward.apply(self, block, *[flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    @_locked
    def post_backward(self, block: Block) -> None:
        if self.pager.reducer is not None:
            self.pager.reducer.backward_ended(block)  # its gradients may be final: averaged now
        if self.backward_holds.get(block, 0) > 0:
            self.backward_holds[block] -= 1
            self.uses.track_kept_views(block, (), ("backward",))
            self.uses.release(block)
            self.pager.host_steps.state_room.backward_ended(block)  # (it may leave: [Note: the state off the device])

    @_locked
    def end_of_backward(self, finished: bool = True) -> None:
        self._final_callback_queued = False
        self.backward_passes += 1
        if self.pager.activations is not None and finished:
            self.pager.activations.pass_ends()
        for block, holds in list(self.backward_holds.items()):
            self.uses.track_kept_views(block, (), ("backward",))
            for _ in range(holds):
                self.uses.release(block)
        self.backward_holds.clear()
        if self.pager.reducer is not None:
            self.pager.reducer.backward_finished(finished)
