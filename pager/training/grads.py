"""Gradients of paged-out blocks.

[Note: a stand-in for gradients that are not on the device]
When a block leaves the device in the middle of a step (the step's blocks do
not fit the budget), its gradients go to its host page. `param.grad` must stay
defined (so the block's next backward accumulates into it and the optimizer
steps it) but must not point at freed device memory. It becomes a
`PagedOutGrad`: a storage-less tensor of the right shape, dtype and device.
Every operation on it is served (see [Note: paged-out tensors] in base/guards.py):
the gradients are fetched and the operation runs on them. What a training
loop does between backward and step moves no bytes (`GradOps.grad_op`):
zeroing and scaling (clip_grad_norm_, GradScaler's unscale) are recorded and
replayed in order when the gradient returns, and norms and the non-finite
check are answered from the norms computed on the device as the gradient
left. `zero_grad()` (set_to_none=True) replaces it with None, which tells
pager the gradient is gone.

The `__torch_dispatch__` below only sees what reaches the dispatcher without
passing `__torch_function__` (C++ callers, such as autograd accumulating into
a gradient): zeroing is recorded, anything else is an error naming the
parameter, never a read of freed memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import increment_version

from ..base import guards
from ..base.block import Block, Segment
from ..base.common import outside_compile
from ..base.guards import handle

aten = torch.ops.aten
ZERO = ("zero", None)


def replay(t: torch.Tensor, ops) -> None:
    """Apply recorded operations to `t` in order (bit for bit what they did)."""
    for op, factor in ops:
        if op == "zero":
            t.zero_()
        else:
            t.mul_(factor.to(t.device) if isinstance(factor, torch.Tensor) else factor)


def record(ops: list, op) -> None:
    if op[0] == "zero":
        ops.clear()  # nothing before a zeroing matters
    ops.append(op)


class PagedOutGrad(torch.Tensor):
    """Stands for a gradient that lives in its block's host page."""

    param_name: str  # its parameter's name, for errors
    pager: Any  # the model's `Pager`
    block: Block
    segment: Segment  # its block's gradients segment
    position: int  # its tensor's place in that segment

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, pager, block, segment, position: int):
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False
        )
        t.param_name, t.pager, t.block, t.segment, t.position = name, pager, block, segment, position
        return t

    __torch_function__ = classmethod(
        outside_compile(lambda cls, func, types, args=(), kwargs=None: handle(func, args, kwargs or {}))
    )  # (never traced)

    def record(self, op) -> None:
        """Record zeroing or scaling of this gradient, replayed when it returns."""
        record(self.segment.pending.setdefault(self.position, []), op)

    def current(self) -> torch.Tensor:
        """The gradient on the device (its block acquired)."""
        seg = self.segment
        if not (seg.resident and seg.params[self.position].grad is seg.tensors[self.position]):
            raise RuntimeError(
                f"pager: this gradient of {self.param_name!r} is stale: the parameter's gradient was set "
                f"to None or replaced since it was read. Read `param.grad` again."
            )
        return seg.tensors[self.position]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in (aten._foreach_zero_.default, aten.zero_.default):
            tensors = args[0] if func is aten._foreach_zero_.default else [args[0]]
            for t in tensors:
                if isinstance(t, PagedOutGrad):
                    t.record(ZERO)
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
            f"pager: the gradient of {name!r} is paged out to host memory and {func.__name__} reached it "
            f"below Python (from C++); read it from Python (param.grad), or raise the budget so "
            f"that a step's blocks fit."
        )


guards.allow_foreach(PagedOutGrad)
guards.STAND_INS.add(PagedOutGrad)


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a
