"""What the pager's modules share: segment kinds, tunables, the registry of
wrapped models, the budget error, and the lock decorator."""

from __future__ import annotations

import contextlib
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
NEVER_RAN_STEPS = 10  # after this many steps, say which blocks never ran
STALL_WINDOW_STEPS = 10  # judge stalls over windows of this many steps
STALL_SHARE = 0.5  # warn when compute waited for fetches this share of the time
ROOM_WAIT_SECONDS = 60.0  # a use waits this long for room held by other threads' uses, then fails
SHARE_WINDOW = 16  # models sharing an engine split its room by their use in this many last requests

_PAGERS: weakref.WeakKeyDictionary[nn.Module, object] = weakref.WeakKeyDictionary()


WORKER_PREFIX = "pager-"  # the name of every thread pager starts (they never touch a model's tensors)


def outside_compile(hook: _F) -> _F:
    """`hook` as it runs under `torch.compile`: eagerly, outside every
    compiled graph ([Note: pager under torch.compile] in model/hooks.py)."""
    return torch.compiler.disable(hook, recursive=True)


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
