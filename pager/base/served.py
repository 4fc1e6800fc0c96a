"""Serving an access to a block's tensor while the block is not in use: the
block is acquired for the operation (fetched on demand, ordered on the
compute stream like any use), the operation runs on its tensors in their
own classes, and the block is released ([Note: paged-out tensors] in
base/guards.py, whose `handle` sends each access here). Gradients that left
with their block (`PagedOutGrad`) are served here too.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .common import outside_compile
from .registry import GUARD_TYPES, STAND_INS, TENSORS, entry_of, unguarded
from .saving import saving
from .tensor_ops import (
    NO_GRAPH,
    writes_in_place,
)
from .wrappers import is_wrapper

# [Note: tensors and threads]
# Exposing a block in use (its tensors' own class) exposes it to every
# thread: another thread's read would run unserved, unpinned, and could still
# be reading when the block is released and evicted. While the process has one
# Python thread that cannot happen, and a use pays only for the class swaps.
# Once a second thread exists (checked at each use and served access;
# `Uses.note_threads`), the pager is in the shared mode for good: a block in
# use keeps its guard, and the threads that pinned it (`Block.thread_pins`)
# pass it here unserved (a few microseconds per operation), while any other
# thread is served (the block pinned for its operation, so it cannot leave
# under it). A sleeping pager (every block resident, nothing can leave until
# it wakes) keeps the guard too, and every thread passes it unserved, counted
# as a reader; waking waits for the readers before anything may leave.


def unserved(tensors):
    """Shared mode: may this operation run on `tensors` unserved? Yes if each
    guarded one's block is pinned by this thread (and open), or its pager
    sleeps. Returns the sleeping pagers involved (see `run_unserved`), or
    None for no."""
    tid, sleepers, guarded = None, [], False
    for t in tensors:
        kind = type(t)
        if kind in STAND_INS:
            return None
        if kind not in GUARD_TYPES:
            continue
        entry = entry_of(t)
        if entry is None:
            return None
        pager, block, seg = entry
        guarded = True
        if pager.asleep:
            if pager not in sleepers:
                sleepers.append(pager)
            continue
        if not seg.open:
            return None
        if tid is None:
            tid = threading.get_ident()
        if not block.thread_pins.get(tid):
            return None
    return sleepers if guarded else None


WOKE = object()


def run_unserved(func, args, kwargs, sleepers):
    """Run an operation unserved. On a sleeping pager it counts as a reader
    first, then checks the pager still sleeps: `Hooks.wake` clears `asleep` first,
    then waits for the readers, so no access that began asleep is running when
    something leaves. `WOKE` if one woke meanwhile (serve it instead)."""
    me = threading.get_ident()
    for pager in sleepers:
        pager.asleep_readers.append(me)
    try:
        if not all(pager.asleep for pager in sleepers):
            return WOKE
        if sleepers and torch.is_grad_enabled():  # a graph built outside a forward: count what it saves
            with unguarded(), saving(count=True):
                return func(*args, **kwargs)
        with unguarded():
            return func(*args, **kwargs)
    finally:
        for pager in sleepers:
            pager.asleep_readers.remove(me)


def serve_foreach(func, args, kwargs):
    """A foreach op over tensors of several blocks, one block at a time (they
    need not fit the budget together); each element's result is the same as in
    one call. Lists as long as the first are sliced alongside it."""
    n = len(args[0])
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple)) and len(a) == n]
    groups: dict = {}
    for k in range(n):
        owners = owners_of([args[i][k] for i in lists if isinstance(args[i][k], torch.Tensor)])
        key = tuple((id(p), id(b)) for p, w in owners.items() for b in w)
        groups.setdefault(key, []).append(k)
    out = [None] * n
    returns_list = False
    for idx in groups.values():
        part = [[args[i][k] for k in idx] if i in lists else a for i, a in enumerate(args)]
        tensors = [t for i in lists for t in part[i] if isinstance(t, torch.Tensor)]
        result = serve_owners(owners_of(tensors), lambda part=part: call(func, part, kwargs), func)
        if isinstance(result, (list, tuple)):
            returns_list = True
            for k, r in zip(idx, result):
                out[k] = r
    return out if returns_list else None


def printed(func, t, *args, **kwargs):
    return func(unguarded_clone(real(t), keep_requires_grad=True), *args, **kwargs)


def unguarded_clone(t, keep_requires_grad=False):
    with unguarded():
        copy = t.detach().clone()
    return copy.requires_grad_(True) if keep_requires_grad and t.requires_grad else copy


def serve(fn, tensors, expose: bool = False):
    """Run `fn()` with the blocks of `tensors` acquired (fetched on demand)."""
    return serve_owners(owners_of(tensors), fn, expose=expose)


def serve_owners(owners, fn, func=None, expose: bool = False):
    with ExitStack() as stack:
        for pager, wanted in owners.items():
            stack.enter_context(pager.serve.serving(wanted, expose))
        result = fn()
        for pager, wanted in owners.items():
            pager.serve.served(wanted, result, writes=func is not None and writes_in_place(func))
        return result


def owners_of(tensors) -> dict:
    """{pager: {block: set of segment kinds}} for the tensors that belong to a block."""
    owners: dict = {}
    for t in tensors:
        if type(t) in STAND_INS:
            pager, block, kind = t.pager, t.block, "grads"
        else:
            entry = entry_of(t)
            if entry is None:
                continue
            pager, block, seg = entry
            kind = seg.kind
        owners.setdefault(pager, {}).setdefault(block, set()).add(kind)
    return owners


def real(tree):
    """Replace every PagedOutGrad by the gradient it stands for (its block acquired)."""
    return tree_map(lambda t: t.current() if type(t) in STAND_INS else t, tree)


def call(func, args, kwargs):
    """Run `func` on the acquired blocks' tensors. If it builds a graph, its
    inputs from blocks pass through `PostBackward` (an identity whose backward
    releases the block), so the backward of this operation holds the block
    only while it runs, as a block's own forward does."""
    with unguarded():  # the tensors stay guarded for other threads; this thread's access is pinned
        return _call_pinned(func, args, kwargs)


