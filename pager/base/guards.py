"""Tensors of blocks not in use: every access is served.

[Note: paged-out tensors]
A paged-out block keeps its tensor objects (the optimizer's keys, autograd's
saved views) but their device storage has 0 bytes: a kernel that read them
would read freed memory (a segfault on the CPU device, an illegal address
that kills the CUDA context on a GPU). So a block's tensors have their own
class only while the block is in use (pinned: its forward, backward or
optimizer update runs) or while every block is resident and the pager sleeps
(nothing can leave then); once the process has several Python threads, not
even then (see [Note: tensors and threads]). Otherwise the class of each is swapped for a
subclass (`GuardedParameter` for a Parameter, `GuardedTensor` for a buffer or
an optimizer state tensor) whose `__torch_function__` serves the access: it
acquires the block for the operation (a fetch on demand if it is paged out,
ordered on the compute stream like any use), which gives the tensors their
own class back, runs the operation and releases the block. Guarding idle
resident blocks too is what makes this safe across threads: a block cannot
leave while any access to it runs. Identity and `isinstance(p, nn.Parameter)`
hold throughout; a block in use has its own classes, so the forward pays only
the swaps (about 4 us per block use of 16 tensors), and a sleeping forward
nothing. Metadata (shape, dtype, device, grad, version, hooks) is answered
without a fetch.

Results of a served access that alias the block's storage (`p.data`, `p[0]`,
`p.view(...)`) are remembered weakly with their segment: they are swapped to
the paged-out class too when it leaves (so they never dangle), and their
segment counts as dirty while they live (a write through `.data` does not
move the parameter's version counter).

The class is given back when compute has waited on the fetch (`expose`), not
when the copy is enqueued: a prefetched block's tensors stay guarded, so a
user's access between prefetch and use cannot race the copy.

A view taken while the block is in use (inside its forward, or while the
pager sleeps) is made by PyTorch alone, so pager learns of it afterwards:
see [Note: views kept from a use] in base/views.py.

Gradients that left with their block are `PagedOutGrad`s (`training/grads.py`); their
accesses are served the same way, except the ones a training loop makes
between backward and step (zeroing, scaling, norms, GradScaler's unscale),
which `GradOps.grad_op` answers without moving bytes.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import ExitStack
from typing import Any, cast

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .common import outside_compile
from .conversions import put_back_converted
from .registry import TENSORS, entry_of, register, unguarded, unregister  # noqa: F401 (register, unregister: used as _paged.*)
from .saving import saving
from .wrappers import inner_tensors, is_wrapper, rebuilt


# ------------------------------------------------------------- the classes
def _names(kind, names):
    return {getattr(getattr(torch.Tensor, n), kind) for n in names if hasattr(torch.Tensor, n)}


# Answered from the tensor object alone: no fetch.
_METADATA = (
    _names(
        "__get__",
        [
            "shape",
            "dtype",
            "device",
            "requires_grad",
            "grad",
            "is_leaf",
            "grad_fn",
            "_version",
            "layout",
            "ndim",
            "names",
            "is_cuda",
            "is_cpu",
            "is_meta",
            "is_sparse",
            "is_sparse_csr",
            "is_quantized",
            "is_mkldnn",
            "is_nested",
            "is_mps",
            "is_xpu",
            "retains_grad",
            "output_nr",
            "itemsize",
            "nbytes",
            "_backward_hooks",
            "_post_accumulate_grad_hooks",
            "name",
            "_cdata",
            "_grad",
            "_grad_fn",
        ],
    )
    | _names(
        "__set__",
        [
            "grad",
            "requires_grad",
            "_backward_hooks",
            "_post_accumulate_grad_hooks",
            "name",
            "_grad",
        ],
    )
    | {
        getattr(torch.Tensor, n)
        for n in [
            "size",
            "dim",
            "numel",
            "nelement",
            "stride",
            "storage_offset",
            "is_contiguous",
            "element_size",
            "get_device",
            "is_floating_point",
            "is_complex",
            "is_signed",
            "requires_grad_",
            "register_hook",
            "register_post_accumulate_grad_hook",
            "retain_grad",
            "__len__",
            "_is_view",
            "is_inference",
            "is_conj",
            "is_neg",
            "__dir__",
            "__hash__",
            "_fix_weakref",
        ]
        if hasattr(torch.Tensor, n)
    }
    | {
        torch.numel,
        torch.is_floating_point,
        torch.is_complex,
    }
    | {getattr(torch._C, n) for n in ["_group_tensors_by_device_and_dtype"] if hasattr(torch._C, n)}
)
_DATA_SET = cast(Any, torch.Tensor.data).__set__  # (a descriptor: torch's stubs type `data` as a Tensor)
_DATA_GETTER = cast(Any, torch.Tensor.data).__get__
_GRAD_SETTERS = _names("__set__", ["grad", "_grad"])
# Views that read no element: answered without a fetch by a view that is
# itself guarded (and remembered with its segment, so it never dangles).
_VIEWS = (
    _names("__get__", ["data", "T", "mT"])
    | {
        getattr(torch.Tensor, n)
        for n in [
            "detach",
            "view",
            "view_as",
            "t",
            "transpose",
            "swapaxes",
            "permute",
            "movedim",
            "unsqueeze",
            "squeeze",
            "expand",
            "expand_as",
            "narrow",
            "select",
            "unflatten",
            "as_strided",
            "unbind",
            "split",
            "chunk",
        ]
        if hasattr(torch.Tensor, n)
    }
    | {
        getattr(torch, n)
        for n in [
            "detach",
            "t",
            "transpose",
            "swapaxes",
            "permute",
            "movedim",
            "unsqueeze",
            "squeeze",
            "narrow",
            "select",
            "unflatten",
            "as_strided",
            "unbind",
            "split",
            "chunk",
        ]
        if hasattr(torch, n)
    }
)


def _torch_function(cls, func, types, args=(), kwargs=None):
    return handle(func, args, kwargs or {})


def _deepcopy(self, memo):
    # Served with the tensor's own class back (these build the copy from
    # type(self)), so the copy is of that class, never a Guarded one.
    return serve(lambda: self.__deepcopy__(memo), [self], expose=True)


def _reduce_ex(self, proto):
    return serve(lambda: self.__reduce_ex__(proto), [self], expose=True)


class GuardedTensor(torch.Tensor):
    """The class of a buffer, optimizer-state tensor, gradient or view while its block is not in use."""

    __torch_function__ = classmethod(outside_compile(_torch_function))  # (never traced)
    __deepcopy__ = _deepcopy
    __reduce_ex__ = _reduce_ex


class GuardedParameter(nn.Parameter):
    """The class of a Parameter while its block is not in use (still a Parameter)."""

    __torch_function__ = classmethod(outside_compile(_torch_function))  # (never traced)
    __deepcopy__ = _deepcopy
    __reduce_ex__ = _reduce_ex


_GUARDS: dict = {torch.Tensor: GuardedTensor, nn.Parameter: GuardedParameter}
GUARD_TYPES: set[type] = {GuardedTensor, GuardedParameter}
STAND_INS: set = set()  # classes that stand for a tensor with no storage (PagedOutGrad, training/grads.py)
_PLAIN_TORCH_FUNCTIONS = (torch.Tensor.__torch_function__, torch._C._disabled_torch_function_impl)


def allow_foreach(*classes) -> None:
    """Let torch's foreach paths (clip_grad_norm_, optimizers) take our
    classes: `_has_foreach_support` accepts only exact Tensor and Parameter
    types, and would send a list holding one guarded tensor down a per-tensor
    path, one served call per tensor (measured: clip 30 ms instead of 1 ms on
    a 1B model). The foreach kernels never see them: the list is answered or
    run by `handle` with the tensors as they are."""
    import importlib

    # Each keeps its own list (torch.optim's decides foreach vs a loop per
    # tensor: without ours it would loop, slower and not bitwise the same).
    for module in ("torch.utils._foreach_utils", "torch.optim.optimizer"):
        try:
            supported = getattr(importlib.import_module(module), "_foreach_supported_types", None)
        except ImportError:
            continue
        if isinstance(supported, list):
            supported.extend(c for c in classes if c not in supported)


allow_foreach(GuardedTensor, GuardedParameter)


def guard_class(cls):
    """The guard class for tensors of class `cls`: for a class with the plain
    `__torch_function__`, one serving every access by `handle`; for a wrapper
    subclass (a quantized weight) that runs its own, one serving each access
    with the block's tensors in their own classes ([Note: wrapper-subclass
    weights] in base/wrappers.py); None for another class with its own
    `__torch_function__`, which a guard would bypass."""
    guard = _GUARDS.get(cls)
    if guard is None and cls not in GUARD_TYPES:
        if _plain_torch_function(cls):
            guard = type(
                f"Guarded{cls.__name__}",
                (cls,),
                {
                    "__torch_function__": classmethod(_torch_function),
                    "__deepcopy__": _deepcopy,
                    "__reduce_ex__": _reduce_ex,
                    "__module__": __name__,
                },
            )
        elif hasattr(cls, "__tensor_flatten__"):
            guard = type(
                f"Guarded{cls.__name__}",
                (cls,),
                {
                    "__torch_function__": classmethod(outside_compile(_wrapper_torch_function)),
                    "__deepcopy__": _deepcopy,
                    "__reduce_ex__": _reduce_ex,
                    "__repr__": _wrapper_repr,
                    "guarded_class": cls,
                    "__module__": __name__,
                },
            )
        if guard is not None:
            GUARD_TYPES.add(guard)
        _GUARDS[cls] = guard
    return guard


def _plain_torch_function(cls) -> bool:
    tf = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    return tf in {getattr(f, "__func__", f) for f in _PLAIN_TORCH_FUNCTIONS}


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
# with the page at once (`_remember_wrapper_views`; `_swap_to_guard` takes it
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


def _wrapper_torch_function(cls, func, types, args=(), kwargs=None):
    """A paged-out quantized weight: metadata from the wrapper itself, every
    other access with its block acquired and its tensors in their own classes,
    so the wrapper's own `__torch_function__` and kernels run (its inner
    tensors' guards would not see what runs below its `__torch_dispatch__`).
    One of its guard class that no block owns runs as its own class ([Note:
    guard-class wrappers pager did not guard])."""
    kwargs = kwargs or {}
    if func in _METADATA:
        return handle(func, args, kwargs)
    tensors = _tensors_of(args, kwargs)
    if any(type(t) in GUARD_TYPES and t in ORPHANS for t in tensors):
        raise RuntimeError(_ORPHANED_WRAPPER)
    paged = [t for t in tensors if type(t) in STAND_INS or (type(t) in GUARD_TYPES and entry_of(t) is not None)]
    if func in _DETACH and paged:  # (an alias by contract, which reads no bytes: a state_dict() fetches nothing)
        return _detached_wrapper(args[0])
    if func == _DATA_SET and paged and _unserved(paged) != []:
        # (`w.data = other` would change the wrapper's sizes while its page kept
        # the old bytes, which the forward reads: refused as a plain tensor's is)
        return handle(func, args, kwargs)
    # No guarded tensor of a block, or their blocks pinned by this thread
    # (shared mode: in use, still guarded; their inner tensors pass their
    # guards unserved too): the wrapper's own `__torch_function__` runs.
    if not paged or _unserved(paged) == []:
        if not paged and any(_storage_gone(t) for t in tensors if type(t) in GUARD_TYPES):
            raise RuntimeError(_ORPHANED_WRAPPER)  # (a view pager never saw, of a page gone at unwrap)
        own = cls.guarded_class
        result = own.__torch_function__(func, tuple(own if t is cls else t for t in types), args, kwargs)
        if paged:
            _remember_wrapper_views(result)
        return result
    return _serve_owners(owners_of(tensors), lambda: func(*args, **kwargs), func, expose=True)


def _remember_wrapper_views(result) -> None:
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


def _detached_wrapper(t):
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


def _wrapper_repr(self):
    if self in ORPHANS:
        raise RuntimeError(_ORPHANED_WRAPPER)
    if _unserved([self]) == []:  # its block pinned by this thread (shared mode): a serving would open it to all
        return _own_repr(self)
    return serve(lambda: _own_repr(self), [self], expose=True)  # (in its own class: a subclass may print type(self))


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


# [Note: the class of a tensor in use]
# A tensor of a block in use has, instead of its own class, a subclass of it
# that differs in one thing: reading `.data` marks its segment dirty. A write
# through a `.data` alias (`m.weight.data.mul_(mask)` in a pre-hook) moves no
# version counter pager sees ([Note: dirty by version counter]), and the alias
# may be gone before anything could count it, so the read itself is the only
# sign. The subclass keeps `__torch_function__` disabled, as Parameter does,
# so every operation takes the same C++ path as on the own class; deepcopy and
# pickling run with the own class (they build the copy from `type(self)`).


def _data_get(self):
    entry = TENSORS.get(id(self))
    if entry is not None:
        entry[2].force_dirty = True
    return _DATA_GETTER(self)


def _with_own_class(name):
    def method(self, *args):
        in_use = type(self)
        self.__class__ = in_use.own_class
        try:
            return getattr(self, name)(*args)
        finally:
            self.__class__ = in_use

    return method


_IN_USE: dict = {}
IN_USE_TYPES: set = set()


def in_use_class(cls):
    """The class a tensor of own class `cls` has while its block is in use
    (see the Note); `cls` itself if `cls` runs its own `__torch_function__`."""
    in_use = _IN_USE.get(cls)
    if in_use is None:
        in_use = cls
        if _plain_torch_function(cls):
            in_use = type(
                cls.__name__,
                (cls,),
                {
                    "data": property(_data_get, _DATA_SET),
                    "__torch_function__": torch._C._disabled_torch_function_impl,
                    "__deepcopy__": _with_own_class("__deepcopy__"),
                    "__reduce_ex__": _with_own_class("__reduce_ex__"),
                    "own_class": cls,
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                },
            )
            IN_USE_TYPES.add(in_use)
            allow_foreach(in_use)
        _IN_USE[cls] = in_use
    return in_use


def own_class(t):
    cls = type(t)
    return cls.own_class if cls in IN_USE_TYPES else cls


def guard(seg) -> None:
    """Swap the class of every tensor of `seg` (and its live aliases) for its
    guard. Idempotent."""
    seg.open = False
    if not seg.exposed:
        return
    seg.exposed = False
    seg.classes = [_swap_to_guard(t) for t in seg.tensors]
    seg.wrapper_classes = [_swap_to_guard(t) for t in seg.wrappers]
    live = []
    for ref, _cls in seg.aliases:
        t = ref()
        if t is not None:
            live.append((ref, _swap_to_guard(t)))
    seg.aliases = live


def expose(seg) -> None:
    """Give every tensor of `seg` and its live aliases its own class back."""
    if seg.exposed:
        return
    if seg.wrappers:
        _expose_quantized(seg)
    else:
        for t, cls in zip(seg.tensors, seg.classes or ()):
            if cls is not None:
                t.__class__ = in_use_class(cls)
    live = []
    for ref, cls in seg.aliases:
        t = ref()
        if t is not None:
            t.__class__ = cls
            live.append((ref, cls))
    seg.aliases = live
    if live:
        seg.force_dirty = True  # see the Note: writes through .data escape the version counter
    seg.exposed = True


def _expose_quantized(seg) -> None:
    """`expose` for a segment with quantized weights: they and their inner
    tensors get exactly their own classes (a compiled graph unwraps a wrapper
    subclass into its inner tensors and knows no other subclass among them;
    they are frozen, so a `.data` read need not mark them dirty), the others
    their class in use."""
    for t, cls in zip(seg.tensors, seg.classes or ()):
        if cls is not None:
            t.__class__ = cls if id(t) in seg.inner_ids else in_use_class(cls)
    for t, cls in zip(seg.wrappers, seg.wrapper_classes):
        t.__class__ = cls


def open_to_pinning_threads(seg) -> None:
    """Shared mode: `seg` stays guarded, but the threads that pinned its block
    pass the guard unserved ([Note: tensors and threads])."""
    seg.open = True
    if any(ref() is not None for ref, _cls in seg.aliases):
        seg.force_dirty = True  # as in `expose`: writes through .data escape the version counter


def release(seg) -> None:
    """At unwrap: the segment's tensors keep their own class for good; views
    handed out by served accesses (they alias storage about to be freed)
    stay guarded with no owner, so using one is a clear error."""
    for t, cls in zip(seg.tensors, seg.classes or ()):
        if cls is not None:
            t.__class__ = cls
    for t, cls in zip(seg.wrappers, seg.wrapper_classes):
        t.__class__ = cls
    seg.exposed = True
    for ref, _cls in seg.aliases:
        t = ref()
        if t is not None:
            if type(t) not in GUARD_TYPES:
                _swap_to_guard(t)
            ORPHANS[t] = True
    unregister(seg)


def _swap_to_guard(t):
    cls = unguarded_class(t) if type(t) in GUARD_TYPES else own_class(t)  # (a wrapper a guarded one made)
    guard = guard_class(cls)
    if guard is None:
        return None
    t.__class__ = guard
    return cls


# ------------------------------------------------------------- serving
def handle(func, args, kwargs):
    """`__torch_function__` of every paged-out tensor (PagedOutGrad too)."""
    if func in _METADATA:
        entry = entry_of(args[0]) if func in _GRAD_SETTERS else None
        with torch._C.DisableTorchFunctionSubclass():
            if entry is None:
                return func(*args, **kwargs)
            with entry[0].lock:  # not in the middle of a deferred update ([Note: a deferred update touches ...])
                return func(*args, **kwargs)
    if func == _DATA_SET and len(args) > 1 and (args[1] is args[0] or _same_place(args[0], args[1])):
        # (`t.data = t`: `module.to()` to the device and dtype it has; `t.data += d`,
        # as peft's LoRA merge writes: the getter's view, changed in place, given
        # back. Nothing changes.)
        return None
    tensors = _tensors_of(args, kwargs)
    sleepers = _unserved(tensors)
    if sleepers is not None:
        if func == _DATA_GETTER:  # as the in-use class does ([Note: the class of a tensor in use])
            entry_of(args[0])[2].force_dirty = True
        if func is torch.Tensor.__repr__ or func is torch.Tensor.__format__:  # printed from a copy, as served below
            func, args = _printed, (func, *args)
        result = _run_unserved(func, args, kwargs, sleepers)
        if result is not _WOKE:
            return result
    if func == _DATA_SET:  # (a method-wrapper: equal, not the same object, each time)
        name, entry = _name_of(args[0]), entry_of(args[0])
        undone = put_back_converted(entry[0]) if entry is not None else []
        raise RuntimeError(
            f"pager: assigning `.data` of {name} outside its block's use would take it out of its page "
            f"(pager would keep paging the old bytes); a wrapped model's dtype and device stay as wrap made "
            f"them (`model.to(...)`, `.half()`: unwrap, convert, wrap again). To change a value, copy into it: "
            f"`with torch.no_grad(): tensor.copy_(new)`."
            + (f" The {len(undone)} tensors changed before this one are as they were." if undone else "")
        )
    if any(type(t) in GUARD_TYPES and not owners_of([t]) for t in tensors):
        raise RuntimeError(
            "pager: this tensor is a view of a paged block's storage taken before `pager.unwrap`; the "
            "model's tensors have their own memory since, and this view has none. Take the view again "
            "from the unwrapped model."
        )
    if func in _VIEWS and not any(type(t) in STAND_INS for t in tensors):
        return _paged_out_view(func, args, kwargs)
    if func is torch.Tensor.__repr__ or func is torch.Tensor.__format__:
        # Printed from a copy, so the guard's class name does not show (a
        # stand-in's: of the gradient it stands for, back on the device).
        return serve(lambda: _printed(func, *args, **kwargs), [args[0]])
    if func in _NUMPY:
        # numpy() shares memory, which a page cannot (its storage must stay
        # resizable): a read-only copy, so a write through it is an error.
        array = serve(lambda: func(_unguarded_clone(_real(args[0])), *args[1:], **kwargs), [args[0]])
        array.flags.writeable = False
        return array
    owners = owners_of(tensors)
    if len(owners) == 1:
        pager, wanted = next(iter(owners.items()))
        answer = pager.grad_ops.grad_op(func, args, kwargs, wanted)
        if answer is not NotImplemented:
            return answer
    if _is_foreach(func, args) and sum(map(len, owners.values())) > 1:
        return _serve_foreach(func, args, kwargs)
    return _serve_owners(owners, lambda: _call(func, args, kwargs), func)


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


def _unserved(tensors):
    """Shared mode: may this operation run on `tensors` unserved? Yes if each
    guarded one's block is pinned by this thread (and open), or its pager
    sleeps. Returns the sleeping pagers involved (see `_run_unserved`), or
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


