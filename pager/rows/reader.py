"""Bringing scattered rows of a host table to the device: two paths run at
once, and the rows a caller said it would need, read ahead.

[Note: two paths for scattered rows]
The rows a lookup misses in the cache are scattered over the host table. Two
ways bring them to the device, limited by different things:

- mapped reads: a kernel (`index_select` on the table's `host_view`) reads the
  rows over the link. Each 512-byte row is its own read that the link's
  address translation must resolve; on the H100 machine (RESULTS) 131,072
  sorted rows come at 50 GB/s from a 4 GB table but at 19 GB/s from a 40 GB
  one (the translation caches cover less of a larger table; huge pages on the
  host, or the CUDA VMM's 2 MiB host pages, do not change it).
- staged: CPU threads gather the rows into a pinned staging buffer
  (`index_select` on the host table), chunk by chunk, and the copy engine
  copies each chunk while the next is gathered: ~24 GB/s, set by the CPU's
  memory, not by the table's size.

Where the kernel is slowed by translation, the two together fill the link
better than either: a split read gives the first `mapped_share` of the rows
to the kernel on the compute stream and the rest to the CPU and the row
stream, which the compute stream then waits for. Where the kernel alone runs
near the link's speed, a split only makes the two compete for the link. So
both choices are learned, as diffusers learns its execution order: the time
per row of each way (kernel alone, split) is measured with CUDA events on
the reads themselves, each read takes the faster way (the other is measured
again every `_REMEASURE_EVERY` reads), and after a split read the share moves
halfway to where both paths would finish together (the kernel's rate from
its events, the CPU's from the clock). A read of fewer than `SPLIT_MIN_ROWS`
rows takes the kernel alone (the CPU path's fixed costs would dominate).

[Note: rows read ahead]
`Pager.expect_rows(table, indices)` reads the rows that `indices` will look up
and the device cache lacks, on the row stream, while the compute stream runs
on, with no host sync: the lookups are sorted, their unique rows numbered
with a running count (as a lookup numbers them), the rows the cache lacks
marked, and a kernel (`rows.kernels.read_where`) reads the marked rows into a
tensor as long as the lookups, skipping the others (no count, so nothing
waits). The rows are clamped to the table for the read.

A lookup numbers its rows the same way before it can gather (both call
`number_lookups`), so the read also prepares the lookup of `indices`: the
facts the host needs (the lowest and highest row, how many unique rows, how
many were read, the padding row's place, how many were read while a
write-back of them was in flight) are copied to pinned memory on the row
stream right after the count, before the read, with an event. A lookup of
that very tensor, unchanged (its version counter), with the same padding row,
while the cache holds the rows it held at the read (its `epoch`) and no row
was written through to the host table since, waits on the host for that
event only (the row stream's sort, long done; not compute's queue, not the
read) and takes the rows, positions and counts from there: no host sync, so
the host runs on ahead of the device, and the rows the cache lacked, already
read, are exactly the lookup's misses. A row out of the table makes the
lookup do its own work, which raises.

Rows that are current: a row changed after the read began leaves the cache
(an epoch) or was written through (a count), either of which makes a
prepared lookup give way; a row whose write-back ([Note: rows written back by
the host] in rows/writer.py) was still running when the read began may have
been read before or after that write (the numbering marks it stale: its map
entry is that write-back's mark, [Note: few launches on the row path] in
rows/kernels.py), so the prepared lookup takes those rows from the
write-backs' device copies (`patch_written`, on the compute stream): no wait
for the writer's thread. Any
other lookup takes the rows it misses from the rows read ahead where they are
current (`serve`: rows written since the read began, noted, are read again
from the host table, after their writes; one host sync for the count). Any
other write to the table drops the rows read ahead (`RowTable.forget`).
"""

from __future__ import annotations

import time
from typing import cast

import torch

from .cache import WEIGHT
from .kernels import NO_STALE, mark_of, number_lookups, patch_written, read_where
from .writer import HostRowWriter

