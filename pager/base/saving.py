"""pager's saved-tensor hooks: what autograd saves in a block's forward goes
through `_pack`, and back to the backward through `_unpack`.

`begin_saving` / `end_saving` (or `saving`) put the hooks on for one use of a
block, in one thread. What `_pack` does with an activation is decided by the
policies of `training/activations.py` (kept and counted, sent to host memory,
dropped for recomputation), passed in as objects; this module knows only the
protocol: a packed value is a `(tensor, version)` pair or an object with
`unpack()`.

[Note: autograd's saved views, counted]
With several Python threads the search of every object is out
([Note: views kept from a use] in base/views.py), so what a forward that builds a
graph leaves unaccounted for could be autograd's saved views (expected) or a
view a user keeps somewhere pager cannot look (which must keep the block on
the device). To tell them apart, the forward of a block runs, in the shared
mode, under the hooks, whose pack gives autograd its own detached alias of
each tensor it saves and remembers those on a block's storage (`seg.saved`,
weakly): they are counted, and what remains is the user's. (Packing the
tensor itself would leak: an output saved by its own node would hold itself.)
Autograd checks that a saved tensor was not changed in place only without
hooks, so `_unpack` checks the version itself. Where other hooks are already
on top (torch.utils.checkpoint, save_on_cpu: the user's policy wins), or torch
cannot say (before 2.8), nothing is counted, and the block stays until the
count drops (its backward).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch

from .common import outside_compile
from .registry import entry_of, unguarded


class _Frame:
    """One `begin_saving` in a thread: whether it pushed the hooks, whether
    it is the active frame (what `_pack` reads) while it lasts, whose hooks
    are on top, and what pack does with activations."""

    __slots__ = ("pushed", "activates", "hooks", "offload", "recompute", "ledger", "below", "saved_bytes", "storages")

    def __init__(self, pushed, activates, hooks, offload, recompute, ledger, below):
        self.pushed, self.activates, self.hooks, self.below = pushed, activates, hooks, below
        self.offload, self.recompute, self.ledger = offload, recompute, ledger
        # With a ledger: device bytes of what was saved (each storage once),
        # whatever the policy did with it: what keeping it would hold.
        self.saved_bytes, self.storages = 0, None


tls = threading.local()  # this thread's frames; `training/recompute.py` reads `recording`
# The frame of a use that saves through no hooks, pager's or others' (none pushed, none active): one for all
_NOTHING = _Frame(False, False, None, None, None, None, None)


def begin_saving(count: bool, offload=None, recompute=None, ledger=None) -> None:
    """In this thread, until the matching `end_saving`, run what autograd
    saves through pager's hooks if `count` (saved views of blocks' storage
    are counted), `offload` (an `ActivationOffload`: activations leave the
    device), `recompute` (a `Recompute`: they are dropped and computed
    again) or `ledger` (a `Ledger`: what stays on the device is counted),
    unless other saved-tensor hooks are on top (see the Notes).
    Called for every use, so that each `end_` pairs with its `begin_`."""
    top = _top_hooks()
    wants = bool(count or offload is not None or recompute is not None or ledger is not None)
    if not wants and top is None:
        _stack().append(_NOTHING)  # (an inference use, most often: nothing pushed or made)
        return
    active = getattr(tls, "active", None)
    pushed = wants and top is None
    if pushed:
        torch._C._autograd._push_saved_tensors_default_hooks(*_HOOKS)
    ours = pushed or (top is not None and top is not _UNKNOWN and top[0] is _HOOKS[0])
    if ours:
        hooks: str | None = OURS
    else:
        hooks = OTHERS if top is not None and top is not _UNKNOWN else None
    # A block's forward inside the root's (whose hooks are ours) decides for
    # what it saves: its frame is the active one until it ends.
    frame = _Frame(pushed, ours and wants, hooks, offload, recompute, ledger, active)
    if frame.activates:
        tls.active = frame
    _stack().append(frame)


def _stack() -> list:
    """This thread's open frames."""
    stack = getattr(tls, "stack", None)
    if stack is None:
        stack = tls.stack = []
    return stack


def depth() -> int:
    """How many `begin_saving` frames this thread has open."""
    return len(getattr(tls, "stack", ()))


def end_saving_to(n: int) -> None:
    """Close this thread's frames above the first `n`: those of a forward
    that an exception other than `Exception` (a KeyboardInterrupt) ended
    without its post-hooks ([Note: a forward interrupted] in model/hooks.py)."""
    while depth() > n:
        end_saving()


