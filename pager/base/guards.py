"""Tensors of blocks not in use: every access is served.

[Note: paged-out tensors]
A paged-out block keeps its tensor objects (the optimizer's keys, autograd's
saved views) but their device storage has 0 bytes: a kernel that read them
would read freed memory (a segfault on the CPU device, an illegal address
that kills the CUDA context on a GPU). So a block's tensors have their own
class only while the block is in use (pinned: its forward, backward or
optimizer update runs) or while every block is resident and the pager sleeps
(nothing can leave then); once the process has several Python threads, not
even then (see [Note: tensors and threads] in base/served.py). Otherwise the class of each is swapped for a
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

The serving itself is `base/served.py` (`handle`, here, sends each access
there or answers it); which operations need no bytes, or write in place,
`base/tensor_ops.py`.

Gradients that left with their block are `PagedOutGrad`s (`training/grads.py`); their
accesses are served the same way, except the ones a training loop makes
between backward and step (zeroing, scaling, norms, GradScaler's unscale),
which `GradOps.grad_op` answers without moving bytes.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from . import served
from .common import outside_compile
from .conversions import put_back_converted
from .guard_wrappers import ORPHANS, unguarded_class, wrapper_repr, wrapper_torch_function_for
from .registry import (  # noqa: F401 (register, unregister: used as _paged.*)
    GUARD_TYPES,
    STAND_INS,
    TENSORS,
    entry_of,
    register,
    unguarded,
    unregister,
)
from .tensor_ops import DATA_GETTER, DATA_SET, GRAD_SETTERS, METADATA, NUMPY, VIEWS, is_foreach, tensors_of


def _torch_function(cls, func, types, args=(), kwargs=None):
    return handle(func, args, kwargs or {})


def _deepcopy(self, memo):
    # Served with the tensor's own class back (these build the copy from
    # type(self)), so the copy is of that class, never a Guarded one.
    return served.serve(lambda: self.__deepcopy__(memo), [self], expose=True)


def _reduce_ex(self, proto):
    return served.serve(lambda: self.__reduce_ex__(proto), [self], expose=True)


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
GUARD_TYPES.update((GuardedTensor, GuardedParameter))
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
                    "__repr__": wrapper_repr,
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
    return DATA_GETTER(self)


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
                    "data": property(_data_get, DATA_SET),
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
    seg.classes = [swap_to_guard(t) for t in seg.tensors]
    seg.wrapper_classes = [swap_to_guard(t) for t in seg.wrappers]
    live = []
    for ref, _cls in seg.aliases:
        t = ref()
        if t is not None:
            live.append((ref, swap_to_guard(t)))
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
    pass the guard unserved ([Note: tensors and threads] in base/served.py)."""
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
                swap_to_guard(t)
            ORPHANS[t] = True
    unregister(seg)


def swap_to_guard(t):
    cls = unguarded_class(t) if type(t) in GUARD_TYPES else own_class(t)  # (a wrapper a guarded one made)
    guard = guard_class(cls)
    if guard is None:
        return None
    t.__class__ = guard
    return cls


# ------------------------------------------------------------- serving
def handle(func, args, kwargs):
    """`__torch_function__` of every paged-out tensor (PagedOutGrad too)."""
    if func in METADATA:
        entry = entry_of(args[0]) if func in GRAD_SETTERS else None
        with torch._C.DisableTorchFunctionSubclass():
            if entry is None:
                return func(*args, **kwargs)
            with entry[0].lock:  # not in the middle of a deferred update ([Note: a deferred update touches ...])
                return func(*args, **kwargs)
    if func == DATA_SET and len(args) > 1 and (args[1] is args[0] or served.same_place(args[0], args[1])):
        # (`t.data = t`: `module.to()` to the device and dtype it has; `t.data += d`,
        # as peft's LoRA merge writes: the getter's view, changed in place, given
        # back. Nothing changes.)
        return None
    tensors = tensors_of(args, kwargs)
    sleepers = served.unserved(tensors)
    if sleepers is not None:
        if func == DATA_GETTER:  # as the in-use class does ([Note: the class of a tensor in use])
            entry_of(args[0])[2].force_dirty = True
        if func is torch.Tensor.__repr__ or func is torch.Tensor.__format__:  # printed from a copy, as served below
            func, args = served.printed, (func, *args)
        result = served.run_unserved(func, args, kwargs, sleepers)
        if result is not served.WOKE:
            return result
    if func == DATA_SET:  # (a method-wrapper: equal, not the same object, each time)
        name, entry = _name_of(args[0]), entry_of(args[0])
        undone = put_back_converted(entry[0]) if entry is not None else []
        raise RuntimeError(
            f"pager: assigning `.data` of {name} outside its block's use would take it out of its page "
            f"(pager would keep paging the old bytes); a wrapped model's dtype and device stay as wrap made "
            f"them (`model.to(...)`, `.half()`: unwrap, convert, wrap again). To change a value, copy into it: "
            f"`with torch.no_grad(): tensor.copy_(new)`."
            + (f" The {len(undone)} tensors changed before this one are as they were." if undone else "")
        )
    if any(type(t) in GUARD_TYPES and not served.owners_of([t]) for t in tensors):
        raise RuntimeError(
            "pager: this tensor is a view of a paged block's storage taken before `pager.unwrap`; the "
            "model's tensors have their own memory since, and this view has none. Take the view again "
            "from the unwrapped model."
        )
    if func in VIEWS and not any(type(t) in STAND_INS for t in tensors):
        return _paged_out_view(func, args, kwargs)
    if func is torch.Tensor.__repr__ or func is torch.Tensor.__format__:
        # Printed from a copy, so the guard's class name does not show (a
        # stand-in's: of the gradient it stands for, back on the device).
        return served.serve(lambda: served.printed(func, *args, **kwargs), [args[0]])
    if func in NUMPY:
        # numpy() shares memory, which a page cannot (its storage must stay
        # resizable): a read-only copy, so a write through it is an error.
        array = served.serve(lambda: func(served.unguarded_clone(served.real(args[0])), *args[1:], **kwargs), [args[0]])
        array.flags.writeable = False
        return array
    owners = served.owners_of(tensors)
    if len(owners) == 1:
        pager, wanted = next(iter(owners.items()))
        answer = pager.grad_ops.grad_op(func, args, kwargs, wanted)
        if answer is not NotImplemented:
            return answer
    if is_foreach(func, args) and sum(map(len, owners.values())) > 1:
        return served.serve_foreach(func, args, kwargs)
    return served.serve_owners(owners, lambda: served.call(func, args, kwargs), func)


def _paged_out_view(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
    for r in tree_leaves(result):
        if isinstance(r, torch.Tensor):
            entry = entry_of(r)
            if entry is not None and id(r) not in TENSORS:
                remember_alias(entry[2], r)
    return result


def remember_alias(seg, t) -> bool:
    """Track a view of `seg`'s storage: guarded while the segment is, and,
    while it is in use, a reason to write the segment back (a write through
    `.data` moves no version counter of the segment's tensors; writes through
    a guarded view are served and marked then). True if it was new."""
    new = not any(ref() is t for ref, _cls in seg.aliases)
    if new:
        cls = type(t)
        if not seg.exposed:  # the block is idle (or open to its threads only): so is the view
            cls = swap_to_guard(t)
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


# (a quantized wrapper's guard class serves through `handle`: base/guard_wrappers.py)
_wrapper_torch_function = wrapper_torch_function_for(handle, remember_alias)