_WOKE = object()


def _run_unserved(func, args, kwargs, sleepers):
    """Run an operation unserved. On a sleeping pager it counts as a reader
    first, then checks the pager still sleeps: `Hooks.wake` clears `asleep` first,
    then waits for the readers, so no access that began asleep is running when
    something leaves. `_WOKE` if one woke meanwhile (serve it instead)."""
    me = threading.get_ident()
    for pager in sleepers:
        pager.asleep_readers.append(me)
    try:
        if not all(pager.asleep for pager in sleepers):
            return _WOKE
        if sleepers and torch.is_grad_enabled():  # a graph built outside a forward: count what it saves
            with unguarded(), saving(count=True):
                return func(*args, **kwargs)
        with unguarded():
            return func(*args, **kwargs)
    finally:
        for pager in sleepers:
            pager.asleep_readers.remove(me)


def _tensors_of(args, kwargs) -> list:
    """The tensors among an operation's arguments. Flat ones directly (a
    pytree walk costs more than the operation it guards), nested ones through
    the pytree."""
    out = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    out.append(item)
                elif isinstance(item, (list, tuple, dict)):
                    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        elif isinstance(value, dict):
            return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return out


def _is_foreach(func, args) -> bool:
    return (
        getattr(func, "__name__", "").startswith(("_foreach_", "_amp_foreach_"))
        and bool(args)
        and isinstance(args[0], (list, tuple))
    )