def end_saving():
    """Close the matching `begin_saving`. Returns its frame: `hooks` says
    which hooks were on: `OURS` (autograd's saved views of blocks were
    counted), `OTHERS` (the user's, e.g. checkpointing's recomputation: what
    they hold is unknown), or None; `saved_bytes`, what it saved on the
    ledger's device."""
    frame = tls.stack.pop()
    if frame.activates:
        tls.active = frame.below
    if frame.pushed:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    return frame


def begin_foreign(pack, unpack) -> bool:
    """Put saved-tensor hooks of pager's that are no block's (a call of
    paged experts: experts/saved.py) on top in this thread, as a frame of
    its stack: `end_saving` takes them off, and `end_saving_to` (a forward
    interrupted) with the frames above. False (nothing put on) where torch
    has saved-tensor hooks off."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]  # (not in torch's stubs)
        return False
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    _stack().append(_Frame(True, False, OTHERS, None, None, None, getattr(tls, "active", None)))
    return True


def active_recompute():
    """The recomputation that this thread's active frame drops saves for
    (an enclosing block's forward under `activations="recompute"`), or None."""
    frame = getattr(tls, "active", None)
    return frame.recompute if frame is not None else None


def top_hooks():
    """The saved-tensor hooks on top in this thread: (pack, unpack), None, or
    another object where torch cannot say."""
    return _top_hooks()


@contextmanager
def saving(count: bool):
    begin_saving(count)
    try:
        yield
    finally:
        end_saving()


_UNKNOWN = object()
OURS, OTHERS = "ours", "others"


def _top_hooks():
    """The saved-tensor hooks on top in this thread (None: none), or
    `_UNKNOWN` where torch cannot say or hooks are disabled."""
    hooks = torch._C._autograd
    top = getattr(hooks, "_top_saved_tensors_default_hooks", None)
    if top is None or not hooks._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]  # (not in torch's stubs)
        return _UNKNOWN
    try:
        return top(True)
    except TypeError:  # (no `ignore_is_tracing` argument in some versions)
        return top()


def next_save() -> int:
    """Number this thread's next save (see [Note: saves counted across nested blocks] in training/recompute.py)."""
    number = getattr(tls, "saves", 0)
    tls.saves = number + 1
    return number


def _pack(t):
    frame = tls.active
    number = next_save()
    entry = entry_of(t)
    if entry is None and frame.ledger is not None and t.device == frame.ledger.device:
        _count(frame, t)
    if entry is None and frame.recompute is not None:
        return frame.recompute.drop(t, number)
    if entry is None and frame.offload is not None and frame.offload.wants(t):
        return frame.offload.send(t)
    with unguarded():
        saved = t.detach()  # shares the version counter
    if entry is not None:
        entry[2].saved.append(weakref.ref(saved))
    elif frame.ledger is not None and t.device == frame.ledger.device:
        return Kept(saved, frame.ledger)
    return saved, saved._version


def _count(frame, t) -> None:
    storage = t.untyped_storage()
    if frame.storages is None:
        frame.storages = set()
    elif storage.data_ptr() in frame.storages:
        return
    frame.storages.add(storage.data_ptr())
    frame.saved_bytes += storage.nbytes()


def _unpack(packed):
    if not isinstance(packed, tuple):
        return packed.unpack()  # Kept, or a policy's stand-in (sent to host memory, dropped)
    return _checked(*packed)


# Run by autograd, also inside a compiled graph's call: never traced
# ([Note: pager under torch.compile] in model/hooks.py).
_HOOKS = (outside_compile(_pack), outside_compile(_unpack))


def _checked(saved, version):
    if saved._version != version:  # autograd checks this itself only without hooks
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{saved.type()} {list(saved.shape)}] is at version {saved._version}; expected "
            f"version {version} instead. (Checked by pager's saved-tensor hooks, as autograd does.)"
        )
    return saved


class Kept:
    """An activation kept on the device, as the graph holds it: counted in
    the ledger until autograd lets go of it ([Note: one budget] in training/activations.py)."""

    __slots__ = ("saved", "version", "ledger", "key")

    def __init__(self, saved, ledger):
        self.saved, self.version, self.ledger = saved, saved._version, ledger
        self.key = ledger.hold(saved)

    def unpack(self):
        return _checked(self.saved, self.version)

    def __del__(self):
        self.ledger.let_go(self.key)