def _call_pinned(func, args, kwargs):
    args, kwargs = real(args), real(kwargs)
    if not torch.is_grad_enabled() or writes_in_place(func) or getattr(func, "__name__", "") in NO_GRAPH:
        return func(*args, **kwargs)
    by_block: dict = {}
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            entry = entry_of(t)
            if entry is not None and entry[1].trainable:
                by_block.setdefault((entry[0], entry[1]), {})[id(t)] = t
    swap: dict = {}
    back: dict = {}
    for (pager, block), tensors in by_block.items():
        outs = PostBackward.apply(pager.hooks, block, *tensors.values())
        swap.update(zip(tensors.keys(), outs))
        back.update((id(o), t) for o, t in zip(outs, tensors.values()))
    args, kwargs = tree_map(lambda t: swap.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    with saving(count=True):  # what the graph saves is autograd's, not a kept view
        result = func(*args, **kwargs)
    # An operation that returns its input (p.cpu() on the CPU) returns the input itself.
    return tree_map(lambda r: back.get(id(r), r) if isinstance(r, torch.Tensor) else r, result)


def same_place(t, value) -> bool:
    """`value` views exactly `t`'s bytes in its page (its `.data`): the same
    storage, offset, sizes, strides and dtype (a wrapper subclass, whose
    offset is its own, never)."""
    if not isinstance(value, torch.Tensor) or is_wrapper(value) or is_wrapper(t):
        return False
    mine, theirs = entry_of(t), entry_of(value)
    if mine is None or theirs is None or mine[2] is not theirs[2]:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return value.untyped_storage()._cdata == t.untyped_storage()._cdata and (
            value.dtype,
            value.shape,
            value.stride(),
            value.storage_offset(),
        ) == (t.dtype, t.shape, t.stride(), t.storage_offset())


def aliases_in(result, wanted) -> list:
    """(segment, tensor) for results that alias the storage of a block in `wanted`."""
    out = []
    for r in tree_leaves(result):
        if not isinstance(r, torch.Tensor) or type(r) in STAND_INS or id(r) in TENSORS:
            continue  # (a segment's own tensor is no alias)
        entry = entry_of(r)
        if entry is not None and entry[1] in wanted:
            out.append((entry[2], r))
    return out


class PostBackward(torch.autograd.Function):
    """Identity on a block's inputs whose backward runs once the block's is
    done: it lets the block go (`Hooks.post_backward`)."""

    @staticmethod
    def forward(ctx, hooks, block, *tensors):
        ctx.hooks, ctx.block = hooks, block
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @outside_compile
    def backward(ctx, *grads):
        ctx.hooks.post_backward(ctx.block)
        return (None, None, *grads)
