"""The training loop's gradient operations that need no bytes moved
(`GradOps`): zeroing, scaling, norms and unscaling of paged-out gradients.
One per `Pager`. See [Note: a stand-in for gradients that are not on the
device] in training/grads.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..base import guards, served
from .grads import ZERO, PagedOutGrad

log = logging.getLogger("pager")
INF = float("inf")


class GradOps:
    """The training loop's operations on paged-out gradients between steps
    (zeroing, scaling, norms, GradScaler's unscale), answered without moving
    their bytes ([Note: a stand-in for gradients that are not on the device]).

    Args:
        pager: the model's `Pager`.
        serve: its `Serving` (other tensors of an operation run for real).
    """

    def __init__(self, pager, serve):
        self.pager, self.serve = pager, serve

    def grad_op(self, func, args, kwargs, wanted):
        """Answer a zeroing, scaling, norm or GradScaler unscale of paged-out
        gradients without fetching them; NotImplemented when it cannot."""
        op, reads, writes = _GRAD_OPS.get(func, (None, False, False))
        if op is None:
            return NotImplemented
        leaves = tree_leaves((args, kwargs))
        grads = [t for t in leaves if isinstance(t, PagedOutGrad)]
        if not grads:
            return NotImplemented
        # The other tensors (resident gradients, guarded while idle) run for
        # real, their blocks pinned for it.
        others = served.owners_of(
            [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, PagedOutGrad)]
        )
        pager = self.pager
        if set(others) - {pager} or any(
            block.deferred_steps or block.missing_bytes(kinds) for block, kinds in others.get(pager, {}).items()
        ):
            return NotImplemented  # they would not all fit at once: served one block at a time
        with pager.lock:
            if any(g.segment.params[g.position].grad is not g for g in grads):
                # Stale, or back on the device since (its recorded operations
                # were applied): the operation runs on the gradient itself.
                return NotImplemented
            if reads and any(g.block.deferred_steps for g in grads):
                # The gradient as its pending update left it: served by
                # fetching (the block applies its update first). Zeroing and
                # scaling are recorded to apply after the update.
                return NotImplemented
            wanted = others.get(pager, {})
            with self.serve.serving(wanted), guards.unguarded():
                answer = op(self, *args, **kwargs)
                if answer is not NotImplemented and writes:
                    self.serve.mark_written(wanted)
                return answer

    def summarize(self, seg, ready) -> None:
        """Norms of a grads segment's gradients, computed on the device as they
        leave (on the write-back stream, after compute is done with them), for
        every leaving page from the first step on: the first clip or unscale
        of a run then fetches nothing (two small reductions per page, against
        a fetch of every paged-out gradient at that first clip)."""
        views = seg.tensors

        def norms():
            with guards.unguarded():
                return list(zip(_norms(views, 2.0), _norms(views, INF)))

        pairs, event = self.pager.transport.side(norms, after=(ready,))
        seg.summaries = dict(enumerate(pairs))
        seg.summary_event = event

    def derived_norm(self, g: PagedOutGrad, ord: float):
        """The `ord`-norm of paged-out gradient `g` as it is now (its summary
        and the operations recorded since), or None if it cannot be exact."""
        seg, i = g.segment, g.position
        summary = seg.summaries.get(i)
        if summary is None or ord not in (2.0, INF):
            return None
        transport = self.pager.transport
        if transport.is_cuda and seg.summary_event is not None:
            transport.compute_waits(seg.summary_event)  # computed on the write-back stream
        value = summary[0] if ord == 2.0 else summary[1]
        if transport.is_cuda:
            value.record_stream(transport.compute_stream())  # read here, allocated there
        for op, factor in seg.pending.get(i, ()):
            if op == "zero":
                value = torch.zeros_like(value)
            elif ord == 2.0 and not self._exact_scale(factor):
                return None
            else:
                value = value * (factor.abs() if isinstance(factor, torch.Tensor) else abs(factor))
        return value

    def _exact_scale(self, factor) -> bool:
        """Is norm(g * f) == norm(g) * |f| bit for bit? True for powers of two
        (GradScaler's scales). On a GPU any factor is taken (the kernels'
        rounding differs anyway, and checking would sync the host); on the CPU
        device, whose results must be bitwise, others are served by fetching."""
        if self.pager.transport.is_cuda:
            return True
        f = float(factor)
        return f == 0.0 or (math.isfinite(f) and math.frexp(abs(f))[0] == 0.5)


def _split(tensors):
    paged = [(i, t) for i, t in enumerate(tensors) if isinstance(t, PagedOutGrad)]
    rest = [(i, t) for i, t in enumerate(tensors) if not isinstance(t, PagedOutGrad)]
    return paged, rest


def _is_scale(factor) -> bool:
    return isinstance(factor, (int, float)) or (isinstance(factor, torch.Tensor) and factor.numel() == 1)


def _zero(ops, t):
    t.record(ZERO)
    return t


def _foreach_zero(ops, tensors):
    paged, rest = _split(tensors)
    for _i, t in paged:
        _zero(ops, t)
    if rest:
        torch._foreach_zero_([t for _i, t in rest])


def _mul(ops, t, other):
    if not _is_scale(other) or isinstance(other, PagedOutGrad):
        return NotImplemented
    t.record(("mul", other))
    return t


def _foreach_mul(ops, tensors, other):
    if not _is_scale(other):
        return NotImplemented
    paged, rest = _split(tensors)
    for _i, t in paged:
        t.record(("mul", other))
    if rest:
        torch._foreach_mul_([t for _i, t in rest], other)


def _foreach_norm(ops, tensors, ord=2.0, dtype=None):
    if dtype is not None:
        return NotImplemented
    paged, rest = _split(tensors)
    out = [None] * len(tensors)
    for i, t in paged:
        out[i] = ops.derived_norm(t, float(ord))
        if out[i] is None:
            return NotImplemented
    if rest:
        for (i, _t), n in zip(rest, torch._foreach_norm([t for _i, t in rest], ord)):
            out[i] = n
    return out


def _vector_norm(ops, t, ord=2.0, dim=None, keepdim=False, *, dtype=None, out=None):
    if dim is not None or keepdim or dtype is not None or out is not None or not isinstance(t, PagedOutGrad):
        return NotImplemented
    value = ops.derived_norm(t, float(ord))
    return NotImplemented if value is None else value


def _unscale(ops, tensors, found_inf, inv_scale):
    """GradScaler's `_amp_foreach_non_finite_check_and_unscale_`: the check
    reads each gradient as it is now (its inf-norm is non-finite exactly when
    an element is), and the unscaling is recorded."""
    paged, rest = _split(tensors)
    flags = []
    for _i, t in paged:
        norm = ops.derived_norm(t, INF)
        if norm is None:
            return NotImplemented
        flags.append(~torch.isfinite(norm))
    if flags:
        found = torch.stack(flags).any()
        found_inf.copy_(torch.where(found, torch.ones_like(found_inf), found_inf))
    for _i, t in paged:
        t.record(("mul", inv_scale))
    if rest:
        torch._amp_foreach_non_finite_check_and_unscale_([t for _i, t in rest], found_inf, inv_scale)


def _norms(values, ord):
    """Per-tensor norms as torch's clip_grad_norm_ computes them (foreach
    kernels per (device, dtype) run)."""
    out = [None] * len(values)
    groups: dict = {}
    for i, v in enumerate(values):
        groups.setdefault((v.device, v.dtype), []).append(i)
    for idx in groups.values():
        for i, n in zip(idx, torch._foreach_norm([values[i] for i in idx], ord)):
            out[i] = n
    return out


# func -> (answer, whether it reads values, whether it writes them)
_GRAD_OPS: dict[Any, tuple[Callable[..., Any], bool, bool]] = {
    torch.Tensor.zero_: (_zero, False, True),
    torch._foreach_zero_: (_foreach_zero, False, True),
    torch.Tensor.mul_: (_mul, False, True),
    torch._foreach_mul_: (_foreach_mul, False, True),
    torch._foreach_norm: (_foreach_norm, True, False),
    torch.linalg.vector_norm: (_vector_norm, True, False),
    torch._amp_foreach_non_finite_check_and_unscale_: (_unscale, True, True),
}