def _serve_foreach(func, args, kwargs):
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
        result = _serve_owners(owners_of(tensors), lambda part=part: _call(func, part, kwargs), func)
        if isinstance(result, (list, tuple)):
            returns_list = True
            for k, r in zip(idx, result):
                out[k] = r
    return out if returns_list else None


_NUMPY: set = {torch.Tensor.numpy, torch.Tensor.__array__}


def _paged_out_view(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
    for r in tree_leaves(result):
        if isinstance(r, torch.Tensor):
            entry = entry_of(r)
            if entry is not None and id(r) not in TENSORS:
                remember_alias(entry[2], r)
    return result


def _printed(func, t, *args, **kwargs):
    return func(_unguarded_clone(_real(t), keep_requires_grad=True), *args, **kwargs)


def _unguarded_clone(t, keep_requires_grad=False):
    with unguarded():
        copy = t.detach().clone()
    return copy.requires_grad_(True) if keep_requires_grad and t.requires_grad else copy


def serve(fn, tensors, expose: bool = False):
    """Run `fn()` with the blocks of `tensors` acquired (fetched on demand)."""
    return _serve_owners(owners_of(tensors), fn, expose=expose)


def _serve_owners(owners, fn, func=None, expose: bool = False):
    with ExitStack() as stack:
        for pager, wanted in owners.items():
            stack.enter_context(pager.serve.serving(wanted, expose))
        result = fn()
        for pager, wanted in owners.items():
            pager.serve.served(wanted, result, writes=func is not None and writes_in_place(func))
        return result


def writes_in_place(func) -> bool:
    """Does `func` write into its first argument? (By name, as torch names them.)"""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS


_IN_PLACE_DUNDERS = {
    "__setitem__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ifloordiv__",
    "__imod__",
    "__ipow__",
    "__iand__",
    "__ior__",
    "__ixor__",
    "__ilshift__",
    "__irshift__",
}


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


def _real(tree):
    """Replace every PagedOutGrad by the gradient it stands for (its block acquired)."""
    return tree_map(lambda t: t.current() if type(t) in STAND_INS else t, tree)


# Reads that build no graph (and whose output would show the identity node).
_NO_GRAPH = {
    "__repr__",
    "__format__",
    "__str__",
    "__reduce_ex__",
    "__deepcopy__",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__array__",
    "__len__",
    "__contains__",
    "tolist",
    "item",
    "numpy",
    "data_ptr",
    "untyped_storage",
    "equal",
    "allclose",
}


def _call(func, args, kwargs):
    """Run `func` on the acquired blocks' tensors. If it builds a graph, its
    inputs from blocks pass through `PostBackward` (an identity whose backward
    releases the block), so the backward of this operation holds the block
    only while it runs, as a block's own forward does."""
    with unguarded():  # the tensors stay guarded for other threads; this thread's access is pinned
        return _call_pinned(func, args, kwargs)


def _call_pinned(func, args, kwargs):
    args, kwargs = _real(args), _real(kwargs)
    if not torch.is_grad_enabled() or writes_in_place(func) or getattr(func, "__name__", "") in _NO_GRAPH:
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


def _same_place(t, value) -> bool:
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


def remember_alias(seg, t) -> bool:
    """Track a view of `seg`'s storage: guarded while the segment is, and,
    while it is in use, a reason to write the segment back (a write through
    `.data` moves no version counter of the segment's tensors; writes through
    a guarded view are served and marked then). True if it was new."""
    new = not any(ref() is t for ref, _cls in seg.aliases)
    if new:
        cls = type(t)
        if not seg.exposed:  # the block is idle (or open to its threads only): so is the view
            cls = _swap_to_guard(t)
            if cls is None:
                return False
        # Dead entries go as new ones come (a block that never leaves is never guarded again).
        seg.aliases = [(ref, c) for ref, c in seg.aliases if ref() is not None]
        seg.aliases.append((weakref.ref(t), cls))
    if seg.exposed or seg.open:
        seg.force_dirty = True
    return new


def _name_of(t) -> str:
    entry = entry_of(t)
    if entry is None:
        return "a tensor"
    _pager, block, seg = entry
    for slot, tensor in zip(seg.slots, seg.tensors):
        if tensor is t:
            return f"{slot.name!r} (block {block.name!r})"
    return f"a view of block {block.name!r}"


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
