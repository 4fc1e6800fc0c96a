"""Hooks: forward and backward around each block, guards for direct calls
into a paged-out block, the step boundary, and advice."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from operator import is_not

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..base import guards
from ..training import activations
from ..base import saving
from ..base.block import Block, PageState
from ..base.budget import format_bytes
from .carried import carried_bytes
from ..training.checkpoint import StateDicts
from ..base.common import BACKWARD, NEVER_RAN_STEPS, STALL_SHARE, STALL_WINDOW_STEPS, WEIGHTS, _locked

log = logging.getLogger("pager")


def _keeps_graph() -> bool:
    """The backward running now keeps its graph (`retain_graph=True`); True where torch cannot say."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else keep()


class Hooks:
    """One model's hooks: the root's forward (the step boundary), each
    block's forward and backward, guards for direct calls into a paged-out
    block, gradients as they accumulate, and advice. Held by its `Pager`.

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
        self._backward_passes = 0  # ended backward passes (end_of_backward)
        self.step_misses = 0
        self.expect_used = False  # `expect` was called this step
        self._unsaid_change = False  # the last step's order changed, unannounced, with misses
        self._kept_key = None  # what the kept set was chosen for (_start_step)
        self.sleeping_forwards = 0
        self.sleeping_threads: dict[int, int] = {}  # thread -> its forwards running asleep
        self.recorder = None  # the thread whose forward this step records ([Note: one recorded request at a time])
        self.held_for_graph = False
        self.graphs_asleep: set = set()  # graphs built asleep that a backward may still read ([Note: asleep])
        self._window = (time.perf_counter(), 0.0)  # (start, stall seconds at start)
        self._least_room_of = None  # the total_bytes that `pager.least_room` was computed for

    def remove(self) -> None:
        """Take every hook off (unwrap)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def install(self) -> None:
        root = self.pager.model
        self.handles.append(root.register_forward_pre_hook(self._root_pre_forward))
        self.handles.append(root.register_forward_hook(self._root_post_forward, with_kwargs=True, always_call=True))
        for block in self.pager.blocks:
            self._install_block_hooks(block)
        self._install_inner_hooks()
        self._known = {id(t) for b in self.pager.all_blocks() for t in b.weights.tensors}
        self._snapshot_structure()
        for block in self.pager.all_blocks():
            for p in block.params:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.handles += StateDicts(self.pager).install()

    def _install_block_hooks(self, block: Block) -> None:
        # Ours first among pre-hooks (a user's hook on the block may read its
        # weights: they must be here) and last among post-hooks.
        block.hook_handles = [
            block.module.register_forward_pre_hook(self._make_pre_forward(block), with_kwargs=True, prepend=True),
            block.module.register_forward_hook(self._make_post_forward(block), always_call=True),
        ]

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
    # backward would need the hooks for can happen (`_can_train_asleep`):
    # every trainable block has its gradients' page, activations stay as
    # autograd saves them, no reducer, and the model is alone on its engine.
    # Its backward then has no pre-backward hooks to bring a block back, so
    # no block of the model may leave while the graph can still be read
    # (`graphs_asleep`): until a backward through one of its outputs ends
    # without keeping it (`retain_graph=False`), or it is dropped (the
    # outputs' hooks, which hold the mark, are freed). Gradients still go
    # into their pages (`_on_grad`), and the optimizer's step runs as on
    # the unwrapped model ([Note: a step asleep] in training/optim.py). A graph that
    # a forward asleep returns when that cannot be (a forward that started
    # with grad disabled enabled it) keeps the blocks until the next forward.
    def _can_sleep(self) -> bool:
        return (
            self.pager.all_resident
            and not self.pager.tracer.enabled
            and all(b.settled and not b.deferred_steps and b.pins == b.resident_for_life for b in self.pager.blocks)
            and (not torch.is_grad_enabled() or self._can_train_asleep())
        )

    def _can_train_asleep(self) -> bool:
        pager = self.pager
        return (
            pager.activations is None
            and pager.reducer is None
            and len(pager.engine.owners) == 1
            # A first gradient of a block makes its page, which may need room.
            and all("grads" in b.segments or not any(p.requires_grad for p in b.params) for b in pager.all_blocks())
        )

    def _hold_for_backward(self, outputs: list) -> None:
        """Keep every block here while the graph of a forward that ran asleep
        may still be read (see the Note). The mark is a hook on each output:
        a backward through it ends the hold unless it keeps the graph, and
        the hook's end (the graph dropped) ends it too."""
        graphs, mark = self.graphs_asleep, object()

        def backward_ends():
            with self.lock:
                graphs.discard(mark)
                self.pager.engine.room_may_be_back()

        def reached(grad):
            if not _keeps_graph():
                torch.autograd.Variable._execution_engine.queue_callback(backward_ends)

        graphs.add(mark)
        for t in outputs:
            t.register_hook(reached)
        weakref.finalize(reached, graphs.discard, mark)  # (from any thread, at any time: no lock)

    def sleep(self) -> None:
        if not self.pager.asleep:
            for block in self.pager.blocks:
                for h in block.hook_handles:
                    h.remove()
                block.hook_handles = []
                if not self.pager.shared_mode:
                    self.uses.expose(block, everyone=True)  # nothing leaves while asleep: the tensors need no guard
            self.pager.asleep = True

    def wake(self) -> None:
        if self.pager.asleep:
            self.pager.asleep = False  # first: accesses from now on are served ([Note: tensors and threads])
            me = threading.get_ident()
            while any(t != me for t in self.pager.asleep_readers):  # ...and other threads' that began asleep finish
                time.sleep(1e-5)
            for block in self.pager.blocks:
                self.uses.track_kept_views(block, (), ("asleep",))  # views taken while its tensors were exposed
                self._install_block_hooks(block)
                if block.pins == 0:
                    self.uses.guard_idle(block)
                # Writes while asleep reached the tensors directly, and some
                # (CUDA's foreach zero) move no version counter: if the block
                # ever leaves, it is written back.
                block.mark_dirty()

    def forward_marks(self) -> list:
        # Per thread: whether each root forward in flight started asleep.
        marks = getattr(self.pager.thread_state, "marks", None)
        if marks is None:
            marks = self.pager.thread_state.marks = []
        return marks

    def _install_inner_hooks(self) -> None:
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
                        block.guards.append(
                            (child, self._make_inner_pre(block, held), self._make_inner_post(block, held))
                        )
            self.guard(block)

    def _make_inner_pre(self, block: Block, held: list):
        def inner_pre(module, args):
            if block.pins > 0:  # called from within its block
                held.append(False)
                return
            with self.lock:
                self.uses.acquire(block, WEIGHTS, record=False)
            held.append(True)

        return inner_pre

    def _make_inner_post(self, block: Block, held: list):
        def inner_post(module, args, output):
            if held and held.pop():
                with self.lock:
                    self.uses.release(block)
                    if torch.is_grad_enabled():
                        self.register_pre_backward(block, output)

        return inner_post

    def guard(self, block: Block) -> None:
        if block.guard_handles is None:
            block.guard_handles = [
                h
                for module, pre, post in block.guards
                for h in (module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True))
            ]

    def unguard(self, block: Block) -> None:
        if block.guard_handles is not None:
            for h in block.guard_handles:
                h.remove()
            block.guard_handles = None

    def _snapshot_structure(self) -> None:
        self._tables = [t for m in self.pager.model.modules() for t in (m._parameters, m._buffers, m._modules)]
        self._table_lens = list(map(len, self._tables))
        entries = [
            (table, name, t)
            for m in self.pager.model.modules()
            for table in (m._parameters, m._buffers)
            for name, t in table.items()
            if t is not None
        ]
        # Columns, so the per-forward identity check runs in C (map/operator).
        self._entry_tables, self._entry_names, self._entry_tensors = (list(c) for c in zip(*entries)) if entries else ([], [], [])
        # Gradients are paged by hooks installed at wrap for trainable parameters.
        self._frozen = [(n, p) for n, p in self.pager.model.named_parameters() if not p.requires_grad]

    def _check_structure(self) -> None:
        """Refuse to run on parameters or buffers pager does not manage
        (identity and count checks over a table made at wrap: no module walk)."""
        for name, p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"pager: {name!r} was frozen at wrap and now requires grad; its gradients would not be "
                    f"paged. Unfreeze before wrapping: pager.unwrap(model), set requires_grad, then "
                    f"pager.wrap(model, ...) again (freezing after wrap is fine)."
                )
        changed = any(map(is_not, map(dict.get, self._entry_tables, self._entry_names), self._entry_tensors)) or (
            list(map(len, self._tables)) != self._table_lens
        )
        if not changed:
            return
        for name, t in list(self.pager.model.named_parameters(remove_duplicate=False)) + list(
            self.pager.model.named_buffers(remove_duplicate=False)
        ):
            if id(t) not in self._known:
                raise RuntimeError(
                    f"pager: {name!r} was added or replaced after wrap, so pager does not page it (and the old "
                    f"tensor is what it holds). Change models before wrapping: pager.unwrap(model), make the "
                    f"change, then pager.wrap(model, ...) again."
                )
        raise RuntimeError(
            "pager: a module was added to or removed from the model after wrap; pager.unwrap(model), make "
            "the change, then pager.wrap(model, ...) again."
        )

    @_locked
    def _root_pre_forward(self, module, args):
        if activations.recomputing():
            return  # a block whose forward runs again is not a new forward
        # Ops between blocks save activations too; ended by the post-hook,
        # which is always called ([Note: activations off the device]).
        acts = self.pager.activations if torch.is_grad_enabled() else None
        if acts is not None and self.root_depth == 0:
            acts.pass_starts()
        saving.begin_saving(False, *(acts.between_blocks() if acts is not None else ()),
                            ledger=acts.ledger if acts is not None else None)
        self.pager.check_open()
        self.uses.note_threads()
        outermost = not self.forward_marks()  # this thread's own request starts
        if outermost:
            self.pager.engine.note_request(self.pager)
        if self.root_depth == 0:
            if self.pager.reducer is not None and torch.is_grad_enabled():
                self.pager.reducer.forward_starts()
            if self.pager.activations is not None:
                self.pager.activations.forward_reaches(None)  # ops before the first block
            self._check_structure()
            self._release_stale_backward_holds()
            self._start_step()
            self.held_for_graph = False
            self.sleep() if self._can_sleep() else self.wake()
        else:
            if outermost:
                self._another_request()
            if self.pager.asleep and torch.is_grad_enabled() and not self._can_train_asleep():
                self.wake()  # another thread's forward builds a graph: its blocks need their hooks
        self.forward_marks().append(self.pager.asleep)
        if self.pager.asleep:
            self.sleeping_forwards += 1
            me = threading.get_ident()
            self.sleeping_threads[me] = self.sleeping_threads.get(me, 0) + 1
            self.pager.counters.resident_forwards += 1
            self.pager.counters.resident_uses += len(self.pager.scheduler.plan)
        self.root_depth += 1

    @_locked
    def _root_post_forward(self, module, args, kwargs, output):
        if activations.recomputing():
            return
        saving.end_saving()
        self.root_depth = max(0, self.root_depth - 1)
        marks = self.forward_marks()
        if len(marks) <= 1:  # this thread's request ends
            self._note_carried(args, kwargs)
            self.pager.thread_state.unrecorded = False
            if self.recorder == threading.get_ident():
                self.recorder = None
        if marks and marks.pop():
            self.sleeping_forwards -= 1
            me = threading.get_ident()
            if self.sleeping_threads.get(me, 0) > 1:
                self.sleeping_threads[me] -= 1
            else:
                self.sleeping_threads.pop(me, None)
            self.pager.engine.room_may_be_back()  # its blocks may leave again
            graph = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if graph and self._can_train_asleep():
                self._hold_for_backward(graph)
            elif graph:
                self.wake()
                self.held_for_graph = True  # see [Note: asleep]

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
    def _another_request(self) -> None:
        """A thread's forward starts while other forwards of this model run."""
        if self.recorder is None:
            self._start_step()
        else:
            self.pager.thread_state.unrecorded = True

    def recording(self) -> bool:
        """Uses on this thread go into the step's recording."""
        return not getattr(self.pager.thread_state, "unrecorded", False)

    def _note_carried(self, args, kwargs) -> None:
        """The state this forward carried on the device counts against the
        budget from now on ([Note: carried state] in model/carried.py)."""
        nbytes = carried_bytes((*args, *kwargs.values()), self.pager.device.type)
        if nbytes != self.pager.carried_bytes:
            grew = nbytes > self.pager.carried_bytes
            self.pager.carried_bytes = nbytes
            self.pager.counters.peak_carried_bytes = max(self.pager.counters.peak_carried_bytes, nbytes)
            if grew:
                self.pager.engine.make_room(0, protect=())  # idle blocks leave until blocks and state fit
            if self.pager.budget_bytes < self.pager.least_room + nbytes:
                self.pager.warn_once(
                    "carried_crowd", "pager: the state a forward carries on the device (a KV cache: %s) leaves "
                    "less of the %s budget than the %s that blocks need at least; blocks take that much anyway, "
                    "so the model holds more than the budget. Raise the budget, or use a smaller batch or a "
                    "shorter context.", format_bytes(nbytes), format_bytes(self.pager.budget_bytes),
                    format_bytes(self.pager.least_room))

    def _release_stale_backward_holds(self) -> None:
        # A backward that raised never ran its final callback: its blocks are
        # still held. No backward runs across a new root forward, so let go.
        if self.backward_holds:
            log.debug("pager: releasing blocks held by a backward that did not finish")
            self.end_of_backward(finished=False)

    def _start_step(self) -> None:
        self.recorder = threading.get_ident()  # [Note: one recorded request at a time]
        self.pager.tracer.new_step()
        changed = self.pager.scheduler.start_step()
        if changed:
            self.pager.counters.order_changes += 1
        # A change that costs fetches on demand two steps running is a pattern
        # (one alone is often the first step, before optimizer state exists).
        unsaid = changed and self.step_misses > 0 and not self.expect_used
        if unsaid and self._unsaid_change:
            self.pager.warn_once(
                "order", "pager: the order of blocks changed between steps (%d fetches on demand in the last "
                "step); if it changes every step (a NAS supernet's sampled path), say what comes next with "
                "pager.of(model).expect(modules) so it is prefetched.", self.step_misses)
        self._unsaid_change = unsaid
        self.step_misses, self.expect_used = 0, False
        self._advise()
        # The kept set depends on the plan, the room for blocks and the
        # blocks' sizes: chosen again only when one of them changed (the room
        # in steps of 1/64 of the budget: activations vary a little by pass).
        if self._least_room_of != self.pager.total_bytes:  # a segment appeared (grads, optimizer state)
            self.pager.least_room, self._least_room_of = self.pager.least_room_bytes(), self.pager.total_bytes
        # With other models on the engine, in this one's share of the room
        # ([Note: sharing the room] in engine/engine.py).
        engine = self.pager.engine
        shared = len(engine.owners) > 1
        fixed = self.pager.fixed_bytes() if shared else None
        room = engine.kept_room(self.pager, fixed)
        key = (len(self.pager.scheduler.plan), self.pager.budget_bytes, room * 64 // max(self.pager.budget_bytes, 1),
               self.pager.total_bytes)
        if changed or key != self._kept_key:
            # Sharing: kept blocks last, so that a request's kept tail overlaps the next
            # request's fetches ([Note: sharing the room]); inference alone: spread out
            # ([Note: kept blocks spread out] in engine/schedule.py).
            order = "late" if shared else ("spread" if self.pager.scheduler.reads_only() else "early")
            self.pager.scheduler.choose_kept(room, lambda b: b.nbytes(),
                                             fixed if fixed is not None else self.pager.fixed_bytes(), order)
            self._kept_key = key
            self._warn_if_activations_crowd(room)
        self.pager.counters.steps += 1

    def _warn_if_activations_crowd(self, room: int) -> None:
        if self.pager.activations is None or self.pager.budget_bytes - self.pager.activations.ledger.reserve() >= self.pager.least_room:
            return
        self.pager.warn_once(
            "activations_crowd", "pager: activations held %s on the device in the last training pass, which leaves "
            "less of the %s budget than the %s that blocks need at least; blocks take that much anyway, so the "
            "step exceeds the budget. Raise the budget, use activations=\"recompute\" (it holds least), or "
            "a smaller batch.", format_bytes(self.pager.activations.ledger.reserve()), format_bytes(self.pager.budget_bytes),
            format_bytes(self.pager.least_room))


    def _advise(self) -> None:
        """Warnings that need a few steps of history (each at most once)."""
        steps = self.pager.counters.steps
        if steps == NEVER_RAN_STEPS + 1:
            idle = [b for b in self.pager.blocks if b.uses == 0]
            if idle:
                self.pager.warn_once(
                    "never_ran", "pager: %d block(s) never ran in %d steps (%s%s), holding %s of host pages; if "
                    "they are unused, leave them out of the model (NAS candidates not yet sampled are expected).",
                    len(idle), NEVER_RAN_STEPS, ", ".join(b.name for b in idle[:4]), ", ..." if len(idle) > 4 else "",
                    format_bytes(sum(b.nbytes() for b in idle)))
        # Stalls are judged over windows of steps, the first one starting after
        # the first step (whose fetches are the unavoidable cold start).
        if steps == 2 or (steps > 2 and (steps - 2) % STALL_WINDOW_STEPS == 0):
            if self.pager.transport.is_cuda:
                self.pager.engine.meter.resolve(wait=False)
            start, stall_at_start = self._window
            now, stall = time.perf_counter(), self.pager.counters.stall_seconds
            if steps > 2 and now > start and stall - stall_at_start > STALL_SHARE * (now - start):
                self.pager.warn_once(
                    "stalls", "pager: compute waited for transfers %.0f%% of the last %d steps; a larger budget "
                    "keeps more blocks resident (pager.plan(model, budget) shows what moves), and smaller blocks "
                    "(blocks=...) overlap better.", 100 * (stall - stall_at_start) / (now - start), STALL_WINDOW_STEPS)
            self._window = (now, stall)

    def _make_pre_forward(self, block: Block):
        def pre_forward(module, args, kwargs):
            again = activations.recomputing()  # its forward again, in its backward: the block is held
            grad = torch.is_grad_enabled() and not again
            if not again:
                # Ended by the post-hook, which is always called ([Note: autograd's saved views, counted]).
                acts = self.pager.activations if grad else None
                if acts is not None:
                    acts.forward_reaches(block)
                saving.begin_saving(self.pager.shared_mode and grad,
                                    *(acts.for_block(block, args, kwargs) if acts is not None else ()),
                                    ledger=acts.ledger if acts is not None else None)
            with self.lock:
                if self.uses.can_use_resident(block) and not again:
                    self.uses.use_resident(block)
                else:
                    try:
                        self.uses.acquire(block, WEIGHTS, record=not again)
                    except BaseException:
                        block.unpinned_calls += 1  # the post-hook (always called) must not release
                        raise
                    self.pager.prefetch()
                if grad and self.pager.reducer is not None:
                    self.pager.reducer.forward_use(block)
            if block.trainable and grad:
                return self._register_post_backward(block, args, kwargs)
            return None

        return pre_forward

    def _make_post_forward(self, block: Block):
        def post_forward(module, args, output):
            again = activations.recomputing()
            hooks = None if again else saving.end_saving()
            with self.lock:
                if block.unpinned_calls:
                    block.unpinned_calls -= 1
                    return None
                if not again:
                    self.uses.track_kept_views(block, (output,), ("forward", torch.is_grad_enabled(), hooks))
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
            if fired[0] != self._backward_passes:
                fired[0] = self._backward_passes
                self._pre_backward(block)
            return grad

        for t in tensors:
            t.register_hook(pre_backward)

    @_locked
    def _pre_backward(self, block: Block) -> None:
        if not self._final_callback_queued:
            self._final_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
            if self.pager.reducer is not None:
                self.pager.reducer.backward_starts()
        self.uses.acquire(block, BACKWARD)
        self.backward_holds[block] = self.backward_holds.get(block, 0) + 1
        if self.pager.activations is not None:
            self.pager.activations.backward_reaches(block)
        self.pager.prefetch()

    def _register_post_backward(self, block: Block, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        outs = guards.PostBackward.apply(self, block, *[flat[i] for i in idx])
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

    @_locked
    def end_of_backward(self, finished: bool = True) -> None:
        self._final_callback_queued = False
        self._backward_passes += 1
        if self.pager.activations is not None and finished:
            self.pager.activations.pass_ends()
        for block, holds in list(self.backward_holds.items()):
            self.uses.track_kept_views(block, (), ("backward",))
            for _ in range(holds):
                self.uses.release(block)
        self.backward_holds.clear()
        if self.pager.reducer is not None:
            self.pager.reducer.backward_finished(finished)

    def _on_grad(self, param: torch.Tensor) -> None:
        slot = self.pager.grad_slots.get(id(param))
        if slot is not None:
            seg = slot[0].segments["grads"]
            if seg.state is PageState.RESIDENT:
                view, grad = seg.tensors[slot[1]], param.grad
                if grad is view:
                    return  # accumulated in its page (held by this backward: nothing to change)
                if self.pager.asleep and seg.exposed and not torch.is_grad_enabled():
                    view.copy_(grad)  # (nothing leaves while the pager sleeps: no lock, no acquire)
                    param.grad = view
                    return
        self._grad_into_page(param)

    @_locked
    def _grad_into_page(self, param: torch.Tensor) -> None:
        block, i = self.pager.grad_slots.get(id(param), (None, None))
        if block is None:
            block = self.pager.param_blocks[id(param)]
            self.pager.grad_pages.ensure_segment(block)
            block, i = self.pager.grad_slots[id(param)]
        seg = block.segments["grads"]
        acquired = not seg.resident  # a gradient for a block not acquired for backward
        if acquired:
            self.uses.acquire(block, ("grads",), record=False)
        try:
            view = seg.tensors[i]
            if param.grad is not view:
                with torch.no_grad(), guards.unguarded():
                    view.copy_(param.grad)
                param.grad = view
        finally:
            if acquired:
                self.uses.release(block)
