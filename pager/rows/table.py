"""Embedding tables paged by rows: a host table, a device cache of rows, and
updates applied to the rows a batch touched.

[Note: row tables]
An `nn.Embedding` or `nn.EmbeddingBag` named by `wrap(..., rows=...)` is not a
block: its weight (and the optimizer's state rows, once they exist) stays in
host pages, pinned on CUDA, and only the rows a batch looks up cross the link.
The weight stays the same Parameter object; its class is `RowTableParameter`
while wrapped (a Parameter still), whose `__torch_function__` sends
`F.embedding` / `F.embedding_bag` calls that read it to `RowTable.lookup` and
lets every other operation run on the host table as it is (so `state_dict()`,
reads, `load_state_dict()` and in-place initialisation see and change the real
values). A lookup:

1. takes the batch's rows, sorted and unique, and the index of each lookup
   among them (`_row_kernels.number_lookups`: a sort and a running count,
   rather than `torch.unique`, so that their number, the range check, the
   cache's misses and the padding row's place come back to the host in one
   sync, or none when `expect_rows` prepared them: see [Note: host syncs]);
2. gathers those rows into a compact batch tensor on the device: rows in the
   device cache are copied from it, the others read from the host table by a
   kernel on the compute stream (on CUDA the pinned table is mapped into the
   device's address space, so `index_select` reads the rows over the link
   itself: no staging copy, see `host_view`) and put in the cache's least
   recently used slots (`_take_rows`: on CUDA a few kernels, [Note: few
   launches on the row path] in rows/kernels.py; `gather` where the cache
   cannot take every row, or a lookup without gradients does not insert);
3. runs torch's own `F.embedding` / `F.embedding_bag` on the batch tensor with
   the lookups renumbered (and `padding_idx` renumbered), so every option
   (padding, `max_norm`, `scale_grad_by_freq`, bag modes, per-sample weights)
   has torch's semantics; a `max_norm` renormalisation is written back.

A training step whose gradient is the last lookup's (one lookup since the
last step, no padding row in a sparse one) updates that lookup's batch
tensor and writes it to the slots the lookup put its rows in, when the
cache has not moved since: no second gather.

The numbering is monotone (row r is the r-th smallest row of the batch), so
every reduction over duplicate lookups (the backward's sums, a sparse
gradient's coalescing) meets its terms in the order it meets them in the
unpaged table: the results are equal bit for bit.

The batch tensor is a leaf; its gradient (dense, or sparse when the module has
`sparse=True`) is kept on the device as a piece `(rows, grad)` of the table's
gradient. `weight.grad` is a `RowGrad`: a sparse COO tensor of the table's
shape on the CPU, that stands for those pieces. Zeroing and scaling it (what
`zero_grad`, `clip_grad_norm_`'s scaling do) act on the pieces; any other
operation on it makes the real sparse gradient (the pieces copied to the host)
and runs on that, which then is `weight.grad`.

[Note: exact updates of touched rows]
`opt.step()` (through the pager's step pre-hook, `training/optim.py`) updates a row
table with the user's own optimizer, on a view of the rows the gradient
touches: a temporary Parameter holding those rows (from the cache or the host
table), the gradient renumbered to them, and the state rows of each state
tensor of the table's shape, gathered the same way (scalars such as Adam's
`step` are the table's own). The optimizer's step runs on that view alone,
with the group's options as they are, and the rows (and state rows) are then
the table's (see [Note: write-back of cached rows] for where they go).
torch.optim's updates are per element, so for every row the gradient
touches the result is the optimizer's on the whole table; rows it does not
touch are not updated. That is the dense result for SGD without
momentum or weight decay, Adagrad and `SparseAdam` (whose updates leave such
rows unchanged); for SGD with momentum, Adam, AdamW, RMSprop and the others it
is the lazy variant (as `SparseAdam` is of Adam): untouched rows keep their
values and their state rows, which start at zero.

[Note: write-back of cached rows]
A row the cache holds is changed there only (its slot is marked dirty): rows
that come back step after step never cross the link, either way. The host
tables get a dirty row's values when:

- it leaves the cache (`RowCache.make_room` takes dirty victims out before
  their slots are reused): its values are copied out on the compute stream,
  then to pinned memory by the copy engine, and a CPU thread stores them
  into the host tables, while compute runs on ([Note: rows
  written back by the host] in rows/writer.py). The write-back's device copy
  of the rows is kept while it runs (`WriteBack`): a later read of such a row
  from the host (a miss) takes its values from that copy instead
  (`_read_missed`), and so does a prepared lookup for the rows read ahead
  while it ran ([Note: rows read ahead] in rows/reader.py), so neither waits
  for the writer's thread; a write to such a row (a row not cached) waits
  for that store first (on the host, before it is queued);
- something outside the training loop reads a host table: any operation on
  the weight other than a lookup or a metadata read (`state_dict()`, indexing,
  `torch.save`, `copy.deepcopy`), and any on an optimizer state table, which
  the optimizer holds as a `RowStateTensor` (the host table under a guard
  class, as the weight is a `RowTableParameter`). `flush()` writes every dirty
  row, then waits for all writes queued to the host tables (`settle()`), so
  the read sees the table as the unpaged model would have it. An operation
  that writes a host table (its version counter moves) then drops the cache,
  whose copies are stale;
- a tensor sharing a host table's memory is alive (a `.data`, `detach()` or
  view of the weight or of a state table, the tensor behind a `numpy()`
  array): reads and writes through it skip every guard, so the tables are made
  current when it is handed out, and while it lives updates go through to the
  host tables at once (and each lookup forgets the cache), as they would land
  in the unpaged table.

[Note: host syncs]
Each count the host needs from the device (how many rows, how many missed)
makes the host wait until the device has run everything queued; the device
then idles while the host queues the next kernels. A training step of a row
table makes at most these:

- the lookup: one, for every count at once (`_batch_rows`), unless
  `expect_rows` of the very tensor prepared it ([Note: rows read ahead] in
  rows/reader.py): then none;
- the lookup, when rows must come in and the cache holds changed rows: none
  on CUDA, where the slots given up are copied out with a mask of the dirty
  ones, which the writer's thread keeps (`RowCache.make_room`, [Note: rows
  written back by the host]); on the CPU device the dirty ones are picked
  (a sync costs nothing there);
- the update: one for the gradient's rows when they must be merged
  (`RowGrad.rows_and_grad`: the sparse gradients of several lookups, or of one
  whose rows include the padding row, or several lookups' dense pieces; one
  lookup's gradient is over its own rows, which the step takes as they are),
  and one to count the misses, unless the gradient is the last lookup's,
  whose batch and slots the step takes (no gather), or the cache is known to
  hold every row looked up since the last step (`_note_rows_held`: lookups
  that took no row in, and none of their rows left out) - then each row is a
  hit and there is nothing to count;
- rows read ahead: none to start them (`ReadAhead`); none at the lookup they
  prepared, one at any other lookup that takes some, for how many it takes.

So a training step with `expect_rows` of each next batch, one lookup a
table, makes none (`test_a_step_whose_rows_were_read_ahead_adds_no_host_sync`).

The free slots need no count: the slots a gather hit hold its tick, one each,
so `capacity - hits` are free.

Rows an update touches that the cache does not hold (a cache smaller than a
batch, or the first step that makes a state column) are written through on
the compute stream. Host reads by CPU threads (the staged half of a split
read) settle first. `stats().row_flushes` counts the flushes that found dirty
rows; a training loop makes none.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..base.budget import format_bytes
from ..base.guards import _METADATA, _tensors_of
from .kernels import (GENERATIONS, NO_STALE, CacheMap, Lookups, mark_of, number_lookups, patch_written,
                           place_rows, touch_hits)
from .reader import HostRowReader, ReadAhead
from .writer import host_alias

WEIGHT = "weight"
WRITES_IN_FLIGHT = 2  # write-backs a table's writer's thread may have queued, at most
_EMBEDDING_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
_BAG_ARGS = ("input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode", "sparse",
             "per_sample_weights", "include_last_offset", "padding_idx")
_LOOKUPS = {F.embedding: _EMBEDDING_ARGS, F.embedding_bag: _BAG_ARGS}


# ------------------------------------------------------------- the classes
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
    alias (see [Note: write-back of cached rows])."""
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    guarded = [t for t in _tensors_of(args, kwargs) if type(t) is guard_type]
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
    """The class of a row table's weight while wrapped (see [Note: row tables])."""

    __torch_function__ = classmethod(_table_function)

    def __deepcopy__(self, memo):
        return _as_plain(self, nn.Parameter, lambda: self.__deepcopy__(memo))

    def __reduce_ex__(self, proto):
        return _as_plain(self, nn.Parameter, lambda: self.__reduce_ex__(proto))


