"""The tensors that stand for a row table while it is wrapped: its weight's
class (`RowTableParameter`), its optimizer state's (`RowStateTensor`), and
its gradient (`RowGrad`, sparse rows kept on the device). See [Note: row
tables] in rows/table.py.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..base.tensor_ops import METADATA, tensors_of

_EMBEDDING_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
_BAG_ARGS = (
    "input",
    "weight",
    "offsets",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "mode",
    "sparse",
    "per_sample_weights",
    "include_last_offset",
    "padding_idx",
)
_LOOKUPS = {F.embedding: _EMBEDDING_ARGS, F.embedding_bag: _BAG_ARGS}


def _table_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    names = _LOOKUPS.get(func)
    if names is not None:
        bound = dict(zip(names, args)) | kwargs
        weight = bound.get("weight")
        if isinstance(weight, RowTableParameter):
            return weight._row_table.lookup(func, bound)
    return _run_on_host_tables(func, args, kwargs, RowTableParameter)


def _state_function(cls, func, types, args=(), kwargs=None):
    return _run_on_host_tables(func, args, kwargs or {}, RowStateTensor)


def _run_on_host_tables(func, args, kwargs, guard_type):
    """`func` on a row table's host tables as they are, current: the rows the
    cache changed are written back first, cached rows are forgotten if `func`
    wrote to a table, and a result that shares a host table's memory is an
    alias (see [Note: write-back of cached rows] in rows/writes.py)."""
    if func in METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    guarded = [t for t in tensors_of(args, kwargs) if type(t) is guard_type]
    for t in guarded:
        t._row_table.flush()
    with torch._C.DisableTorchFunctionSubclass():
        if func is _NUMPY:  # (the array keeps its tensor alive: make that a plain alias, which is noted)
            args = (args[0].detach(), *args[1:])
        versions = [t._version for t in guarded]
        out = func(*args, **kwargs)
        moved = [t for t, v in zip(guarded, versions) if t._version != v]
        for t in guarded:
            t._row_table.note_aliases(args[0] if func is _NUMPY else out)
    for t in moved:
        t._row_table.forget()
    return out


_NUMPY = torch.Tensor.numpy


def _as_plain(self, cls, fn):
    # Pickled and deep-copied as the plain tensor it is, current.
    table = self._row_table
    table.flush()
    del self._row_table
    self.__class__ = cls
    try:
        return fn()
    finally:
        self.__class__ = _GUARDS[cls]
        self._row_table = table


class RowTableParameter(nn.Parameter):
    """The class of a row table's weight while wrapped (see [Note: row tables] in rows/table.py)."""

    _row_table: Any  # its RowTable
    __torch_function__ = classmethod(_table_function)

    def __deepcopy__(self, memo):
        return _as_plain(self, nn.Parameter, lambda: self.__deepcopy__(memo))

    def __reduce_ex__(self, proto):
        return _as_plain(self, nn.Parameter, lambda: self.__reduce_ex__(proto))


class RowStateTensor(torch.Tensor):
    """An optimizer's state table of a row table (a momentum, Adam's moments)
    as the optimizer holds it: the host table itself, whose reads see the
    state rows the device cache changed (see [Note: write-back of cached rows] in rows/writes.py)."""

    _row_table: Any  # its RowTable
    __torch_function__ = classmethod(_state_function)

    @staticmethod
    def of(host: torch.Tensor, table) -> RowStateTensor:
        t = host.as_subclass(RowStateTensor)
        t._row_table = table
        return t

    def __deepcopy__(self, memo):
        return _as_plain(self, torch.Tensor, lambda: self.__deepcopy__(memo))

    def __reduce_ex__(self, proto):
        return _as_plain(self, torch.Tensor, lambda: self.__reduce_ex__(proto))


_GUARDS = {nn.Parameter: RowTableParameter, torch.Tensor: RowStateTensor}