SPLIT_MIN_ROWS = 8192
_CHUNKS = 8
_SHARE_BOUNDS = (0.1, 0.9)  # a split keeps some rows on each path, so both keep being measured
_REMEASURE_EVERY = 16


class RowStream:
    """The row tables' side stream (rows read ahead), pinned staging buffer
    and `writer` of rows written back, one per model, with the transport's
    cheap stream handling (`compute_stream`, `on`)."""

    def __init__(self, transport):
        self.transport = transport
        self.stream = torch.cuda.Stream(transport.device)
        self.writer = HostRowWriter(transport)
        self._staging = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        self._staging_free = None  # an event: the last copies out of the staging buffer are done

    def staging(self, nbytes: int) -> torch.Tensor:
        """The pinned staging buffer, at least `nbytes`, free to write."""
        if self._staging_free is not None:
            # The CPU is about to overwrite what the copy engine may still be reading.
            self._staging_free.synchronize()
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging

    def staging_released(self) -> None:
        self._staging_free = torch.cuda.Event()
        self._staging_free.record(self.stream)


class HostRowReader:
    """Reads sorted rows of one host table onto the device (see [Note: two
    paths for scattered rows]).

    Args:
        host: the page-locked host table.
        view: `host` as a device tensor (`rows/tensors.host_view`).
        rows_stream: the model's `RowStream`, or None on the CPU device.
        before_host_read: called before CPU threads read `host` (its queued
            writes must land first), or None.
    """

    def __init__(self, host: torch.Tensor, view: torch.Tensor, rows_stream: RowStream | None, before_host_read=None):
        self.host, self.view, self.rows_stream = host, view, rows_stream
        self.before_host_read = before_host_read
        self.mapped_share = 0.5  # of a split read, the rows the kernel reads
        self.learn = True  # False: `mapped_share` as set (1.0: the kernel alone)
        self.row_seconds = {"kernel": None, "split": None}  # measured per row, each way
        self._reads = 0
        self._pending: tuple | None = None  # the last read's events, to learn from

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """The table's `rows` (sorted, on the device) as a new device tensor."""
        n = rows.numel()
        if self.rows_stream is None or n < SPLIT_MIN_ROWS:
            return self.view.index_select(0, rows)
        self._learn()
        compute = self.rows_stream.transport.compute_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        m = int(n * self.mapped_share) if self._split_now() else n
        if m == n:
            start.record(compute)
            out = self.view.index_select(0, rows)
            end.record(compute)
            self._pending = ("kernel", n, start, end)
            return out
        staged_rows = rows[m:].cpu()  # (before the kernel is queued: this waits for the compute stream)
        out = torch.empty(n, self.host.shape[1], dtype=self.host.dtype, device=self.view.device)
        # `out` was allocated on the compute stream: the row stream writes its
        # part only after what compute queued before (a previous use of that
        # memory), and not after the kernel below, which it runs beside.
        self.rows_stream.stream.wait_stream(compute)
        kernel_end = torch.cuda.Event(enable_timing=True)
        start.record(compute)
        torch.index_select(self.view, 0, rows[:m], out=out[:m])
        kernel_end.record(compute)
        cpu_s = self._staged(staged_rows, out[m:], compute)
        end.record(compute)
        self._pending = ("split", n, start, end, kernel_end, m, cpu_s)
        return out

    def _split_now(self) -> bool:
        """Whether this read splits: as set, or (learning) the way measured
        faster per row, the other way measured first and every
        `_REMEASURE_EVERY` reads (a table's rows may move to a part of it
        with other costs)."""
        if not self.learn:
            return self.mapped_share < 1.0
        self._reads += 1
        kernel_s, split_s = self.row_seconds["kernel"], self.row_seconds["split"]
        if kernel_s is None or split_s is None:
            return kernel_s is not None
        faster = split_s < kernel_s
        return faster != (self._reads % _REMEASURE_EVERY == 0)

    def _staged(self, rows_cpu: torch.Tensor, out: torch.Tensor, compute) -> float:
        """Gather `rows_cpu` by CPU threads into staging, chunk by chunk, each
        copied to `out` on the row stream while the next is gathered; the
        compute stream waits for the copies. Returns the CPU's seconds."""
        rs = cast(RowStream, self.rows_stream)  # (a split read has one: `_split_now`)
        row_bytes = self.host.shape[1] * self.host.element_size()
        stage = rs.staging(rows_cpu.numel() * row_bytes)[: rows_cpu.numel() * row_bytes]
        stage = stage.view(self.host.dtype).view(-1, self.host.shape[1])
        if self.before_host_read is not None:
            self.before_host_read()
        bounds = [i * rows_cpu.numel() // _CHUNKS for i in range(_CHUNKS + 1)]
        t0 = time.perf_counter()
        with rs.transport.on(rs.stream):
            for lo, hi in zip(bounds, bounds[1:]):
                torch.index_select(self.host, 0, rows_cpu[lo:hi], out=stage[lo:hi])
                out[lo:hi].copy_(stage[lo:hi], non_blocking=True)
        seconds = time.perf_counter() - t0
        rs.staging_released()
        # The lookup reads `out` on the compute stream: the copies must have landed.
        compute.wait_stream(rs.stream)
        return seconds

    def _learn(self) -> None:
        """From the last read: its time per row (each way), and for a split,
        the share moved halfway to where both paths would finish together."""
        pending, self._pending = self._pending, None
        if pending is None or not self.learn or not pending[3].query():
            return  # (not measured yet: learn from a later read rather than wait)
        way, n, start, end = pending[:4]
        seconds = start.elapsed_time(end) / 1e3 / n
        last = self.row_seconds[way]
        self.row_seconds[way] = seconds if last is None else (last + seconds) / 2
        if way != "split":
            return
        kernel_end, mapped, cpu_s = pending[4:]
        kernel_s = start.elapsed_time(kernel_end) / 1e3
        if mapped <= 0 or kernel_s <= 0 or cpu_s <= 0:
            return
        mapped_rate, staged_rate = mapped / kernel_s, (n - mapped) / cpu_s
        target = mapped_rate / (mapped_rate + staged_rate)
        low, high = _SHARE_BOUNDS
        self.mapped_share = min(high, max(low, (self.mapped_share + target) / 2))


class ReadAhead:
    """Rows of one table read ahead for the lookups to come, and the lookup
    of `indices` prepared (see [Note: rows read ahead]).

    Args:
        indices: the tensor the rows were read for (a lookup of this very
            tensor, unchanged, takes the prepared lookup).
        pad: the table module's padding row (non-negative), or None.
        epoch, writes_through: the cache's epoch and the table's count of
            writes through to its host tables when the read began.
        lookups: `indices` numbered (`Lookups`), or None (no lookup).
        values: [len(lookups.rows), dim], the rows read where `lookups.need`.
        facts: int64 [6]: `lookups.facts` (how many rows were read while a
            write-back of them was in flight, the last); on the host once
            `facts_ready`.
        facts_ready: an event after the facts' copy, or None (they are ready).
        done: an event after the read, or None (read on the compute stream).
        rows_stream: the model's `RowStream`, or None.
        in_flight: (rows, weight values) on the device of the write-backs in
            flight at the read, oldest first (`lookups.stale` marks the rows
            they write, which the lookup takes from there).
    """

    MAX_WRITES = 8  # writes since the read began, before it is dropped (the caller stopped using it)

    def __init__(
        self,
        indices,
        pad,
        epoch,
        writes_through,
        lookups,
        values,
        facts,
        facts_ready,
        done,
        rows_stream: RowStream | None,
        in_flight,
    ):
        self.indices, self.index_version, self.pad = indices, indices._version, pad
        self.epoch, self.writes_through = epoch, writes_through
        self.lookups, self.values = lookups, values
        self.in_flight = list(in_flight)
        self._facts, self._facts_ready, self.done, self.rows_stream = facts, facts_ready, done, rows_stream
        self.written: list[torch.Tensor] = []  # row tensors written since the read began
        self._counted = False  # the rows read went to the stats

    @classmethod
    def start(
        cls,
        indices: torch.Tensor,
        view: torch.Tensor,
        slot_of_row,
        rows_stream: RowStream | None,
        pad=None,
        epoch=None,
        writes_through=0,
        in_flight=(),
        stale_below=NO_STALE,
    ):
        """Read the rows of `indices` that the cache lacks (`slot_of_row[row]
        < 0`; None: no cache), on the row stream, and prepare their lookup;
        no host sync. `in_flight`: (rows, weight values) of write-backs that
        may still run, whose rows carry a map entry of at most `stale_below`."""
        args = (indices, view, slot_of_row, pad, stale_below)
        facts_ready = done = None
        if rows_stream is None:
            lookups, values, facts = cls._read(*args)
        else:
            compute, stream = rows_stream.transport.compute_stream(), rows_stream.stream
            # `indices` may be made by work queued on the compute stream.
            stream.wait_stream(compute)
            if indices.device.type == "cuda":
                indices.record_stream(stream)  # (the caller may free it while the row stream still reads it)
            facts_ready, done = torch.cuda.Event(), torch.cuda.Event()
            with rows_stream.transport.on(stream):
                lookups, values, facts = cls._read(*args, facts_ready)
                done.record(stream)
        return cls(
            indices, pad, epoch, writes_through, lookups, values, facts, facts_ready, done, rows_stream, in_flight
        )

    @staticmethod
    def _read(indices, view, slot_of_row, pad, stale_below, facts_ready=None):
        # (sizes known on the host, so nothing waits: the host runs on while the row stream reads)
        if indices.numel() == 0:
            return None, None, torch.tensor([-1, -1, -1, 0, -1, 0])
        lookups = number_lookups(indices, view.shape[0], slot_of_row, pad, view.device, stale_below)
        facts = lookups.facts
        if facts_ready is not None:
            # The facts come to the host before the read: the lookup waits for them, not for it.
            facts = torch.empty(6, dtype=torch.long, pin_memory=True)
            facts.copy_(lookups.facts, non_blocking=True)
            facts_ready.record()
        return lookups, read_where(view, lookups.rows, lookups.need), facts

    def facts(self) -> list:
        """The facts (see the class), waiting on the host for them (only)."""
        if self._facts_ready is not None:
            self._facts_ready.synchronize()  # (the row stream's sort and counts: not its read, nor compute)
        return self._facts.tolist()

    def prepared(self, index, pad, epoch: int, writes_through: int, n_rows: int):
        """The lookup of `index` as prepared: (its `Lookups`; how many unique
        rows; how many were read, which are all those the cache lacks, at
        `need`, in `values`; the padding row's position among them or None),
        if `index` is the tensor
        read for, unchanged, with the same padding row, the cache holds the
        same rows, no row was written through to the host table since, and
        every lookup is in the table (of `n_rows`); else None (the lookup does
        it all itself, and raises for a row out of the table). Rows that
        write-backs in flight at the read may have changed are read again,
        after those writes."""
        if (
            index is not self.indices
            or index._version != self.index_version
            or pad != self.pad
            or epoch != self.epoch
            or writes_through != self.writes_through
        ):
            return None
        low, high, last, n_read, pad_at, stale = self.facts()
        if low < 0 or high >= n_rows:
            return None
        lookups = self.lookups
        self.on_compute(
            lookups.rows, lookups.need, lookups.rank, lookups.inverse, self.values, *([lookups.stale] if stale else [])
        )
        for rows, values in self.in_flight if stale else ():
            # Rows a write-back in flight at the read may have changed after
            # they were read: their values are the write-back's device copy.
            patch_written(self.values, lookups.rows, rows, values, which=lookups.stale)
        return lookups, last + 1, n_read, None if pad_at < 0 else pad_at

    def note_written(self, rows: torch.Tensor) -> bool:
        """Rows written to the table; False once too many writes piled up (drop it)."""
        self.written.append(rows)
        return len(self.written) <= self.MAX_WRITES

    def take_read_count(self) -> int:
        """Rows read ahead, the first time it is asked (0 after); waits for
        the row stream's counts (not its read)."""
        if self._counted:
            return 0
        self._counted = True
        return max(self.facts()[3], 0)

    def on_compute(self, *tensors) -> None:
        """Make the compute stream wait for the read, whose `tensors` it uses now."""
        if self.done is None:
            return
        compute = cast(RowStream, self.rows_stream).transport.compute_stream()  # (`done`: read on the row stream)
        # The read ahead ran on the row stream; its tensors are used here now.
        compute.wait_event(self.done)
        for t in tensors:
            t.record_stream(compute)

    def serve(self, rows: torch.Tensor, read) -> tuple[torch.Tensor, int]:
        """(the table's sorted `rows`, how many came from here): the current
        rows read ahead, the others by `read(rows)`."""
        if self.lookups is None:
            return read(rows), 0
        ahead_rows, need = self.lookups.rows, self.lookups.need
        self.on_compute(ahead_rows, need, self.values)
        pos = torch.searchsorted(ahead_rows, rows).clamp_(max=ahead_rows.numel() - 1)
        current = ahead_rows.index_select(0, pos).eq(rows).logical_and_(need.index_select(0, pos))
        if self.written:
            current &= ~_among(rows, torch.cat(self.written))
        # Served rows first, each part in row order; one host sync (the count).
        order = torch.argsort(current.logical_not().to(torch.uint8), stable=True)
        n_served = int(current.sum())
        served, rest = order[:n_served], order[n_served:]
        out = torch.empty(rows.numel(), self.values.shape[1], dtype=self.values.dtype, device=rows.device)
        out.index_copy_(0, served, self.values.index_select(0, pos.index_select(0, served)))
        if rest.numel():
            out.index_copy_(0, rest, read(rows.index_select(0, rest)))
        return out, n_served


def _among(x: torch.Tensor, of: torch.Tensor) -> torch.Tensor:
    """Which of `x` are among `of` (repeats allowed); unlike `torch.isin`, no
    host sync on CUDA (no unique)."""
    of = torch.sort(of).values
    at = torch.searchsorted(of, x).clamp_(max=max(of.numel() - 1, 0))
    return of.index_select(0, at) == x if of.numel() else torch.zeros_like(x, dtype=torch.bool)


def expect_rows(table, indices: torch.Tensor) -> None:
    """Start reading the rows `indices` will look up in `table` (a
    `RowTable`; see the Note): `pager.expect_rows`."""
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"pager: expect_rows({table.name!r}, indices) takes an int32 or int64 tensor of "
            f"rows; got {type(indices).__name__}"
            f"{f' of {indices.dtype}' if isinstance(indices, torch.Tensor) else ''}."
        )
    with table.pager.lock:
        table._check_current()
        # The read ahead does not wait for write-backs still running: the
        # rows they write are taken from their device copies when looked up.
        writes = table.writes
        writes.prune()
        in_flight = [(w.rows, w.values[WEIGHT]) for w in writes.in_flight]
        stale_below = mark_of(writes.in_flight[0].generation) if in_flight else NO_STALE
        table._set_ahead(
            ReadAhead.start(
                indices,
                table.views[WEIGHT],
                table.cache.slot_of_row,
                table.pager.row_stream,
                table._pad(getattr(table.module, "padding_idx", None)),
                table.cache.epoch,
                writes.through,
                in_flight,
                stale_below,
            )
        )
        for rows, _values in in_flight:
            table._note_written(rows)