class RowStateTensor(torch.Tensor):
    """An optimizer's state table of a row table (a momentum, Adam's moments)
    as the optimizer holds it: the host table itself, whose reads see the
    state rows the device cache changed (see [Note: write-back of cached rows])."""

    __torch_function__ = classmethod(_state_function)

    @staticmethod
    def of(host: torch.Tensor, table: "RowTable") -> "RowStateTensor":
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
    something reads it (see [Note: row tables])."""

    @staticmethod
    def __new__(cls, table: "RowTable"):
        t = torch.Tensor._make_wrapper_subclass(
            cls, table.shape, dtype=table.dtype, device=table.host.device, layout=torch.sparse_coo,
            requires_grad=False)
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
        if func in _METADATA:
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
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"pager: {func} reached a row table's gradient below Python (from C++); read it from Python "
            f"(weight.grad), which gives the real sparse gradient.")

    def add(self, rows: torch.Tensor, grad: torch.Tensor, every_row: bool) -> None:
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
        self.acc += self._of_table(rows, grad)  # (as autograd adds a second sparse gradient)

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

    def norm(self, ord=2, dim=None, keepdim=False, *, dtype=None) -> torch.Tensor:
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
                made = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long),
                                               torch.zeros(0, self.shape[1], dtype=self.dtype), self.shape)
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
        __cuda_array_interface__ = {"shape": tuple(raw.shape), "strides": None, "version": 3,
                                    "data": (raw.data_ptr(), False), "typestr": "|u1"}

    return torch.as_tensor(_Interface(), device=device).view(host.dtype)


# ------------------------------------------------------------- the cache
_SLOT_BYTES = 8 + 8 + 1  # a slot's row, last use and dirty flag


class RowCache:
    """Rows of one table kept on the device: each slot holds a row's weight and
    its state rows (one column per kind), replaced least recently used first.
    A slot whose values an update changed is dirty until they are written to
    the host tables (see [Note: write-back of cached rows]).

    Args:
        rows: the table's number of rows.
        dim, dtype: of a row.
        nbytes: device bytes for the cache and its row-to-slot map.
        device: where.
    """

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, nbytes: int, device: torch.device):
        self.n_rows, self.dim, self.dtype, self.nbytes, self.device = rows, dim, dtype, nbytes, device
        self.row_bytes = dim * dtype.itemsize
        self.map_bytes = 4 * (rows + 1)
        self.tick = 0
        self.epoch = 0  # moves whenever a row may leave the cache (`place`, `clear`, `shape_columns`)
        self.shape_columns((WEIGHT,))

    def shape_columns(self, kinds: tuple) -> None:
        """Empty the cache and size it for one column per kind (the caller has
        written its dirty rows back)."""
        self.kinds = tuple(kinds)
        self.epoch += 1
        per_row = self.row_bytes * len(self.kinds) + _SLOT_BYTES
        capacity = max(0, (self.nbytes - self.map_bytes) // per_row - 1) if self.nbytes > self.map_bytes else 0
        self.capacity = min(capacity, self.n_rows)
        self.columns = {}
        self.any_dirty = False  # (on the host: no dirty slot, no look for one)
        if self.capacity == 0:
            self.slot_of_row = None
            return
        # Row n_rows is a dummy: an empty slot's row, so that clearing the map
        # entries of evicted slots needs no mask (no host sync). Likewise slot
        # `capacity` is a dummy that writes of rows not cached go to.
        self.slot_of_row = torch.full((self.n_rows + 1,), -1, dtype=torch.int32, device=self.device)
        self.row_of_slot = torch.full((self.capacity,), self.n_rows, dtype=torch.long, device=self.device)
        self.last_use = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)
        self.dirty = torch.zeros(self.capacity + 1, dtype=torch.bool, device=self.device)
        self.columns = {k: torch.empty(self.capacity + 1, self.dim, dtype=self.dtype, device=self.device)
                        for k in self.kinds}

    def clear(self) -> None:
        """Forget every row (the caller has written the dirty ones back, or they are stale)."""
        self.epoch += 1
        if self.capacity:
            self.slot_of_row.fill_(-1)
            self.row_of_slot.fill_(self.n_rows)
            self.last_use.fill_(-1)
            self.dirty.zero_()
        self.any_dirty = False

    def find(self, rows: torch.Tensor, n_miss: int | None = None):
        """(slots of `rows`' hits, their positions in `rows` or None for all
        of them in order, positions of misses). `n_miss`, when the caller
        knows it, spares the host sync that counts them."""
        if self.capacity == 0:
            return None, None, torch.arange(rows.numel(), device=rows.device)
        slots = self.slot_of_row.index_select(0, rows).long()
        if n_miss is None:
            n_miss = int((slots < 0).sum())  # (a host sync)
        if n_miss == 0:
            return slots, None, slots[:0]
        # Misses first, each part in row order.
        order = torch.argsort((slots >= 0).to(torch.uint8), stable=True)
        hit_pos, miss_pos = order[n_miss:], order[:n_miss]
        return slots.index_select(0, hit_pos), hit_pos, miss_pos

    def touch(self, slots: torch.Tensor | None) -> None:
        """Mark the slots a gather hit as used now."""
        self.tick += 1
        if slots is not None and slots.numel():
            self.last_use.index_fill_(0, slots, self.tick)

    def make_room(self, n: int, n_hits: int):
        """Slots for `n` rows not cached, after a `touch` of the gather's
        `n_hits` hits: the least recently used slots but those (maybe fewer
        than `n`). Returns (the slots or None, the dirty rows taken out of
        them as (rows, {kind: values}) or None); `place` then fills them."""
        # The hits hold this tick, one slot each (a gather's rows are unique):
        # the other slots are free, and no count on the device is needed.
        n = min(self.capacity - n_hits, n)
        if self.capacity == 0 or n <= 0:
            return None, None
        victims = torch.topk(self.last_use, n, largest=False).indices
        return victims, (self._take_dirty(victims, exact=self.device.type != "cuda") if self.any_dirty else None)

    def place(self, rows: torch.Tensor, victims: torch.Tensor, values: dict, mark: int = -1) -> None:
        """Put `rows` with `values` {kind: [len(rows), dim]} in the slots
        `victims` (as many, from `make_room`); the rows they held get `mark`
        in the map (-1, or the mark of the write-back that took them out)."""
        self.epoch += 1
        self.slot_of_row.index_fill_(0, self.row_of_slot.index_select(0, victims), mark)
        self.row_of_slot.index_copy_(0, victims, rows)
        self.slot_of_row.index_copy_(0, rows, victims.to(torch.int32))
        self.last_use.index_fill_(0, victims, self.tick)
        for kind, column in self.columns.items():
            column.index_copy_(0, victims, values[kind])

    def _take_dirty(self, victims: torch.Tensor, exact: bool = True):
        """(rows, {kind: values}, which to keep) of the slots `victims`,
        marked clean: `exact`, the dirty ones only (one host sync to count
        them; keep: None), or None if none is; else all of them, with a
        device mask of the dirty ones to keep (no host sync: the writer's
        thread picks them, [Note: rows written back by the host])."""
        keep = self.dirty.index_select(0, victims)
        if exact:
            victims, keep = victims[keep], None
            if victims.numel() == 0:
                return None
        self.dirty.index_fill_(0, victims, False)
        # (in the table's order: the host stores them faster, [Note: rows written back by the host])
        rows, order = torch.sort(self.row_of_slot.index_select(0, victims))
        victims = victims.index_select(0, order)
        keep = None if keep is None else keep.index_select(0, order)
        return rows, {k: column.index_select(0, victims) for k, column in self.columns.items()}, keep

    def take_all_dirty(self):
        """(rows, {kind: values}) of every dirty slot, marked clean; None if none is."""
        if not self.any_dirty:
            return None
        self.any_dirty = False
        return self._take_dirty(torch.arange(self.capacity, device=self.device))

    def update(self, rows: torch.Tensor, values: dict, dirty: bool, slots: torch.Tensor | None = None) -> None:
        """Write `values` of those `rows` that are cached into their slots
        (`slots` if the caller knows them; marked dirty if `dirty`); the others
        go to the dummy slot. No host sync."""
        if self.capacity == 0:
            return
        if slots is None:
            slots = self.slot_of_row.index_select(0, rows).long()
            slots = torch.where(slots >= 0, slots, self.capacity)
        for kind, v in values.items():
            self.columns[kind].index_copy_(0, slots, v)
        if dirty:
            self.dirty.index_fill_(0, slots, True)
            self.any_dirty = True

    def map(self) -> CacheMap:
        return CacheMap(self.slot_of_row, self.row_of_slot, self.last_use, self.dirty, self.columns[WEIGHT])

    def device_bytes(self) -> int:
        if not self.capacity:
            return 0
        return self.map_bytes + self.capacity * _SLOT_BYTES + (self.capacity + 1) * self.row_bytes * len(self.kinds)


# ------------------------------------------------------------- one table
class WriteBack(NamedTuple):
    """A write of rows to the host tables by the writer's thread, maybe still running."""

    rows: torch.Tensor  # on the device, sorted
    values: dict  # kind -> [len(rows), dim] on the device: what it writes (rows that are clean included)
    written: object  # its HostWrite
    generation: int  # its number: the mark of its rows in the cache's map


