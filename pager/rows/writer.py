"""Writing rows from the device back into host tables: the copy engine
brings them out, a CPU thread stores them.

[Note: rows written back by the host]
Rows that leave a row table's device cache changed go back to the host tables
while compute runs on ([Note: write-back of cached rows] in rows/writes.py). A
kernel storing them through the mapped table (`index_copy_` on its
`host_view`) sends each 512-byte row over the link as its own write, which
the link's address translation slows as it slows scattered reads: on the
H100 machine (RESULTS) the 64 MB of rows a step gave up from a 40 GB table
took 4.4 ms, beside 4.1 ms of reads of the rows it missed, on the same link.
So the rows are copied out contiguously instead (one copy-engine transfer
into pinned memory, `Transport.send_to_host` on the device-to-host stream, at
the link's full rate), and a CPU thread waits for that copy and stores them
into the host tables
(`index_copy_` on the CPU: its scattered stores cost the host's memory, not
the link).

A write may carry a device mask of the rows to keep (the slots a cache gave
up, dirty or not: picking the dirty ones on the device would take a host
sync to count them); it is copied out with the rows, and the thread stores
only those. A table keeps at most `WRITES_IN_FLIGHT` writes queued: past
that, the host waits for the oldest (the thread stores more slowly than the
steps give it rows), rather than pinning memory for more. The pinned memory
the rows are copied into is the writer's own, reused once the thread has
stored them (`_pinned`): a new pinned allocation of tens of MB each step
costs the host milliseconds (torch's caching host allocator has a block
free only once the thread let go of it, and otherwise allocates anew).

Order: a write is done when the thread has stored every row (`HostWrite`).
Whoever reads or writes a host table another way waits for the writes in
flight first (`RowTable` keeps them): a read of missed rows or a
write-through waits on the host for the last one (the thread runs the writes
in the order they were queued, so the last done means all done); a read
ahead does not wait and reads again, at the lookup, the rows written
meanwhile ([Note: rows read ahead] in rows/reader.py); `RowTable.settle`
waits for all of them. The thread stores into its own alias of each host
table (`host_alias`), whose version counter is not the Parameter's: its
stores are not writes from outside (`RowTable._check_current`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..base.common import WORKER_PREFIX


def host_alias(host: torch.Tensor) -> torch.Tensor:
    """`host` (a contiguous matrix)'s memory as a tensor with its own version
    counter, its rows seen as the widest integers that divide them (the CPU's
    `index_copy_` costs per element: a 512-byte row is 64 of them, not 128)."""
    row_bytes, at = host.shape[1] * host.element_size(), host.storage_offset() * host.element_size()
    dtype = next(
        t
        for t in (torch.int64, torch.int32, torch.int16, torch.uint8)
        if row_bytes % t.itemsize == 0 and at % t.itemsize == 0
    )
    alias = torch.empty(0, dtype=dtype)
    shape = (host.shape[0], row_bytes // dtype.itemsize)
    return alias.set_(host.untyped_storage(), at // dtype.itemsize, shape, (shape[1], 1))


class HostWrite:
    """Rows being stored into host tables by the writer's thread."""

    def __init__(self, future: Future):
        self._future = future

    def query(self) -> bool:
        """Whether every row is stored (raises what the thread raised)."""
        if not self._future.done():
            return False
        self._future.result()
        return True

    def wait(self) -> None:
        """Wait until every row is stored (raises what the thread raised)."""
        self._future.result()


class HostRowWriter:
    """Stores rows from the device into host tables (see [Note: rows
    written back by the host]); one per model.

    Args:
        transport: the model's CUDA transport (its copies out).
    """

    FREE_KEPT = 16  # pinned buffers kept for reuse, at most

    def __init__(self, transport):
        self.transport = transport
        self._thread = None  # a one-thread pool, started at the first write
        self._free = []  # pinned uint8 buffers the thread has stored from, to reuse
        self._free_lock = threading.Lock()

    def write(self, tables: dict, rows: torch.Tensor, values: dict, keep: torch.Tensor | None = None) -> HostWrite:
        """Store `values` {kind: [len(rows), dim] on the device} as the rows
        `rows` of `tables[kind]` (`host_alias`es), those where `keep` (a
        device mask) if given; the values were made on the compute stream,
        which runs on. Rows in order store fastest."""
        buffers: list[torch.Tensor] = []
        rows_host, copied = self.transport.send_to_host(rows, self._pinned(rows, buffers))
        keep_host = None
        if keep is not None:
            keep_host, copied = self.transport.send_to_host(keep, self._pinned(keep, buffers))
        staged = {}
        for kind, v in values.items():
            # (one stream: the last event is after all)
            staged[kind], copied = self.transport.send_to_host(v, self._pinned(v, buffers))
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{WORKER_PREFIX}row-writer")
        # The device tensors go to the thread too: it lets them go once the copies out of them have landed.
        sources = [rows, values, keep]
        future = self._thread.submit(_store, tables, rows_host, staged, keep_host, copied, sources)
        future.add_done_callback(lambda _f: self._release(buffers))
        return HostWrite(future)

    def _pinned(self, like: torch.Tensor, taken: list) -> torch.Tensor:
        """Pinned memory shaped as `like`: a free buffer large enough, or a
        new one (rounded up to a MiB, so later sizes fit); noted in `taken`."""
        nbytes = like.numel() * like.element_size()
        with self._free_lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buffer is None:
            buffer = torch.empty(-(-max(nbytes, 1) // 2**20) * 2**20, dtype=torch.uint8, pin_memory=True)
        taken.append(buffer)
        return buffer[:nbytes].view(like.dtype).view(like.shape)

    def _release(self, buffers: list) -> None:
        # (the thread's stores from them are done: the copy into them landed before)
        with self._free_lock:
            self._free = (self._free + buffers)[-self.FREE_KEPT :]

    def close(self) -> None:
        """Finish the writes queued and stop the thread."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _store(tables: dict, rows: torch.Tensor, staged: dict, keep, copied: torch.cuda.Event, sources: list) -> None:
    copied.synchronize()  # (the copy engine has put the rows in pinned memory)
    sources.clear()  # (their device memory may be reused now, while the stores run)
    if keep is not None and not bool(keep.all()):
        at = keep.nonzero().squeeze(1)
        rows, staged = rows.index_select(0, at), {k: v.index_select(0, at) for k, v in staged.items()}
    for kind, values in staged.items():
        tables[kind].index_copy_(0, rows, values.view(tables[kind].dtype))
