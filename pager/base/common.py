"""What the pager's modules share: segment kinds, tunables, the registry of
wrapped models, the budget error, and the lock decorator."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn as nn

_F = TypeVar("_F", bound=Callable[..., Any])

# Segment kinds a use needs (see base/block.py): "frozen" is the page of a
# block's parameters that do not require grad, where it also has some that do.
WEIGHTS = ("weights", "frozen")
BACKWARD = ("weights", "frozen", "grads")
STEP = ("weights", "frozen", "grads", "state")
EVERYONE = "everyone"  # Uses.acquire(expose=EVERYONE): own classes even in the shared mode (a deepcopy)
PREFETCH_WINDOW = 16  # how many predicted uses prefetch looks through
LEAST_MOVED_BYTES = 1 << 20  # a remainder module smaller than this stays ([Note: nothing resident by force])
NEVER_RAN_STEPS = 10  # after this many steps, say which blocks never ran
STALL_WINDOW_STEPS = 10  # judge stalls over windows of this many steps
STALL_SHARE = 0.5  # warn when compute waited for fetches this share of the time
ROOM_WAIT_SECONDS = 60.0  # a use waits this long for room held by other threads' uses, then fails
SHARE_WINDOW = 16  # models sharing an engine split its room by their use in this many last requests

_dry = threading.local()  # `dry_running`: this thread measures a forward on fake tensors (training/dry_run.py)


def dry_running() -> bool:
    """This thread runs a forward on fake tensors to measure it
    (training/dry_run.py): pager's hooks stand aside."""
    return getattr(_dry, "on", False)


def set_dry_running(on: bool) -> None:
    _dry.on = on


_PAGERS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()  # model -> its Pager


WORKER_PREFIX = "pager-"  # the name of every thread pager starts (they never touch a model's tensors)


def outside_compile(hook: _F) -> _F:
    """`hook` as it runs under `torch.compile`: eagerly, outside every
    compiled graph ([Note: pager under torch.compile] in model/hooks.py)."""
    return torch.compiler.disable(hook, recursive=True)


# [Note: a wrapped model is not pickled or copied]
# The hooks pager registers on a user's modules belong to this process's
# pager: its blocks, its host pages, its lock. `torch.save(model)`,
# `pickle.dumps(model)` and `copy.deepcopy(model)` reach them through the
# modules' hook dicts. Pickled as closures they fail with an `AttributeError`
# on a local object that names neither pager nor the fix; deep-copied, a
# function is shared, not copied, so the copy's forward drives the
# original's pager (fetches the original's blocks, counts as its steps,
# fails once it is unwrapped). So each such hook is a `ModelHook`, whose
# `__reduce_ex__` and `__deepcopy__` refuse, naming the ways that work. A
# module's hook dicts come before its submodules in its `__dict__`, so the
# root's hooks refuse before any block's tensor is copied (the root's own
# parameters, of the remainder, come before them).
_NOT_PICKLED = (
    "pager: a model wrapped by pager cannot be pickled (torch.save(model, ...), pickle.dumps(model)): the hooks "
    "on its modules belong to this process's pager. Save its weights instead: torch.save(model.state_dict(), "
    "path) works while it is wrapped (read back with model.load_state_dict), as does pager.save(model, path) "
    "(a safetensors file, a block at a time); or call pager.unwrap(model) first."
)
_NOT_COPIED = (
    "pager: a model wrapped by pager cannot be deep-copied (copy.deepcopy(model)): the copy would keep the "
    "original's hooks, so its forward would run through the original's pager and blocks. Copy it before "
    "pager.wrap, or build another and load the weights, other.load_state_dict(model.state_dict()) (works "
    "while it is wrapped); or call pager.unwrap(model) first."
)


class ModelHook(functools.partial):
    """A hook pager registers on a user's module: calls its function, and
    refuses to be pickled or deep-copied, naming the fix ([Note: a wrapped
    model is not pickled or copied]). A `functools.partial` of no arguments:
    its call is C's, the hot path's cost is the function's own."""

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_PICKLED)

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPIED)


def model_hook(fn: Callable[..., Any], *, traced: bool = False) -> ModelHook:
    """`fn` as a hook on a user's module ([Note: a wrapped model is not
    pickled or copied]): run eagerly, outside every compiled graph, as
    `outside_compile`; `traced`: traced by `torch.compile` where it is
    compiled."""
    return ModelHook(fn if traced else outside_compile(fn))


class BudgetError(RuntimeError):
    """The blocks that must be on the device at once do not fit the budget.

    `least_budget_bytes`: where pager worked it out, the least budget that
    holds what was refused (else None)."""

    def __init__(self, message: str, least_budget_bytes: int | None = None):
        super().__init__(message)
        self.least_budget_bytes = least_budget_bytes


_NO_RANGE = contextlib.nullcontext()


def _record_range(what: str, block_name: str):
    """The profiler range `pager::<what>[<block_name>]`, only while a profiler
    runs (a range costs ~5 us even with none: a few ms per forward of many
    small blocks; its name is made only then)."""
    if not torch._C._autograd._profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(f"pager::{what}[{block_name}]")


def _locked(method):
    """Run a pager entry point under the pager's lock.

    [Note: threads]
    Hooks run on the thread that calls forward, and backward hooks on the
    autograd engine's threads. One re-entrant lock per pager makes each entry
    point (a block's use or release, a backward hook, a step) atomic, so two
    threads running forward on one model interleave at block granularity
    with correct pin counts; if their blocks together exceed the budget, one
    waits for the other's ([Note: waiting for room] in engine/waiting.py), never a
    corrupted state.
    """

    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    locked.__name__, locked.__doc__ = method.__name__, method.__doc__
    return locked
