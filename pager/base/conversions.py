"""A conversion of a wrapped model that a paged-out tensor refused, undone.

[Note: a refused conversion leaves the model as it was]
`model.to(torch.bfloat16)` (`.half()`, `.to(another device)`) runs
`Module._apply`: children first, each module's parameters (and their
gradients) before its buffers, by `param.data = converted` and
`module._buffers[name] = converted`. The tensor of a paged-out block
refuses the assignment (its page holds another dtype: the guard in
base/guards.py raises), but by then the tensors visited before it, of
resident blocks, are converted, and the model would be left half in the new
dtype. So before the error is raised, each tensor of the model's resident
pages that was given data of another dtype, shape or device is made its
page's view again (the page still holds its value), and a buffer or
parameter replaced in its module is put back. A conversion to the dtype
and device the model has already assigns each tensor to itself, which the
guard lets pass.
"""

from __future__ import annotations

import torch

from .block import storage_key
from .common import BACKWARD, WEIGHTS


def put_back_converted(pager) -> list:
    """Undo, on `pager`'s model, what a conversion changed before a paged-out
    tensor refused it (see the Note); the names of the tensors put back."""
    names = []
    for block in pager.all_blocks():
        for kind in BACKWARD:  # (weights, frozen, grads: what `_apply` converts)
            seg = block.segments.get(kind)
            for slot, t in zip(seg.slots, seg.tensors) if seg is not None else ():
                if seg.resident and _converted(slot, t, seg):
                    with torch._C.DisableTorchFunctionSubclass():
                        t.data = slot.view_of(seg.flat)
                    names.append(slot.name)
                if kind in WEIGHTS and _replaced_in_module(pager.model, slot.name, t):
                    names.append(slot.name)
    return names


def _converted(slot, t: torch.Tensor, seg) -> bool:
    if storage_key(t) == seg.storage_key:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return t.dtype != slot.dtype or tuple(t.shape) != tuple(slot.shape) or t.device != seg.flat.device


def _replaced_in_module(model, name: str, t: torch.Tensor) -> bool:
    """Whether `name`'s entry in its module was another tensor than `t` (it
    is `t` again now)."""
    prefix, _, leaf = name.rpartition(".")
    try:
        holder = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        return False
    for table in (holder._parameters, holder._buffers):
        if leaf in table and table[leaf] is not t and table[leaf] is not None:
            table[leaf] = t
            return True
    return False
