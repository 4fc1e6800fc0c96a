"""A row table's writes to its host tables: `HostWrites`, one per table.

Rows reach the host tables in two ways (see the Note below): through, on
the compute stream (`to_host`), or aside, by the writer's thread while
compute runs on (`to_host(aside=True)`: a `WriteBack` in flight, whose
device copy serves reads of its rows until it lands). Each write-back has a
generation, whose mark the cache's map holds for the rows it took out
([Note: few launches on the row path] in rows/kernels.py).

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
  (`RowTable._read_missed`), and so does a prepared lookup for the rows read ahead
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
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels import GENERATIONS, mark_of
from .writer import HostWrite

WRITES_IN_FLIGHT = 2  # write-backs a table's writer's thread may have queued, at most


class WriteBack(NamedTuple):
    """A write of rows to the host tables by the writer's thread, maybe still running."""

    rows: torch.Tensor  # on the device, sorted
    values: dict  # kind -> [len(rows), dim] on the device: what it writes (rows that are clean included)
    written: HostWrite  # the writer's
    generation: int  # its number: the mark of its rows in the cache's map


class HostWrites:
    """The writes of one row table to its host tables, and those still in flight.

    Args:
        table: the `RowTable` (its host tables, views, cache and pager).
    """

    def __init__(self, table):
        self.table = table
        self.in_flight: list[WriteBack] = []  # maybe still running, oldest first
        self.generation = 0  # the next write-back's number (its rows' mark in the cache's map)
        self.through = 0  # writes of rows through to the host tables (`RowTable.write`), counted
        self.unsettled = False  # writes to the host tables queued on the device, not yet waited for

    def to_host(self, rows: torch.Tensor, values: dict, keep: torch.Tensor | None = None, aside: bool = False) -> None:
        """Write `values` {kind: [n, dim]} of `rows` (where `keep`, if given)
        to the host tables: on the compute stream, or `aside` by the writer
        (copied out, then stored by a CPU thread) while compute runs on."""
        if keep is not None and not (aside and self.table.device.type == "cuda"):  # (the writer's thread applies it)
            rows, values = rows[keep], {k: v[keep] for k, v in values.items()}
            if not rows.numel():
                return
        for v in values.values():
            self.table.pager.counters.row_d2h_bytes += v.numel() * v.element_size()
        if self.table.device.type != "cuda":
            for kind, v in values.items():
                self.table.views[kind].index_copy_(0, rows, v)
            self.table._version = self.table.param._version  # (our own writes moved it on the CPU device)
            return
        self.unsettled = True
        if not aside:
            if self.in_flight:
                self.wait_all()  # (a row written back may be written again: in order)
            for kind, v in values.items():
                self.table.views[kind].index_copy_(0, rows, v)
            return
        self.prune()
        while len(self.in_flight) >= WRITES_IN_FLIGHT:
            # The thread stores more slowly than the steps give it rows: the
            # host waits for it, rather than pinning memory for more.
            self.in_flight.pop(0).written.wait()
        written = self.table.pager.row_stream.writer.write(self.table.host_aliases, rows, values, keep)
        self.in_flight.append(WriteBack(rows, values, written, self.generation))
        self.generation += 1

    def wait_all(self) -> None:
        """Wait for every write-back in flight (raising what one raised),
        which then are not (their device copies go)."""
        for w in self.in_flight:  # (the thread runs them in order: after the first, little to wait for)
            w.written.wait()
        self.in_flight = []

    def next_mark(self) -> int:
        """What the cache's map holds for rows the next write-back takes out
        (see [Note: few launches on the row path] in rows/kernels.py): its
        mark on CUDA, -1 on the CPU device (whose writes are done on return)."""
        if self.table.device.type != "cuda":
            return -1
        if self.generation >= GENERATIONS:
            self.settle()  # (every mark is then of a write that is done: they go, and the count starts again)
            self.table.cache.slot_of_row.clamp_(min=-1)
            self.generation = 0
        return mark_of(self.generation)

    def prune(self) -> None:
        self.in_flight = [w for w in self.in_flight if not w.written.query()]

    def settle(self) -> None:
        """Wait for the writes to the host tables queued on the device: kernel
        stores into mapped host memory, which host reads must see."""
        if not self.unsettled:
            return
        self.unsettled = False
        self.table.pager.row_stream.transport.compute_stream().synchronize()
        if self.in_flight:
            self.wait_all()