class Placed(NamedTuple):
    """A training lookup's rows as `_take_rows` put them in the cache."""

    rows: torch.Tensor  # unique, sorted
    batch: torch.Tensor  # their values, the lookup's batch tensor
    slots: torch.Tensor  # their slots
    epoch: int  # the cache's epoch after


class RowTable:
    """One row-paged embedding table: its host tables (weight and state rows),
    its device cache, its lookups and its gradient pieces.

    Args:
        pager: the model's `Pager`.
        name: the module's qualified name.
        module: the `nn.Embedding` / `nn.EmbeddingBag`.
        cache_bytes: device bytes for its cache.
    """

    def __init__(self, pager, name: str, module: nn.Module, cache_bytes: int):
        self.pager, self.name, self.module = pager, name, module
        self.param = param = module.weight
        self.device = pager.device
        self.original_device = param.device
        self.shape, self.dtype = param.shape, param.dtype
        self.row_bytes = param.shape[1] * param.element_size()
        self._registered = None  # a CPU table page-locked where it is (unregistered at restore)
        adopted = self._adopt_in_place(param.detach())
        self._adopted = adopted is not None
        self.host = adopted if adopted is not None else self._new_host_table(param.detach())
        self.hosts = {WEIGHT: self.host}  # kind -> host table (state kinds added at the first step)
        self.host_aliases = {WEIGHT: host_alias(self.host)}  # kind -> what the writer's thread stores into
        self.views = {WEIGHT: host_view(self.host, self.device)}
        self.readers = {WEIGHT: self._reader(self.host, self.views[WEIGHT])}
        self.state_views = {}  # kind -> the state table as the optimizer holds it (a RowStateTensor)
        self.ahead = None  # rows read ahead by `expect` (a ReadAhead)
        self._rows_held = None  # see `_note_rows_held`
        self._writes_in_flight = []  # WriteBacks maybe still running, oldest first
        self._generation = 0  # the next write-back's number (its rows' mark in the cache's map)
        self._placed = None  # the last lookup's rows where it put them (a Placed), if training: `step`
        self._writes_through = 0  # writes of rows through to the host tables (`write`), counted
        self._unsettled = False  # writes to the host tables queued on the device, not yet waited for
        self.cache = RowCache(self.shape[0], self.shape[1], self.dtype, cache_bytes, self.device)
        self._aliases = weakref.WeakSet()  # tensors sharing a host table's memory (`note_aliases`)
        with torch.no_grad():
            param.data = self.host
        param.__class__ = RowTableParameter
        param._row_table = self
        self._version = param._version

    def _adopt_in_place(self, value: torch.Tensor):
        """A CPU table that owns its whole storage is used where it is (and
        page-locked there on CUDA): a 40 GB table needs no second copy."""
        storage = value.untyped_storage()
        if (value.device.type != "cpu" or not value.is_contiguous() or value.storage_offset() != 0
                or storage.nbytes() != value.numel() * value.element_size()):
            return None
        if self.device.type == "cuda" and self.pager.arena.pin:
            err = torch.cuda.cudart().cudaHostRegister(value.data_ptr(), storage.nbytes(), 0)
            if int(getattr(err, "value", err)) != 0:
                return None  # (already page-locked, or not lockable here: copied into the arena instead)
            self._registered = value
        return value

    def _new_host_table(self, value: torch.Tensor) -> torch.Tensor:
        nbytes = value.numel() * value.element_size()
        arena = self.pager.arena
        arena.check_room(nbytes, f"row table {self.name!r}")
        page = arena.allocate(nbytes)[:nbytes]
        host = page.view(value.dtype).view(value.shape)
        host.copy_(value)
        return host

    def _reader(self, host: torch.Tensor, view: torch.Tensor) -> HostRowReader:
        # (CPU threads of a split read read the host table itself: queued writes land first)
        return HostRowReader(host, view, self.pager.row_stream, before_host_read=self.settle)

    # ------------------------------------------------------------ lookups
    def note_aliases(self, out) -> None:
        """Keep track of the tensors in `out` that share a host table's memory
        (`.data`, `detach()`, views): writes through them skip every guard, so
        while one lives, updates go through to the host tables and each lookup
        forgets the cached rows ([Note: write-back of cached rows])."""
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if (isinstance(t, torch.Tensor) and type(t) not in _GUARDS.values() and t.layout == torch.strided
                    and t.untyped_storage().data_ptr() in self._host_pointers()):
                self._aliases.add(t)

    def _host_pointers(self) -> set:
        return {host.untyped_storage().data_ptr() for host in self.hosts.values()}

    def _check_current(self) -> None:
        """Forget cached rows if the table was written from outside (the
        Parameter's version counter moved, or a `.data` alias is alive)."""
        if self.param._version != self._version or len(self._aliases):
            self.forget()

    def forget(self) -> None:
        """Drop the cached rows and the rows read ahead: a host table was
        written from outside (after `flush`, so no cached change is lost)."""
        self.cache.clear()
        self._set_ahead(None)
        self._version = self.param._version

    def expect(self, indices: torch.Tensor) -> None:
        """Start reading the rows `indices` will look up (see [Note: rows read ahead] in rows/reader.py)."""
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"pager: expect_rows({self.name!r}, indices) takes an int32 or int64 tensor of "
                            f"rows; got {type(indices).__name__}"
                            f"{f' of {indices.dtype}' if isinstance(indices, torch.Tensor) else ''}.")
        with self.pager.lock:
            self._check_current()
            # The read ahead does not wait for write-backs still running: the
            # rows they write are taken from their device copies when looked up.
            self._prune_writes()
            in_flight = [(w.rows, w.values[WEIGHT]) for w in self._writes_in_flight]
            stale_below = mark_of(self._writes_in_flight[0].generation) if in_flight else NO_STALE
            self._set_ahead(ReadAhead.start(indices, self.views[WEIGHT], self.cache.slot_of_row,
                                            self.pager.row_stream, self._pad(getattr(self.module, "padding_idx", None)),
                                            self.cache.epoch, self._writes_through, in_flight, stale_below))
            for rows, _values in in_flight:
                self._note_written(rows)

    def _pad(self, pad):
        return pad + self.shape[0] if pad is not None and pad < 0 else pad

    def _set_ahead(self, ahead) -> None:
        """Replace the rows read ahead (the bytes the old ones moved counted)."""
        if self.ahead is not None:
            self.pager.counters.row_h2d_bytes += self.ahead.take_read_count() * self.row_bytes
        self.ahead = ahead

    def _note_written(self, rows: torch.Tensor) -> None:
        """Rows of the weight written to the host table: not served from the rows read ahead."""
        if self.ahead is not None and not self.ahead.note_written(rows):
            self._set_ahead(None)

    def lookup(self, func, bound: dict) -> torch.Tensor:
        """`func` (F.embedding or F.embedding_bag) with the table's rows: see [Note: row tables]."""
        pager, cache = self.pager, self.cache
        with pager.lock:
            self._check_current()
            pad = self._pad(bound.get("padding_idx"))
            ahead, values = self.ahead, None
            prepared = None if ahead is None else ahead.prepared(bound["input"], pad, cache.epoch,
                                                                 self._writes_through, self.shape[0])
            if prepared is None:
                lookups, u, n_miss, pad = self._batch_rows(bound["input"], pad)
            else:
                (lookups, u, n_miss, pad), values = prepared, ahead.values
            rows = lookups.rows[:u]
            training = torch.is_grad_enabled() and self.param.requires_grad
            insert = training or len(cache.kinds) == 1
            epoch = cache.epoch
            if insert and cache.capacity and n_miss <= cache.capacity - (u - n_miss):
                batch, slots = self._take_rows(lookups, u, n_miss, values)
                uncached = slots[:0]
            else:
                gathered, uncached = self.gather(rows, (WEIGHT,), insert=insert, n_miss=n_miss, read=values)
                batch, slots = gathered[WEIGHT], None
            if prepared is not None:
                self.pager.counters.row_ahead_hits += n_miss
                self._set_ahead(None)  # (its rows are in the cache now, or were served once)
            bound = dict(bound, input=lookups.inverse.view(bound["input"].shape), weight=batch)
            if bound.get("padding_idx") is not None:
                bound["padding_idx"] = pad
            if bound.get("offsets") is not None:
                bound["offsets"] = bound["offsets"].to(self.device, torch.long)
            self._placed = None
            if training:
                self._note_rows_held(epoch, uncached)
                if slots is not None:
                    self._placed = Placed(rows, batch, slots, cache.epoch)
                batch.requires_grad_(True)
                every_row = pad is None  # (torch's sparse backward leaves the padding row's lookups out)
                batch.register_post_accumulate_grad_hook(lambda leaf: self._grad_arrived(rows, leaf, every_row))
        out = func(**bound)
        if bound.get("max_norm") is not None:
            with pager.lock, torch.no_grad():
                self.write(rows, {WEIGHT: batch.detach()}, uncached)  # renormalised rows are the table's now
        return out

    def _batch_rows(self, index: torch.Tensor, pad: int | None):
        """The lookups `index` numbered: (their `Lookups`; how many unique
        rows; how many of them the cache lacks; the position of row `pad`
        among them or None). One host sync, for every count at once; it
        raises IndexError for a row outside the table, before anything is
        changed."""
        if index.numel() == 0:
            flat = index.to(self.device, torch.long).reshape(-1)
            return Lookups(flat, flat.bool(), flat, flat.bool(), flat, flat, flat), 0, 0, None
        lookups = number_lookups(index, self.shape[0], self.cache.slot_of_row, pad, self.device)
        low, high, last, n_miss, pad_at, _stale = lookups.facts.tolist()  # the host sync
        if low < 0 or high >= self.shape[0]:
            raise IndexError(f"pager: row table {self.name!r} has {self.shape[0]} rows; a lookup asked for "
                             f"row {low if low < 0 else high}.")
        return lookups, last + 1, n_miss, None if pad_at < 0 else pad_at

    def _take_rows(self, lookups: Lookups, u: int, n_miss: int, values: torch.Tensor | None):
        """(the batch tensor of the first `u` rows of `lookups`, each row's
        slot): rows the cache holds from their slots, the `n_miss` it lacks
        put in the least recently used slots (room for every one), their
        values `values` (read ahead, by position) or read now, and their
        state rows read from the host tables; the changed rows that leave go
        to the writer ([Note: few launches on the row path] in rows/kernels.py)."""
        cache, counters = self.cache, self.pager.counters
        counters.row_hits += u - n_miss
        counters.row_misses += n_miss
        state_kinds = [k for k in cache.kinds if k != WEIGHT]
        missing = lookups.missing[:n_miss]
        by_rank = values is None
        if by_rank:
            values = self._read_missed(WEIGHT, missing)
        cache.tick += 1
        touch_hits(lookups, u, cache.slot_of_row, cache.last_use, cache.tick)
        victims = torch.topk(cache.last_use, n_miss, largest=False).indices  # (none a hit: those hold this tick)
        take_out, mark, taken_state = cache.any_dirty and n_miss > 0, -1, {}
        if take_out:
            # (in the table's order: the host stores them faster, [Note: rows written back by the host])
            victims = victims.index_select(0, torch.argsort(cache.row_of_slot.index_select(0, victims)))
            mark = self._next_mark()
            taken_state = {k: cache.columns[k].index_select(0, victims) for k in state_kinds}
        if n_miss:
            cache.epoch += 1
        batch, slots, taken = place_rows(lookups, u, values, by_rank, cache.map(), victims, cache.tick, mark, take_out)
        for kind in state_kinds:
            cache.columns[kind].index_copy_(0, victims, self._read_missed(kind, missing))
        if take_out:
            rows, keep, weight = taken
            self._write_host(rows, {WEIGHT: weight, **taken_state}, keep=keep, aside=True)
        return batch, slots

    def _note_rows_held(self, epoch_before: int, uncached: torch.Tensor) -> None:
        """After a training lookup: whether the cache still holds every row
        looked up since the last step, as of which epoch (`_rows_held`: None,
        no lookup yet; False, not known). If it does at the step, the step's
        rows (the gradient's, among them) need no host sync to be found."""
        held, epoch = self._rows_held, self.cache.epoch
        if uncached.numel() or held is False:
            self._rows_held = False
        elif held is None or (held == epoch_before and epoch == epoch_before):
            self._rows_held = epoch  # (a gather that placed rows may have put earlier lookups' out)
        else:
            self._rows_held = False

    def gather(self, rows: torch.Tensor, kinds: tuple, insert: bool = True, n_miss: int | None = None,
               read: torch.Tensor | None = None):
        """({kind: the rows of that kind on the device}, from the cache or the
        host tables; the positions in `rows` of those the cache does not hold
        afterwards). `n_miss`: how many of `rows` the cache lacks, if known.
        `read`: the weight's rows, where the cache lacks them, already read
        (a prepared lookup's, [Note: rows read ahead])."""
        cache, counters = self.cache, self.pager.counters
        slots, hit_pos, miss_pos = cache.find(rows, n_miss)
        n, n_miss, dim = rows.numel(), miss_pos.numel(), self.shape[1]
        counters.row_hits += n - n_miss
        counters.row_misses += n_miss
        miss_rows = rows.index_select(0, miss_pos) if n_miss else None
        victims, mark = None, -1
        if cache.capacity:
            cache.touch(slots)
            if insert and n_miss:
                # Room first: taking the dirty rows out syncs the host, which
                # then waits only for the few kernels queued, not for the reads.
                victims, evicted = cache.make_room(n_miss, n - n_miss)
                if evicted is not None:
                    # (cached rows, so none of those read below: the reads do not wait for this write)
                    mark = self._next_mark()
                    self._write_host(*evicted, aside=True)
        out = {}
        for kind in kinds:
            if hit_pos is None and slots is not None:  # every row a hit
                out[kind] = cache.columns[kind].index_select(0, slots)
                continue
            values = torch.empty(n, dim, dtype=self.hosts[kind].dtype, device=self.device)
            if slots is not None and slots.numel():
                values.index_copy_(0, hit_pos, cache.columns[kind].index_select(0, slots))
            if n_miss:
                missed = (read.index_select(0, miss_pos) if kind == WEIGHT and read is not None
                          else self._read_missed(kind, miss_rows))
                values.index_copy_(0, miss_pos, missed)
            out[kind] = values
        if victims is None:
            return out, miss_pos
        fitted = victims.numel()
        fill = {}
        for kind in cache.kinds:  # a slot holds every kind
            fill[kind] = (out[kind].index_select(0, miss_pos[:fitted]) if kind in out
                          else self._read_missed(kind, miss_rows[:fitted]))
        cache.place(miss_rows[:fitted], victims, fill, mark)
        return out, miss_pos[fitted:]

    def _read_missed(self, kind: str, rows: torch.Tensor) -> torch.Tensor:
        """The host rows `rows` (sorted) of `kind` on the device, current:
        from the rows read ahead where they are current, else from the host
        table; a row a write-back still in flight takes there is taken from
        its copy on the device (the host table may not have it yet), with no
        wait for the writer's thread."""
        reader, counters = self.readers[kind], self.pager.counters
        if kind != WEIGHT or self.ahead is None:
            counters.row_h2d_bytes += rows.numel() * self.row_bytes
            out = reader.read(rows)
        else:
            out, served = self.ahead.serve(rows, reader.read)
            counters.row_ahead_hits += served
            counters.row_h2d_bytes += (rows.numel() - served + self.ahead.take_read_count()) * self.row_bytes
        for w in self._writes_in_flight:  # (oldest first: a row written back twice ends with its newest values)
            if kind in w.values:
                patch_written(out, rows, w.rows, w.values[kind])
        return out

    # ------------------------------------------------------------- writes
    def write(self, rows: torch.Tensor, values: dict, uncached: torch.Tensor,
              slots: torch.Tensor | None = None) -> None:
        """Make `values` {kind: [n, dim]} the table's rows `rows`: in the cache
        for the rows it holds (written to the host tables later; `slots`:
        theirs, if known), through to the host tables for the positions
        `uncached` (what `gather` of the same rows returned). See [Note:
        write-back of cached rows]."""
        cache = self.cache
        if len(self._aliases) or not cache.capacity:
            self._writes_through += 1
            self._write_host(rows, values)
            cache.update(rows, {k: v for k, v in values.items() if k in cache.columns}, dirty=False)
        else:
            cache.update(rows, values, dirty=True, slots=slots)
            if uncached.numel():
                self._writes_through += 1
                self._write_host(rows.index_select(0, uncached),
                                 {k: v.index_select(0, uncached) for k, v in values.items()})
        if WEIGHT in values:
            self._note_written(rows)

    def _write_host(self, rows: torch.Tensor, values: dict, keep: torch.Tensor | None = None,
                    aside: bool = False) -> None:
        """Write `values` {kind: [n, dim]} of `rows` (where `keep`, if given)
        to the host tables: on the compute stream, or `aside` by the writer
        (copied out, then stored by a CPU thread) while compute runs on."""
        if keep is not None and not (aside and self.device.type == "cuda"):  # (the writer's thread applies it)
            rows, values = rows[keep], {k: v[keep] for k, v in values.items()}
            if not rows.numel():
                return
        for v in values.values():
            self.pager.counters.row_d2h_bytes += v.numel() * v.element_size()
        if self.device.type != "cuda":
            for kind, v in values.items():
                self.views[kind].index_copy_(0, rows, v)
            self._version = self.param._version  # (our own writes moved it on the CPU device)
            return
        self._unsettled = True
        if not aside:
            if self._writes_in_flight:
                self._wait_writes()  # (a row written back may be written again: in order)
            for kind, v in values.items():
                self.views[kind].index_copy_(0, rows, v)
            return
        self._prune_writes()
        while len(self._writes_in_flight) >= WRITES_IN_FLIGHT:
            # The thread stores more slowly than the steps give it rows: the
            # host waits for it, rather than pinning memory for more.
            self._writes_in_flight.pop(0).written.wait()
        written = self.pager.row_stream.writer.write(self.host_aliases, rows, values, keep)
        self._writes_in_flight.append(WriteBack(rows, values, written, self._generation))
        self._generation += 1

    def _wait_writes(self) -> None:
        """Wait for every write-back in flight (raising what one raised),
        which then are not (their device copies go)."""
        for w in self._writes_in_flight:  # (the thread runs them in order: after the first, little to wait for)
            w.written.wait()
        self._writes_in_flight = []

    def _next_mark(self) -> int:
        """What the cache's map holds for rows the next write-back takes out
        (see [Note: few launches on the row path] in rows/kernels.py): its
        mark on CUDA, -1 on the CPU device (whose writes are done on return)."""
        if self.device.type != "cuda":
            return -1
        if self._generation >= GENERATIONS:
            self.settle()  # (every mark is then of a write that is done: they go, and the count starts again)
            self.cache.slot_of_row.clamp_(min=-1)
            self._generation = 0
        return mark_of(self._generation)

    def _prune_writes(self) -> None:
        self._writes_in_flight = [w for w in self._writes_in_flight if not w.written.query()]

    def flush(self) -> None:
        """Write the rows the cache changed to the host tables and wait for
        every write to them: on return the host tables are current."""
        with self.pager.lock:
            taken = self.cache.take_all_dirty()
            if taken is not None:
                self.pager.counters.row_flushes += 1
                self._write_host(*taken)
            self.settle()

    def settle(self) -> None:
        """Wait for the writes to the host tables queued on the device: kernel
        stores into mapped host memory, which host reads must see."""
        if not self._unsettled:
            return
        self._unsettled = False
        self.pager.row_stream.transport.compute_stream().synchronize()
        if self._writes_in_flight:
            self._wait_writes()

    # ---------------------------------------------------------- gradients
    def _grad_arrived(self, rows: torch.Tensor, leaf: torch.Tensor, every_row: bool) -> None:
        grad, leaf.grad = leaf.grad, None
        with self.pager.lock:
            current = self.param.grad
            if current is None:
                current = RowGrad(self)
                self.param.grad = current
            if isinstance(current, RowGrad) and current.made is None:
                current.add(rows, grad, every_row)
                return
            piece = RowGrad(self)
            piece.add(rows, grad, every_row)
            self.param.grad = current + piece.make_real()

    def take_grad(self):
        """(rows, gradient of those rows on the device) for the update, or None."""
        g = self.param.grad
        if g is None:
            return None
        sparse = bool(self.module.sparse)
        if isinstance(g, RowGrad) and g.made is None:
            return g.rows_and_grad()
        if isinstance(g, RowGrad):
            g = g.made
        if not g.is_sparse:
            raise ValueError(
                f"pager: the gradient of row table {self.name!r} is a dense {tuple(g.shape)} tensor; a row table "
                f"takes a sparse COO gradient (as autograd gives it): assign one, e.g. dense.to_sparse().")
        g = g.coalesce()
        rows = g._indices()[0].to(self.device)
        values = g._values().to(self.device)
        if not sparse:
            return rows, values
        k = rows.numel()
        slots = torch.arange(k, device=self.device)[None]
        return rows, torch.sparse_coo_tensor(slots, values, (k, self.shape[1]), is_coalesced=True)

    # ---------------------------------------------------------- optimizer
    def step(self, optimizer, group_index: int, run_step) -> None:
        """Update the rows the gradient touches with `optimizer` (its group
        `group_index` holds the table): see [Note: exact updates of touched rows]."""
        self._check_current()
        g, held, self._rows_held = self.param.grad, self._rows_held, None
        placed, self._placed = self._placed, None
        taken = self.take_grad()
        if taken is None:
            return
        rows, grad = taken
        state = optimizer.state[self.param]
        self._adopt_state(state)
        row_kinds = tuple(k for k in self.hosts if k != WEIGHT)
        cache, slots = self.cache, None
        if placed is not None and rows is placed.rows and placed.epoch == cache.epoch:
            # The gradient is the last lookup's, over its rows, which are
            # where it put them and as it gave them (its batch tensor): any
            # write to the table since would have moved the cache's epoch
            # (`_check_current` forgets the cache for writes from outside).
            slots = placed.slots
            gathered = {WEIGHT: placed.batch.detach(),
                        **{k: cache.columns[k].index_select(0, slots) for k in row_kinds}}
            uncached = slots[:0]
        else:
            # The gradient's rows are among those looked up since the last step:
            # if the cache held them all then and holds the same rows now, every
            # one is a hit, and no host sync counts the misses.
            all_held = (held is not None and held is not False and held == cache.epoch
                        and isinstance(g, RowGrad) and g.made is None)
            gathered, uncached = self.gather(rows, (WEIGHT,) + row_kinds, n_miss=0 if all_held else None)
        epoch = cache.epoch
        view = nn.Parameter(gathered[WEIGHT])
        view.grad = grad
        optimizer.state[view] = {k: (gathered[k] if k in row_kinds else v) for k, v in state.items()}
        groups = optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for i, g in enumerate(groups):
                g["params"] = [view] if i == group_index else []
            run_step(optimizer)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
            new_state = optimizer.state.pop(view, {})
        k = rows.numel()
        values = {WEIGHT: view.detach()}
        for key, value in new_state.items():
            if isinstance(value, torch.Tensor) and value.shape == (k, self.shape[1]):
                if key not in self.hosts:
                    self._new_state_kind(key, value.dtype, state)
                    uncached = torch.arange(k, device=self.device)  # (the cache was emptied for the new column)
                values[key] = value.to_dense() if value.is_sparse else value
            else:
                state[key] = value
        self.write(rows, values, uncached, slots if cache.epoch == epoch else None)

    def _new_state_kind(self, key: str, dtype: torch.dtype, state: dict) -> None:
        self.flush()  # (the cache is emptied to make room for the new column)
        zeros = torch.zeros((), dtype=dtype).expand(self.shape)
        host = self._new_host_table(zeros)
        self.hosts[key] = host
        self.host_aliases[key] = host_alias(host)
        self.views[key] = host_view(host, self.device)
        self.readers[key] = self._reader(host, self.views[key])
        self.state_views[key] = state[key] = RowStateTensor.of(host, self)
        self.cache.shape_columns(tuple(self.hosts))

    def _adopt_state(self, state: dict) -> None:
        """Take state tensors of the table's shape into host tables: ones the
        optimizer made at construction (Adagrad's sum), or put there by
        `load_state_dict`."""
        for key, value in list(state.items()):
            if (not isinstance(value, torch.Tensor) or value.shape != self.shape
                    or self.state_views.get(key) is value):
                continue
            if key not in self.hosts:
                self._new_state_kind(key, value.dtype, state)
            else:
                self.flush()  # (cached rows are forgotten below: their changes must land first)
            with torch.no_grad():
                self.hosts[key].copy_(value)
            state[key] = self.state_views[key]
            self.forget()

    # ------------------------------------------------------------- close
    def restore(self, optimizers) -> None:
        """Give the Parameter (and the optimizers' state) back as ordinary tensors on the original device."""
        self.flush()
        param = self.param
        self._set_ahead(None)
        grad = param.grad
        if isinstance(grad, RowGrad):
            grad = grad.make_real()
        param.__class__ = nn.Parameter
        del param._row_table
        with torch.no_grad():
            # (an adopted table is the user's own CPU tensor: it stays; an arena page is copied out)
            param.data = self.host if self._adopted else self.host.to(self.original_device, copy=True)
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered.data_ptr())
            self._registered = None
        if grad is not None:
            grad = grad.to(self.original_device)
            param.grad = grad if self.module.sparse else grad.to_dense()
        for opt in optimizers:
            state = opt.state.get(param)
            for key, value in list((state or {}).items()):
                if value is self.state_views.get(key):
                    state[key] = self.hosts[key].to(self.original_device, copy=True)

    def device_bytes(self) -> int:
        return self.cache.device_bytes()

    def __repr__(self) -> str:
        return (f"RowTable({self.name!r}, {self.shape[0]} rows x {self.shape[1]}, cache of {self.cache.capacity} rows, "
                f"{format_bytes(self.device_bytes())} on the device)")


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


