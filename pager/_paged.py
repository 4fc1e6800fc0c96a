"""Tensors of blocks that are not on the device: every access is served.

[Note: paged-out tensors]
A paged-out block keeps its tensor objects (the optimizer's keys, autograd's
saved views) but their device storage has 0 bytes: a kernel that read them
would read freed memory (a segfault on the CPU device, an illegal address
that kills the CUDA context on a GPU). So while a segment is paged out, the
class of each of its tensors is swapped for a subclass (`PagedOutParameter`
for a Parameter, `PagedOutTensor` for a buffer or an optimizer state tensor)
whose `__torch_function__` serves the access: it acquires the block (a fetch
on demand, ordered on the compute stream like any use), which gives the
tensors their own class back, runs the operation and releases the block.
Identity and `isinstance(p, nn.Parameter)` hold throughout, and a resident
tensor has its own class, so the hot path pays nothing. Metadata (shape,
dtype, device, grad, version, hooks) is answered without a fetch.

Results of a served access that alias the block's storage (`p.data`, `p[0]`,
`p.view(...)`) are remembered weakly with their segment: they are swapped to
the paged-out class too when it leaves (so they never dangle), and their
segment counts as dirty while they live (a write through `.data` does not
move the parameter's version counter).

The class is given back when compute has waited on the fetch (`expose`), not
when the copy is enqueued: a prefetched block's tensors stay guarded, so a
user's access between prefetch and use cannot race the copy.

Gradients that left with their block are `PagedOutGrad`s (`_grads.py`); their
accesses are served the same way, except the ones a training loop makes
between backward and step (zeroing, scaling, norms, GradScaler's unscale),
which `Pager._grad_op` answers without moving bytes.
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

# Storage (StorageImpl address) -> (pager, block, segment), for every segment
# of every wrapped model: how a served access finds what a tensor belongs to.
_SEGMENTS: dict = {}


def storage_key(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage()._cdata


def register(pager, block, seg) -> None:
    seg.storage_key = storage_key(seg.flat)
    _SEGMENTS[seg.storage_key] = (pager, block, seg)


def unregister(seg) -> None:
    _SEGMENTS.pop(seg.storage_key, None)


# ------------------------------------------------------------- the classes
def _names(kind, names):
    return {getattr(getattr(torch.Tensor, n), kind) for n in names if hasattr(torch.Tensor, n)}


# Answered from the tensor object alone: no fetch.
_METADATA = _names("__get__", [
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "_version", "layout",
    "ndim", "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_sparse_csr", "is_quantized",
    "is_mkldnn", "is_nested", "is_mps", "is_xpu", "retains_grad", "output_nr", "itemsize", "nbytes",
    "_backward_hooks", "_post_accumulate_grad_hooks", "name", "_cdata", "_grad", "_grad_fn",
]) | _names("__set__", [
    "grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks", "name", "_grad",
]) | {getattr(torch.Tensor, n) for n in [
    "size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous", "element_size",
    "get_device", "is_floating_point", "is_complex", "is_signed", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "retain_grad", "__len__", "_is_view", "is_inference",
    "__dir__", "__hash__", "_fix_weakref",
] if hasattr(torch.Tensor, n)} | {
    torch.numel, torch.is_floating_point, torch.is_complex,
    getattr(torch._C, "_group_tensors_by_device_and_dtype", None),
}
_DATA_SET = torch.Tensor.data.__set__
# Views that read no element: answered without a fetch by a view that is
# itself paged out (and remembered with its segment, so it never dangles).
_VIEWS = _names("__get__", ["data", "T", "mT"]) | {getattr(torch.Tensor, n) for n in [
    "detach", "view", "view_as", "t", "transpose", "swapaxes", "permute", "movedim", "unsqueeze",
    "squeeze", "expand", "expand_as", "narrow", "select", "unflatten", "as_strided", "unbind", "split",
    "chunk",
] if hasattr(torch.Tensor, n)} | {getattr(torch, n) for n in [
    "detach", "t", "transpose", "swapaxes", "permute", "movedim", "unsqueeze", "squeeze", "narrow",
    "select", "unflatten", "as_strided", "unbind", "split", "chunk",
] if hasattr(torch, n)}


def _torch_function(cls, func, types, args=(), kwargs=None):
    return handle(func, args, kwargs or {})


def _deepcopy(self, memo):
    # Served like any access; inside it the tensor has its own class again,
    # so the copy is of that class (never a PagedOut one).
    return serve(lambda: self.__deepcopy__(memo), [self])


def _reduce_ex(self, proto):
    return serve(lambda: self.__reduce_ex__(proto), [self])


class PagedOutTensor(torch.Tensor):
    """The class of a buffer or optimizer-state tensor while its block is paged out."""

    __torch_function__ = classmethod(_torch_function)
    __deepcopy__ = _deepcopy
    __reduce_ex__ = _reduce_ex


class PagedOutParameter(nn.Parameter):
    """The class of a Parameter while its block is paged out (still a Parameter)."""

    __torch_function__ = classmethod(_torch_function)
    __deepcopy__ = _deepcopy
    __reduce_ex__ = _reduce_ex


_GUARDS: dict = {torch.Tensor: PagedOutTensor, nn.Parameter: PagedOutParameter}
GUARD_TYPES = {PagedOutTensor, PagedOutParameter}
_PLAIN_TORCH_FUNCTIONS = (torch.Tensor.__torch_function__, torch._C._disabled_torch_function_impl)


def paged_out_class(cls):
    """The paged-out class for tensors of class `cls` (None if `cls` runs its
    own `__torch_function__`, which a guard would bypass)."""
    guard = _GUARDS.get(cls)
    if guard is None and cls not in GUARD_TYPES:
        tf = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
        plain = {getattr(f, "__func__", f) for f in _PLAIN_TORCH_FUNCTIONS}
        if tf in plain:
            guard = type(f"PagedOut{cls.__name__}", (cls,), {
                "__torch_function__": classmethod(_torch_function), "__deepcopy__": _deepcopy,
                "__reduce_ex__": _reduce_ex, "__module__": __name__})
            GUARD_TYPES.add(guard)
        _GUARDS[cls] = guard
    return guard


def page_out(seg) -> None:
    """Swap the class of every tensor of `seg` (and its live aliases) for its
    guard. Idempotent: a segment fetched but never used is still guarded."""
    if not seg.exposed:
        return
    seg.exposed = False
    seg.classes = [_swap_to_guard(t) for t in seg.tensors]
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
    for t, cls in zip(seg.tensors, seg.classes or ()):
        if cls is not None:
            t.__class__ = cls
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


def release(seg) -> None:
    """At unwrap: the segment's tensors keep their own class for good; views
    handed out by served accesses (they alias storage about to be freed)
    stay guarded with no owner, so using one is a clear error."""
    for t, cls in zip(seg.tensors, seg.classes or ()):
        if cls is not None and not seg.exposed:
            t.__class__ = cls
    seg.exposed = True
    for ref, _cls in seg.aliases:
        t = ref()
        if t is not None and type(t) not in GUARD_TYPES:
            _swap_to_guard(t)
    unregister(seg)


def _swap_to_guard(t):
    cls = type(t)
    guard = paged_out_class(cls)
    if guard is None:
        return None
    t.__class__ = guard
    return cls


# ------------------------------------------------------------- serving
def handle(func, args, kwargs):
    """`__torch_function__` of every paged-out tensor (PagedOutGrad too)."""
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func is _DATA_SET:
        name = _name_of(args[0])
        raise RuntimeError(
            f"pager: assigning `.data` of {name} while its block is paged out would take it out of its "
            f"page (pager would keep paging the old bytes). Copy into it instead: "
            f"`with torch.no_grad(): tensor.copy_(new)`, or unwrap, change, and wrap again."
        )
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(type(t) in GUARD_TYPES and not _owners([t]) for t in tensors):
        raise RuntimeError(
            "pager: this tensor is a view of a paged block's storage taken before `pager.unwrap`; the "
            "model's tensors have their own memory since, and this view has none. Take the view again "
            "from the unwrapped model."
        )
    if func in _VIEWS and not any(type(t).__name__ == "PagedOutGrad" for t in tensors):
        return _paged_out_view(func, args, kwargs)
    owners = _owners(tensors)
    if len(owners) == 1:
        pager, wanted = next(iter(owners.items()))
        answer = pager._grad_op(func, args, kwargs, wanted)
        if answer is not NotImplemented:
            return answer
    return _serve_owners(owners, lambda: func(*_real(args), **_real(kwargs)))


def _paged_out_view(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
    for r in tree_leaves(result):
        if isinstance(r, torch.Tensor):
            entry = _SEGMENTS.get(storage_key(r))
            if entry is not None and not entry[2].exposed:
                cls = _swap_to_guard(r)
                if cls is not None:
                    entry[2].aliases.append((weakref.ref(r), cls))
    return result


def serve(fn, tensors):
    """Run `fn()` with the blocks of `tensors` acquired (fetched on demand)."""
    return _serve_owners(_owners(tensors), fn)


def _serve_owners(owners, fn):
    with ExitStack() as stack:
        for pager, wanted in owners.items():
            stack.enter_context(pager._serving(wanted))
        result = fn()
        for pager, wanted in owners.items():
            pager._served(wanted, result)
        return result


def _owners(tensors) -> dict:
    """{pager: {block: set of segment kinds}} for the tensors that belong to a block."""
    from ._grads import PagedOutGrad

    owners: dict = {}
    for t in tensors:
        if isinstance(t, PagedOutGrad):
            pager, block, kind = t.pager, t.block, "grads"
        else:
            try:
                entry = _SEGMENTS.get(storage_key(t))
            except (RuntimeError, NotImplementedError, TypeError):
                entry = None  # a tensor with no storage of its own (another subclass)
            if entry is None:
                continue
            pager, block, seg = entry
            kind = seg.kind
        owners.setdefault(pager, {}).setdefault(block, set()).add(kind)
    return owners


def _real(tree):
    """Replace every PagedOutGrad by the gradient it stands for (its block acquired)."""
    from ._grads import PagedOutGrad

    return tree_map(lambda t: t.current() if isinstance(t, PagedOutGrad) else t, tree)


def aliases_in(result, wanted) -> list:
    """(segment, tensor) for results that alias the storage of a block in `wanted`."""
    out = []
    for r in tree_leaves(result):
        if not isinstance(r, torch.Tensor) or type(r).__name__ == "PagedOutGrad":
            continue
        try:
            entry = _SEGMENTS.get(storage_key(r))
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        if entry is None or entry[1] not in wanted:
            continue
        seg = entry[2]
        if not any(r is t for t in seg.tensors):
            out.append((seg, r))
    return out


def remember_alias(seg, t) -> None:
    if not any(ref() is t for ref, _cls in seg.aliases):
        seg.aliases.append((weakref.ref(t), type(t)))
    seg.force_dirty = True


def _name_of(t) -> str:
    entry = None
    try:
        entry = _SEGMENTS.get(storage_key(t))
    except (RuntimeError, NotImplementedError, TypeError):
        pass
    if entry is None:
        return "a tensor"
    _pager, block, seg = entry
    for slot, tensor in zip(seg.slots, seg.tensors):
        if tensor is t:
            return f"{slot.name!r} (block {block.name!r})"
    return f"a view of block {block.name!r}"

