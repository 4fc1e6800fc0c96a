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
on, with no host sync: the lookups are sorted, the first lookup of each row
the cache lacks is marked, and a kernel (`_kernels.read_where`) reads the
marked rows into a tensor as long as the lookups, skipping the others (no
count, so nothing waits). The rows are clamped to the table (the lookup
itself checks the range and raises). A later lookup takes the rows it misses
in the cache from there, if they are current: a row a step changed after the
read began (in the cache or through to the host table, as `max_norm`
renormalisations too) may leave the cache and be written back, and one whose
write-back ([Note: rows written back by the host] in _row_writer.py) was
still running when the read began may have been read before or after that
write, so such rows are read again from the host table, after the write has
landed (the host waits for it). Any other write to the table drops the rows
read ahead (`RowTable.forget`).
"""

from __future__ import annotations

import time

import torch

from ._kernels import read_where
from ._row_writer import HostRowWriter

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
        view: `host` as a device tensor (`_rows.host_view`).
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
        self._pending = None  # the last read's events, to learn from

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
        rs = self.rows_stream
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
    """Rows of one table read ahead for the lookups to come (see [Note: rows read ahead]).

    Args:
        rows: the lookups' rows, sorted (repeats kept).
        need: which of them were read: the first lookup of each row the
            cache lacked.
        values: [len(rows), dim], the rows read where `need`.
        read: how many rows were read, a 0-d tensor beside `values`.
        done: an event after the read, or None (read on the compute stream).
        rows_stream: the model's `RowStream`, or None.
    """

    MAX_WRITES = 8  # writes since the read began, before it is dropped (the caller stopped using it)

    def __init__(self, rows, need, values, read, done, rows_stream: RowStream | None):
        self.rows, self.need, self.values, self.done, self.rows_stream = rows, need, values, done, rows_stream
        self.written = []  # row tensors written since the read began
        self._read = read  # rows read, for the stats: a tensor, then an int once on the host, None once counted

    @classmethod
    def start(cls, indices: torch.Tensor, view: torch.Tensor, slot_of_row, rows_stream: RowStream | None):
        """Read the rows of `indices` that the cache lacks (`slot_of_row[row]
        < 0`; None: no cache), on the row stream; no host sync."""
        if rows_stream is None:
            return cls(*cls._read(indices, view, slot_of_row), None, None)
        compute = rows_stream.transport.compute_stream()
        stream = rows_stream.stream
        # `indices` may be made by work queued on the compute stream.
        stream.wait_stream(compute)
        if indices.device.type == "cuda":
            indices.record_stream(stream)  # (the caller may free it while the row stream still reads it)
        with rows_stream.transport.on(stream):
            read = cls._read(indices, view, slot_of_row)
            done = torch.cuda.Event()
            done.record(stream)
        return cls(*read, done, rows_stream)

    @staticmethod
    def _read(indices: torch.Tensor, view: torch.Tensor, slot_of_row):
        # (sizes known on the host, so nothing waits: the host runs on while the row stream reads)
        rows = torch.sort(indices.to(view.device, torch.long).flatten().clamp(0, view.shape[0] - 1)).values
        need = torch.ones_like(rows, dtype=torch.bool)
        torch.ne(rows[1:], rows[:-1], out=need[1:])
        if slot_of_row is not None:
            need &= slot_of_row.index_select(0, rows) < 0
        return rows, need, read_where(view, rows, need), need.sum()

    def note_written(self, rows: torch.Tensor) -> bool:
        """Rows written to the table; False once too many writes piled up (drop it)."""
        self.written.append(rows)
        return len(self.written) <= self.MAX_WRITES

    def take_read_count(self) -> int:
        """Rows read ahead, the first time it is asked (0 after). Unless a
        `serve` brought the count over, this waits for the row stream (only)."""
        n, self._read = self._read, None
        if n is None or isinstance(n, int):
            return n or 0
        if self.rows_stream is None:
            return int(n)
        with self.rows_stream.transport.on(self.rows_stream.stream):
            return int(n)  # (a copy on the row stream, after the read: compute's queue is not waited for)

    def serve(self, rows: torch.Tensor, read) -> tuple[torch.Tensor, int]:
        """(the table's sorted `rows`, how many came from here): the current
        rows read ahead, the others by `read(rows)`."""
        if self.rows.numel() == 0:
            return read(rows), 0
        if self.done is not None:
            compute = self.rows_stream.transport.compute_stream()
            # The read ahead ran on the row stream; its tensors are used here now.
            compute.wait_event(self.done)
            for t in (self.rows, self.need, self.values, self._read):
                if isinstance(t, torch.Tensor):
                    t.record_stream(compute)
        # (the first lookup of a row is the one read, if any: where searchsorted lands)
        pos = torch.searchsorted(self.rows, rows).clamp_(max=self.rows.numel() - 1)
        current = self.rows.index_select(0, pos).eq(rows).logical_and_(self.need.index_select(0, pos))
        if self.written:
            current &= ~torch.isin(rows, torch.cat(self.written))
        # Served rows first, each part in row order; one host sync (the counts).
        order = torch.argsort(current.logical_not().to(torch.uint8), stable=True)
        counts = [current.sum()] + ([self._read] if isinstance(self._read, torch.Tensor) else [])
        n_served, *n_read = torch.stack(counts).tolist()
        if n_read:
            self._read = n_read[0]
        served, rest = order[:n_served], order[n_served:]
        out = torch.empty(rows.numel(), self.values.shape[1], dtype=self.values.dtype, device=rows.device)
        out.index_copy_(0, served, self.values.index_select(0, pos.index_select(0, served)))
        if rest.numel():
            out.index_copy_(0, rest, read(rows.index_select(0, rest)))
        return out, n_served
