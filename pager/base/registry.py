"""Which wrapped model, block and segment a tensor belongs to: a registry
by storage and by tensor, the one thing every layer that meets a tensor asks."""

from __future__ import annotations

import torch

from .block import storage_key
from .wrappers import inner_tensors, is_wrapper

# Storage (StorageImpl address) -> (pager, block, segment), for every segment
# of every wrapped model: how a served access finds what a tensor belongs to.
SEGMENTS: dict = {}
# id(tensor) -> the same, for each segment's own tensors (found even while a
# `.data =` in a use has them on other memory, and faster).
TENSORS: dict = {}
# The guard classes of paged-out tensors (base/guards.py) and the classes that
# stand for a tensor with no storage (`PagedOutGrad`, training/grads.py).
GUARD_TYPES: set[type] = set()
STAND_INS: set[type] = set()


def unguarded():
    """For pager's own work on its tensors (the lock held, the block going
    nowhere): operations run on them as they are, never served."""
    return torch._C.DisableTorchFunctionSubclass()


def register(pager, block, seg) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        seg.storage = seg.flat.untyped_storage()  # held, so the count of references to it is stable
    seg.storage_key = seg.storage._cdata
    seg.base_refs = torch._C._storage_Use_Count(seg.storage_key)  # the flat tensor, its tensors, `storage`
    SEGMENTS[seg.storage_key] = (pager, block, seg)
    for t in seg.tensors + seg.wrappers:
        TENSORS[id(t)] = (pager, block, seg)


def unregister(seg) -> None:
    SEGMENTS.pop(seg.storage_key, None)
    for t in seg.tensors + seg.wrappers:
        if TENSORS.get(id(t), (None, None, None))[2] is seg:
            del TENSORS[id(t)]


def entry_of(t):
    """(pager, block, segment) that `t` belongs to (its own tensor or a view), or None."""
    entry = TENSORS.get(id(t))
    if entry is None and is_wrapper(t):  # a view of a quantized weight: by its inner tensors
        return next(filter(None, (entry_of(inner) for _n, inner in inner_tensors(t))), None)
    if entry is None:
        try:
            entry = SEGMENTS.get(storage_key(t))
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # a tensor with no storage of its own (another subclass)
    return entry
