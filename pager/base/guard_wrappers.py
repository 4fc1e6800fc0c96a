"""Guards of wrapper subclasses (quantized weights) that run their own
`__torch_function__`: their accesses served with the block's tensors in their
own classes ([Note: wrapper-subclass weights] in base/wrappers.py), and the
wrappers their kernels make in the guard's class
([Note: guard-class wrappers pager did not guard]). The guard classes are
made in base/guards.py (`guard_class`), which imports this module and
gives it its serving functions (`wrapper_torch_function_for`)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from . import served
from .registry import GUARD_TYPES, STAND_INS, TENSORS, entry_of
from .tensor_ops import DATA_SET, METADATA, tensors_of
from .wrappers import inner_tensors, is_wrapper, rebuilt

# [Note: guard-class wrappers pager did not guard]
# A wrapper subclass makes new wrappers in the class it is called with:
# `__tensor_unflatten__` as `cls(...)`, its kernels as `self.__class__(...)`.
# So a guarded quantized weight begets objects of its guard class that pager
# never swapped: torch.compile's fake of it (meta_utils rebuilds a wrapper by
# `type(t).__tensor_unflatten__` and then asks the fake `is_conj()`,
# `_is_view()`, ...: in the shared mode a weight in use keeps its guard, so
# this happens at every compile), and what its kernels return to a pinning
# thread (`w.clone()`, `w.t()`). Such an object has the guard's class but
# none of its reasons. One that holds no page's bytes (a fake, a copy)
# belongs to no block: it runs as its own class, with nothing to serve. One
# that aliases a page is found by its storage (`entry_of`) and served like
# any view of it; one the kernels of a weight in use return is remembered
# with the page at once (`_remember_wrapper_views`; `swap_to_guard` takes it
# as it is), so that unwrap can let it go. So "no block" does not mean
# "orphaned": only views pager guarded and let go at unwrap (`release` puts
# them in ORPHANS) are refused; `_storage_gone` catches a view of a page gone
# that was never remembered. Its repr prints a copy in its own class
# (`_own_repr`): through the guard it would call itself.
ORPHANS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # views whose segment went at unwrap (`release`)
_ORPHANED_WRAPPER = (
    "pager: this quantized tensor is a view of a paged block's storage taken before `pager.unwrap`; "
    "the model's tensors have their own memory since, and this view has none. Take the view again "
    "from the unwrapped model."
)


def wrapper_torch_function_for(handle, remember_alias):
    """The `__torch_function__` of a quantized wrapper's guard class, serving
    through `handle` and tracking views by `remember_alias` (base/guards.py's:
    that module makes the guard classes and imports this one, which cannot
    import it back)."""

    def wrapper_torch_function(cls, func, types, args=(), kwargs=None):
        """A paged-out quantized weight: metadata from the wrapper itself, every
        other access with its block acquired and its tensors in their own classes,
        so the wrapper's own `__torch_function__` and kernels run (its inner
        tensors' guards would not see what runs below its `__torch_dispatch__`).
        One of its guard class that no block owns runs as its own class ([Note:
        guard-class wrappers pager did not guard])."""
        kwargs = kwargs or {}
        if func in METADATA:
            return handle(func, args, kwargs)
        tensors = tensors_of(args, kwargs)
        if any(type(t) in GUARD_TYPES and t in ORPHANS for t in tensors):
            raise RuntimeError(_ORPHANED_WRAPPER)
        paged = [t for t in tensors if type(t) in STAND_INS or (type(t) in GUARD_TYPES and entry_of(t) is not None)]
        if func in _DETACH and paged:  # (an alias by contract, which reads no bytes: a state_dict() fetches nothing)
            return _detached_wrapper(args[0], remember_alias)
        if func == DATA_SET and paged and served.unserved(paged) != []:
            # (`w.data = other` would change the wrapper's sizes while its page kept
            # the old bytes, which the forward reads: refused as a plain tensor's is)
            return handle(func, args, kwargs)
        # No guarded tensor of a block, or their blocks pinned by this thread
        # (shared mode: in use, still guarded; their inner tensors pass their
        # guards unserved too): the wrapper's own `__torch_function__` runs.
        if not paged or served.unserved(paged) == []:
            if not paged and any(_storage_gone(t) for t in tensors if type(t) in GUARD_TYPES):
                raise RuntimeError(_ORPHANED_WRAPPER)  # (a view pager never saw, of a page gone at unwrap)
            own = cls.guarded_class
            result = own.__torch_function__(func, tuple(own if t is cls else t for t in types), args, kwargs)
            if paged:
                _remember_wrapper_views(result, remember_alias)
            return result
        return served.serve_owners(served.owners_of(tensors), lambda: func(*args, **kwargs), func, expose=True)

    return wrapper_torch_function


def _remember_wrapper_views(result, remember_alias) -> None:
    """Wrappers of a guard class that the kernels of a weight in use by this
    thread returned as views of its page (`aten.detach`, `w.t()`): tracked
    like any view of the page, so that a later use is served and an unwrap
    makes them refuse ([Note: guard-class wrappers pager did not guard])."""
    for r in tree_leaves(result):
        if type(r) in GUARD_TYPES and is_wrapper(r) and id(r) not in TENSORS:
            entry = entry_of(r)
            if entry is not None:
                remember_alias(entry[2], r)


def _storage_gone(t) -> bool:
    """Whether wrapper `t` has an inner tensor whose storage holds no bytes
    (a page's, released since) though it has elements."""
    return is_wrapper(t) and any(
        inner.numel() > 0 and inner.untyped_storage().nbytes() == 0 for _n, inner in inner_tensors(t)
    )


_DETACH = {torch.Tensor.detach, torch.detach}


def _detached_wrapper(t, remember_alias):
    """`t.detach()` of a guarded quantized weight, without its bytes: run in
    its own class, the result remembered as a view of its block."""
    entry = entry_of(t)
    with entry[0].lock:  # (nothing exposes or guards it meanwhile)
        guard = type(t)
        t.__class__ = guard.guarded_class
        try:
            alias = t.detach()
        finally:
            t.__class__ = guard
        remember_alias(entry[2], alias)
    return alias


def unguarded_class(t):
    """The class of `t` without its guard (its own, while its block is in use)."""
    return getattr(type(t), "guarded_class", type(t))


def wrapper_repr(self):
    if self in ORPHANS:
        raise RuntimeError(_ORPHANED_WRAPPER)
    if served.unserved([self]) == []:  # its block pinned by this thread (shared mode): a serving would open it to all
        return _own_repr(self)
    # (in its own class: a subclass may print type(self))
    return served.serve(lambda: _own_repr(self), [self], expose=True)


def _own_repr(t) -> str:
    """repr of wrapper `t` in its own class: given back by the serving, or,
    for one of its guard class that pager did not guard (no block's, or not
    among its segment's tensors and views: [Note: guard-class wrappers pager
    did not guard]), printed from a copy of the wrapper."""
    guard = type(t)
    if guard not in GUARD_TYPES:
        return repr(t)
    # A new wrapper of its own class around the same inner tensors: `t`'s own
    # class never changes, so no other thread sees it unguarded meanwhile.
    return repr(rebuilt(t, dict(inner_tensors(t)), guard.guarded_class))
