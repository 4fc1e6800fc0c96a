"""Gradients of paged-out blocks.

[Note: a guard for gradients that are not on the device]
When a block leaves the device in the middle of a step (the step's blocks do
not fit the budget), its gradients go to its host page. `param.grad` must stay
defined (so the block's next backward accumulates into it and the optimizer
steps it) but must not point at freed device memory, which any kernel would
read out of bounds. It becomes a `PagedOutGrad`: a storage-less tensor of the
right shape, dtype and device whose every operation raises an error naming the
parameter and the fix, except zeroing and scaling, which are recorded and
applied when the gradient returns (so `zero_grad(set_to_none=False)` and
`pager.of(model).clip_grad_norm_` work). `zero_grad()` (set_to_none=True)
replaces it with None, which tells pager the gradient is gone.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

aten = torch.ops.aten


class PagedOutGrad(torch.Tensor):
    """Stands for a gradient that lives in its block's host page."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, segment, index: int):
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False
        )
        t.param_name = name
        t.segment = segment
        t.index = index
        return t

    def __repr__(self) -> str:
        return f"PagedOutGrad({self.param_name}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._foreach_zero_.default, aten.zero_.default):
            tensors = args[0] if func is aten._foreach_zero_.default else [args[0]]
            for t in tensors:
                if isinstance(t, PagedOutGrad):
                    t.segment.pending_scale[t.index] = 0.0
                else:
                    # Below the dispatcher's version-counter layer here: bump it
                    # by hand, or the page would not know the gradient changed.
                    t.zero_()
                    increment_version(t)
            return None if func is aten._foreach_zero_.default else args[0]
        if func is aten.detach.default:
            return args[0]
        name = next((a.param_name for a in _flat(args) if isinstance(a, PagedOutGrad)), "?")
        raise RuntimeError(
            f"pager: the gradient of {name!r} is paged out to host memory ({func.__name__} cannot run "
            f"on it): the blocks of this step do not fit the budget together. Clip with "
            f"pager.of(model).clip_grad_norm_(...) instead of torch.nn.utils.clip_grad_norm_, read "
            f"gradients after pager.of(model).fetch_grads() in smaller models, or raise the budget so "
            f"that a step's blocks fit."
        )


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a