class RowGrad(torch.Tensor):
    """`weight.grad` of a row table: its gradient, kept on the device until
    something reads it (see [Note: row tables] in rows/table.py)."""

    table: Any  # its RowTable
    first: tuple[torch.Tensor, torch.Tensor, bool] | None
    acc: torch.Tensor | None
    pieces: list[tuple[torch.Tensor, torch.Tensor]]
    made: torch.Tensor | None

    @staticmethod
    def __new__(cls, table):
        t = torch.Tensor._make_wrapper_subclass(
            cls, table.shape, dtype=table.dtype, device=table.host.device, layout=torch.sparse_coo, requires_grad=False
        )
        t.table = table
        # sparse=True tables: the first backward's gradient as it came, over
        # its lookup's rows (`first`: rows, sparse gradient numbered as they
        # are), then, from a second backward on, the table's sparse gradient
        # on the device (`acc`), accumulated as autograd accumulates one.
        # Dense tables: one piece (rows, dense gradient of those rows) per backward.
        t.first = None
        t.acc = None
        t.pieces = []
        t.made = None  # the real sparse tensor on the CPU, once made
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0] if args and isinstance(args[0], RowGrad) and args[0].made is None else None
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if me is not None and func in _KEEPS_SELF:
            return me
        if me is not None and func in _SCALES and len(args) == 2 and not kwargs:
            me.scale(args[1])
            return me
        if me is not None and func is torch.Tensor.zero_:
            me.first, me.acc, me.pieces = None, None, []
            return me
        if me is not None and func is torch.linalg.vector_norm:
            return me.norm(*args[1:], **kwargs)
        args, kwargs = _replace_grads((args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError(
            f"pager: {func} reached a row table's gradient below Python (from C++); read it from Python "
            f"(weight.grad), which gives the real sparse gradient."
        )

    def add(self, rows: torch.Tensor, grad: torch.Tensor, every_row: bool) -> None:  # type: ignore[override]
        """Accumulate the gradient `grad` of the batch rows `rows` (a lookup's,
        sorted and unique). `every_row`: a sparse `grad` has terms for every
        one of `rows` (no padding row among them, whose lookups torch's
        backward leaves out)."""
        if not grad.is_sparse:
            self.pieces.append((rows, grad))
            return
        if self.first is None and self.acc is None:
            self.first = (rows, grad, every_row)
            return
        self._accumulate()
        acc = cast(torch.Tensor, self.acc)
        acc += self._of_table(rows, grad)  # (as autograd adds a second sparse gradient)

    def _accumulate(self) -> None:
        """The first sparse gradient, renumbered to the table's rows, as `acc`."""
        if self.first is not None:
            self.acc, self.first = self._of_table(*self.first[:2]), None

    def _of_table(self, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The sparse gradient `grad` of the batch rows `rows` as one of the table."""
        return torch.sparse_coo_tensor(rows[grad._indices()], grad._values(), self.shape)

    def scale(self, factor) -> None:
        factor = factor.to(self.table.device) if isinstance(factor, torch.Tensor) else factor
        if self.first is not None:
            self.first[1].mul_(factor)
        if self.acc is not None:
            self.acc.mul_(factor)
        for _rows, g in self.pieces:
            g.mul_(factor)

    def rows_and_grad(self):
        """(rows, their gradient) with rows sorted: dense pieces summed per row
        in the order they arrived, or the sparse gradient renumbered."""
        if self.first is not None and self.first[2]:
            # One lookup's gradient with a term for each of its rows: those
            # rows, numbered as the step numbers them, with no unique (and no
            # host sync) to find them again.
            return self.first[:2]
        self._accumulate()
        if self.acc is not None:
            table_rows = self.acc._indices()[0]
            rows = torch.unique(table_rows, sorted=True)
            # Monotone renumbering: coalescing meets the terms in the same order.
            slots = torch.searchsorted(rows, table_rows)
            return rows, torch.sparse_coo_tensor(slots[None], self.acc._values(), (rows.numel(), self.shape[1]))
        if self.pieces:
            return _join_pieces(self.pieces, self.shape[1])
        return None

    def norm(self, ord=2, dim=None, keepdim=False, *, dtype=None) -> torch.Tensor:  # type: ignore[override]
        """The gradient's norm (what clip_grad_norm_ asks of each gradient),
        computed on the device: no copy to the host."""
        joined = self.rows_and_grad()
        if dim is not None or keepdim or joined is None:
            return torch.linalg.vector_norm(self.make_real().to_dense(), ord, dim, keepdim, dtype=dtype)
        g = joined[1]
        values = g.coalesce()._values() if g.is_sparse else g
        return torch.linalg.vector_norm(values, ord, dtype=dtype).to(self.device)

    def make_real(self) -> torch.Tensor:
        """The sparse COO gradient of the table on the CPU (made once); it
        becomes `weight.grad` if this stand-in still is."""
        if self.made is None:
            table = self.table
            self._accumulate()
            if self.acc is not None:
                made = self.acc.cpu()
            elif self.pieces:
                rows, g = _join_pieces(self.pieces, self.shape[1])
                made = torch.sparse_coo_tensor(rows[None].cpu(), g.cpu(), self.shape)
            else:
                made = torch.sparse_coo_tensor(
                    torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, self.shape[1], dtype=self.dtype), self.shape
                )
            self.made, self.first, self.acc, self.pieces = made, None, None, []
            if table.param.grad is self:
                table.param.grad = made
        return self.made


_SCALES = {torch.Tensor.mul_, torch.Tensor.__imul__}
_KEEPS_SELF = {torch.Tensor.detach_, torch.Tensor.requires_grad_}


def _replace_grads(tree):
    if isinstance(tree, RowGrad):
        return tree.make_real()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_replace_grads(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _replace_grads(v) for k, v in tree.items()}
    return tree


def host_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (page-locked) as a tensor on `device`: kernels read and write it
    over the link (mapped pinned memory: CUDA's unified addressing makes the
    host address valid on the device, so no staging copy is needed)."""
    if device.type != "cuda":
        return host
    raw = host.view(torch.uint8)

    class _Interface:  # what torch.as_tensor reads a foreign device buffer from
        __cuda_array_interface__ = {
            "shape": tuple(raw.shape),
            "strides": None,
            "version": 3,
            "data": (raw.data_ptr(), False),
            "typestr": "|u1",
        }

    return torch.as_tensor(_Interface(), device=device).view(host.dtype)


def _join_pieces(pieces: list, dim: int):
    """One dense gradient over the union of the pieces' rows (sorted): the
    first piece copied, the others added in the order they arrived, as
    autograd accumulates dense gradients of the whole table."""
    if len(pieces) == 1:
        return pieces[0]
    rows = torch.unique(torch.cat([r for r, _g in pieces]), sorted=True)
    first = pieces[0][1]
    total = torch.zeros(rows.numel(), dim, dtype=first.dtype, device=first.device)
    for i, (r, g) in enumerate(pieces):
        pos = torch.searchsorted(rows, r)
        total.index_copy_(0, pos, g) if i == 0 else total.index_add_(0, pos, g)
    return rows, total
