"""A row table's device cache: `RowCache`, one per table. See [Note: row
tables] in rows/table.py and [Note: write-back of cached rows] in rows/writes.py."""

from __future__ import annotations

import torch

from .kernels import CacheMap

WEIGHT = "weight"

_SLOT_BYTES = 8 + 8 + 1  # a slot's row, last use and dirty flag


class RowCache:
    """Rows of one table kept on the device: each slot holds a row's weight and
    its state rows (one column per kind), replaced least recently used first.
    A slot whose values an update changed is dirty until they are written to
    the host tables (see [Note: write-back of cached rows] in rows/writes.py).

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
        self.columns: dict[str, torch.Tensor] = {}
        self.any_dirty = False  # (on the host: no dirty slot, no look for one)
        self.slot_of_row: torch.Tensor | None = None  # (None: no slots)
        if self.capacity == 0:
            return
        # Row n_rows is a dummy: an empty slot's row, so that clearing the map
        # entries of evicted slots needs no mask (no host sync). Likewise slot
        # `capacity` is a dummy that writes of rows not cached go to.
        self.slot_of_row = torch.full((self.n_rows + 1,), -1, dtype=torch.int32, device=self.device)
        self.row_of_slot = torch.full((self.capacity,), self.n_rows, dtype=torch.long, device=self.device)
        self.last_use = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)
        self.dirty = torch.zeros(self.capacity + 1, dtype=torch.bool, device=self.device)
        self.columns = {
            k: torch.empty(self.capacity + 1, self.dim, dtype=self.dtype, device=self.device) for k in self.kinds
        }

    def clear(self) -> None:
        """Forget every row (the caller has written the dirty ones back, or they are stale)."""
        self.epoch += 1
        if self.capacity:
            self.slot_map().fill_(-1)
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
        slots = self.slot_map().index_select(0, rows).long()
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
        slot_of_row = self.slot_map()
        slot_of_row.index_fill_(0, self.row_of_slot.index_select(0, victims), mark)
        self.row_of_slot.index_copy_(0, victims, rows)
        slot_of_row.index_copy_(0, rows, victims.to(torch.int32))
        self.last_use.index_fill_(0, victims, self.tick)
        for kind, column in self.columns.items():
            column.index_copy_(0, victims, values[kind])

    def _take_dirty(self, victims: torch.Tensor, exact: bool = True):
        """(rows, {kind: values}, which to keep) of the slots `victims`,
        marked clean: `exact`, the dirty ones only (one host sync to count
        them; keep: None), or None if none is; else all of them, with a
        device mask of the dirty ones to keep (no host sync: the writer's
        thread picks them, [Note: rows written back by the host] in rows/writer.py)."""
        keep: torch.Tensor | None = self.dirty.index_select(0, victims)
        if exact:
            victims, keep = victims[keep], None
            if victims.numel() == 0:
                return None
        self.dirty.index_fill_(0, victims, False)
        # (in the table's order: the host stores them faster, [Note: rows written back by the host] in rows/writer.py)
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
            slots = self.slot_map().index_select(0, rows).long()
            slots = torch.where(slots >= 0, slots, self.capacity)
        for kind, v in values.items():
            self.columns[kind].index_copy_(0, slots, v)
        if dirty:
            self.dirty.index_fill_(0, slots, True)
            self.any_dirty = True

    def map(self) -> CacheMap:
        return CacheMap(self.slot_map(), self.row_of_slot, self.last_use, self.dirty, self.columns[WEIGHT])

    def slot_map(self) -> torch.Tensor:
        """The row-to-slot map, of a cache with slots."""
        if self.slot_of_row is None:
            raise RuntimeError("pager: a row cache with no slots was asked for its map (a bug in pager)")
        return self.slot_of_row

    def device_bytes(self) -> int:
        if not self.capacity:
            return 0
        return self.map_bytes + self.capacity * _SLOT_BYTES + (self.capacity + 1) * self.row_bytes * len(self.kinds)