def find_row_table(tables: list, table) -> RowTable:
    """The one of `tables` that `table` names: its module, its weight or its qualified name."""
    for t in tables:
        if table is t.module or table is t.param or (isinstance(table, str) and table == t.name):
            return t
    names = [t.name for t in tables]
    what = repr(table) if isinstance(table, str) else f"a {type(table).__name__}"
    raise ValueError(f"pager: {what} is not a row table of this model (its row tables: {names}); pass the "
                     f"module, its qualified name or its weight, of a table named by wrap(..., rows=...).")


# ------------------------------------------------------------- choosing
def choose(model: nn.Module, spec, budget_bytes: int) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) of each table `wrap(..., rows=spec)` names.

    Args:
        spec: None (none), "auto" (every plain Embedding / EmbeddingBag whose
            weight is larger than a quarter of the budget), or a list of
            modules or qualified names.
    """
    if spec is None:
        return []
    named = list(model.named_modules())
    if spec == "auto":
        found = [(n, m) for n, m in named if _is_table(m) and _nbytes(m.weight) > budget_bytes // 4]
    elif isinstance(spec, (list, tuple)):
        by_name = dict(named)
        by_id = {id(m): n for n, m in named}
        found = []
        for item in spec:
            if isinstance(item, str):
                if item not in by_name:
                    raise ValueError(f"pager: rows= names {item!r}, which is not a submodule of the model; give "
                                     f"qualified names from model.named_modules() (or the modules themselves).")
                found.append((item, by_name[item]))
            elif isinstance(item, nn.Module) and id(item) in by_id:
                found.append((by_id[id(item)], item))
            else:
                raise ValueError(f"pager: rows= holds {item!r}, which is not a submodule of the model; pass "
                                 f"modules taken from the model or their qualified names.")
    else:
        raise ValueError(f"pager: rows={spec!r} must be None, \"auto\" or a list of nn.Embedding / "
                         f"nn.EmbeddingBag modules (or their qualified names).")
    for name, m in found:
        _check_table(model, name, m)
    return found


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_table(m: nn.Module) -> bool:
    return (isinstance(m, (nn.Embedding, nn.EmbeddingBag))
            and type(m).forward in (nn.Embedding.forward, nn.EmbeddingBag.forward))


def _check_table(model: nn.Module, name: str, m: nn.Module) -> None:
    if not _is_table(m):
        raise ValueError(f"pager: rows= names {name!r}, a {type(m).__name__}; row paging takes nn.Embedding and "
                         f"nn.EmbeddingBag modules whose forward is torch's own.")
    w = m.weight
    if w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"pager: row table {name!r} has a weight of shape {tuple(w.shape)} that is not a contiguous "
                         f"matrix; make it one (weight.data = weight.data.contiguous()).")
    holders = [n for n, other in model.named_modules() if other is not m
               and any(t is w for t in other._parameters.values())]
    if holders:
        raise ValueError(f"pager: row table {name!r} shares its weight with {holders[0]!r} (tied weights); a row "
                         f"table is read by lookups only. Leave it out of rows=.")
