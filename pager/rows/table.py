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
   among them (`rows.kernels.number_lookups`: a sort and a running count,
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
from typing import NamedTuple, cast

import torch
import torch.nn as nn

from ..base.budget import format_bytes
from ..engine.host import unregister_table
from .cache import WEIGHT, RowCache
from .kernels import Lookups, number_lookups, patch_written, place_rows, touch_hits
from .reader import HostRowReader, ReadAhead, expect_rows
from .step import step_rows
from .tensors import _GUARDS, RowGrad, RowTableParameter, host_view
from .writer import host_alias
from .writes import HostWrites


# ------------------------------------------------------------- one table
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
        self.param = param = cast(nn.Parameter, module.weight)
        self.device = pager.device
        self.original_device = param.device
        self.shape, self.dtype = param.shape, param.dtype
        self.row_bytes = param.shape[1] * param.element_size()
        value = param.detach()
        # (a CPU table page-locked where it is is unregistered at restore)
        self.host, self._registered = pager.arena.host_table(value, self.device.type == "cuda", f"row table {name!r}")
        self._adopted = self.host is value
        self.writes = HostWrites(self)  # to the host tables, and those in flight
        self.hosts = {WEIGHT: self.host}  # kind -> host table (state kinds added at the first step)
        self.host_aliases = {WEIGHT: host_alias(self.host)}  # kind -> what the writer's thread stores into
        self.views = {WEIGHT: host_view(self.host, self.device)}
        self.readers = {WEIGHT: self.reader_of(self.host, self.views[WEIGHT])}
        self.state_views: dict[str, torch.Tensor] = {}  # kind -> the state table as the optimizer holds it
        self.ahead: ReadAhead | None = None  # rows read ahead by `expect`
        self._rows_held: bool | int | None = None  # see `_note_rows_held`
        self._placed: Placed | None = None  # the last lookup's rows where it put them, if training: `step`
        self.cache = RowCache(self.shape[0], self.shape[1], self.dtype, cache_bytes, self.device)
        self._aliases: weakref.WeakSet = weakref.WeakSet()  # tensors sharing a host table's memory (`note_aliases`)
        with torch.no_grad():
            param.data = self.host
        param.__class__ = RowTableParameter
        cast(RowTableParameter, param)._row_table = self
        self._version = param._version

    def reader_of(self, host: torch.Tensor, view: torch.Tensor) -> HostRowReader:
        """The reader of host table `host` (seen by the device as `view`).
        CPU threads of a split read read the host table itself: queued writes
        land first."""
        return HostRowReader(host, view, self.pager.row_stream, before_host_read=self.writes.settle)

    # ------------------------------------------------------------ lookups
    def note_aliases(self, out) -> None:
        """Keep track of the tensors in `out` that share a host table's memory
        (`.data`, `detach()`, views): writes through them skip every guard, so
        while one lives, updates go through to the host tables and each lookup
        forgets the cached rows ([Note: write-back of cached rows] in rows/writes.py)."""
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if (
                isinstance(t, torch.Tensor)
                and type(t) not in _GUARDS.values()
                and t.layout == torch.strided
                and t.untyped_storage().data_ptr() in self._host_pointers()
            ):
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
        expect_rows(self, indices)

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
            prepared = (
                None
                if ahead is None
                else ahead.prepared(bound["input"], pad, cache.epoch, self.writes.through, self.shape[0])
            )
            if prepared is None:
                lookups, u, n_miss, pad = self._batch_rows(bound["input"], pad)
            else:
                (lookups, u, n_miss, pad), values = prepared, cast(ReadAhead, ahead).values
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
            raise IndexError(
                f"pager: row table {self.name!r} has {self.shape[0]} rows; a lookup asked for "
                f"row {low if low < 0 else high}."
            )
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
        if values is None:
            values = self._read_missed(WEIGHT, missing)
        cache.tick += 1
        touch_hits(lookups, u, cache.slot_map(), cache.last_use, cache.tick)
        victims = torch.topk(cache.last_use, n_miss, largest=False).indices  # (none a hit: those hold this tick)
        take_out, mark, taken_state = cache.any_dirty and n_miss > 0, -1, {}
        if take_out:
            # (in the table's order: the host stores them faster, [Note: rows written back by the host])
            victims = victims.index_select(0, torch.argsort(cache.row_of_slot.index_select(0, victims)))
            mark = self.writes.next_mark()
            taken_state = {k: cache.columns[k].index_select(0, victims) for k in state_kinds}
        if n_miss:
            cache.epoch += 1
        batch, slots, taken = place_rows(lookups, u, values, by_rank, cache.map(), victims, cache.tick, mark, take_out)
        for kind in state_kinds:
            cache.columns[kind].index_copy_(0, victims, self._read_missed(kind, missing))
        if take_out:
            rows, keep, weight = taken
            self.writes.to_host(rows, {WEIGHT: weight, **taken_state}, keep=keep, aside=True)
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

    def gather(
        self,
        rows: torch.Tensor,
        kinds: tuple,
        insert: bool = True,
        n_miss: int | None = None,
        read: torch.Tensor | None = None,
    ):
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
        miss_rows = rows.index_select(0, miss_pos) if n_miss else rows[:0]  # (a view: no kernel)
        victims, mark = None, -1
        if cache.capacity:
            cache.touch(slots)
            if insert and n_miss:
                # Room first: taking the dirty rows out syncs the host, which
                # then waits only for the few kernels queued, not for the reads.
                victims, evicted = cache.make_room(n_miss, n - n_miss)
                if evicted is not None:
                    # (cached rows, so none of those read below: the reads do not wait for this write)
                    mark = self.writes.next_mark()
                    rows_out, values_out, keep_out = evicted
                    self.writes.to_host(rows_out, values_out, keep_out, aside=True)
        out = {}
        for kind in kinds:
            if hit_pos is None and slots is not None:  # every row a hit
                out[kind] = cache.columns[kind].index_select(0, slots)
                continue
            values = torch.empty(n, dim, dtype=self.hosts[kind].dtype, device=self.device)
            if slots is not None and slots.numel():
                values.index_copy_(0, hit_pos, cache.columns[kind].index_select(0, slots))
            if n_miss:
                missed = (
                    read.index_select(0, miss_pos)
                    if kind == WEIGHT and read is not None
                    else self._read_missed(kind, miss_rows)
                )
                values.index_copy_(0, miss_pos, missed)
            out[kind] = values
        if victims is None:
            return out, miss_pos
        fitted = victims.numel()
        fill = {}
        for kind in cache.kinds:  # a slot holds every kind
            fill[kind] = (
                out[kind].index_select(0, miss_pos[:fitted])
                if kind in out
                else self._read_missed(kind, miss_rows[:fitted])
            )
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
        for w in self.writes.in_flight:  # (oldest first: a row written back twice ends with its newest values)
            if kind in w.values:
                patch_written(out, rows, w.rows, w.values[kind])
        return out

    # ------------------------------------------------------------- writes
    def write(
        self, rows: torch.Tensor, values: dict, uncached: torch.Tensor, slots: torch.Tensor | None = None
    ) -> None:
        """Make `values` {kind: [n, dim]} the table's rows `rows`: in the cache
        for the rows it holds (written to the host tables later; `slots`:
        theirs, if known), through to the host tables for the positions
        `uncached` (what `gather` of the same rows returned). See [Note:
        write-back of cached rows] in rows/writes.py."""
        cache = self.cache
        if len(self._aliases) or not cache.capacity:
            self.writes.through += 1
            self.writes.to_host(rows, values)
            cache.update(rows, {k: v for k, v in values.items() if k in cache.columns}, dirty=False)
        else:
            cache.update(rows, values, dirty=True, slots=slots)
            if uncached.numel():
                self.writes.through += 1
                self.writes.to_host(
                    rows.index_select(0, uncached), {k: v.index_select(0, uncached) for k, v in values.items()}
                )
        if WEIGHT in values:
            self._note_written(rows)

    def flush(self) -> None:
        """Write the rows the cache changed to the host tables and wait for
        every write to them: on return the host tables are current."""
        with self.pager.lock:
            taken = self.cache.take_all_dirty()
            if taken is not None:
                self.pager.counters.row_flushes += 1
                self.writes.to_host(*taken)
            self.writes.settle()

    # ---------------------------------------------------------- gradients
    def _grad_arrived(self, rows: torch.Tensor, leaf: torch.Tensor, every_row: bool) -> None:
        grad, leaf.grad = cast(torch.Tensor, leaf.grad), None  # (its hook runs once the gradient is there)
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

    # ---------------------------------------------------------- optimizer
    def step(self, optimizer, group_index: int, run_step) -> None:
        """Update the rows the gradient touches with `optimizer` (see rows/step.py)."""
        step_rows(self, optimizer, group_index, run_step)

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
        delattr(param, "_row_table")
        with torch.no_grad():
            # (an adopted table is the user's own CPU tensor: it stays; an arena page is copied out)
            param.data = self.host if self._adopted else self.host.to(self.original_device, copy=True)
        unregister_table(self._registered)
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
        return (
            f"RowTable({self.name!r}, {self.shape[0]} rows x {self.shape[1]}, cache of {self.cache.capacity} rows, "
            f"{format_bytes(self.device_bytes())} on the device)"
        )
