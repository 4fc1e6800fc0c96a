"""The row path's device work in few launches: numbering a batch's lookups,
touching and placing rows in a row cache, reading marked rows of a mapped
host table.

[Note: few launches on the row path]
A training step with a row table is often bound by the host: each torch
operation the row path queues costs the host some 10-40 microseconds, and
the model's own step may take little more than a millisecond of device time.
So the row path's work on the device is a few Triton kernels, each doing what
a dozen torch operations did:

- `number_lookups`: after one sort, two passes over the sorted lookups, a
  block of them a program (the first counts each block's unique rows, the
  second numbers a block's rows after those the blocks before it counted),
  write for each unique row its place among them (`rows`), whether the cache
  lacks it (`need`), its rank among those lacking (`rank`), whether a
  write-back of it may still be running (`stale`), and, for each lookup, its
  row's place (`inverse`); then the counts the host needs (`facts`).
- `touch_hits`: the slots of the rows the cache holds take this tick.
- `place_rows`: one program a unique row: a row the cache holds is copied
  from its slot; a row it lacks takes the victim slot of its rank (after
  the victim's row is copied out, with its dirty flag, for the write-back),
  gets its values there, and is copied to the batch.
- `read_where`: the rows of a mapped host table where a mask is set.

Without Triton (the CPU device, or a torch without it) each is torch
operations that give the same result, bit for bit; on CUDA those sync the
host where they compact (`nonzero`).

A slot's row that leaves the cache dirty gets, in `slot_of_row`, the mark of
the write-back that takes it to the host table (`mark_of(generation)`: -2
and below) instead of -1 (not cached). Every reader of the map asks `< 0`
for "not cached", so a mark is a miss like -1; the read ahead asks, in
`number_lookups`, which of the rows it reads carry the mark of a write-back
still in flight (`stale_below`): those it may read before their new values
land, so the prepared lookup reads them again once those writes are done
([Note: rows read ahead] in rows/reader.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch, or no Triton: torch operations
    triton = None

NO_STALE = -(2**31)  # `stale_below` when no write-back is in flight: no map entry is that low
GENERATIONS = 2**30  # write-back marks in use before they are cleared (`RowTable._next_mark`)
_NUMBER_BLOCK = 2048
_NUMBER_BLOCKS = 4096  # programs of a numbering pass, at most
_TOUCH_BLOCK = 1024
_READ_ROWS = 8  # rows a read-ahead program reads at a time


def mark_of(generation: int) -> int:
    """The `slot_of_row` entry of a row written back by write-back `generation`."""
    return -2 - generation


def _sm_count(device: torch.device) -> int:
    # (torch keeps the properties; none on the CPU: Triton's interpreter)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def uses_kernels(t: torch.Tensor) -> bool:
    return triton is not None and t.device.type == "cuda"


class Lookups(NamedTuple):
    """A batch's lookups numbered by their unique rows (`number_lookups`), on the device.

    rows: the unique rows, sorted (clamped to the table), then `n_rows` (a
    sentinel) up to the number of lookups. need: which of `rows` the cache
    lacks. rank: for those, their rank among them (row order). stale: which
    of those carry the mark of a write-back still in flight. inverse: each
    lookup's position among the unique rows, in the lookups' order (flat).
    missing: the rows the cache lacks, in rank order (the first `facts[3]`).
    facts: int64 [6]: the lowest lookup, the highest, unique rows - 1, how
    many the cache lacks, the padding row's position among them or -1, how
    many of those are stale.
    """

    rows: torch.Tensor
    need: torch.Tensor
    rank: torch.Tensor
    stale: torch.Tensor
    inverse: torch.Tensor
    missing: torch.Tensor
    facts: torch.Tensor


def number_lookups(
    indices: torch.Tensor, n_rows: int, slot_of_row, pad, device, stale_below: int = NO_STALE
) -> Lookups:
    """`indices` (at least one lookup) numbered by their unique rows, with no
    host sync (every count stays on the device, in `facts`). The numbering is
    monotone: row r is the r-th smallest ([Note: row tables] in rows/table.py).

    Args:
        n_rows: the table's rows.
        slot_of_row: the cache's map (None: no cache, every row lacking).
        pad: the padding row (non-negative) or None.
        stale_below: rows whose map entry is at most this are stale.
    """
    flat = indices.to(device, torch.long).flatten()
    n = flat.numel()
    ordered, order = torch.sort(flat)
    if uses_kernels(ordered):
        rows, rank, inverse, missing = (torch.empty(n, dtype=torch.long, device=device) for _ in range(4))
        need, stale = (torch.empty(n, dtype=torch.bool, device=device) for _ in range(2))
        facts = torch.empty(6, dtype=torch.long, device=device)
        block = _NUMBER_BLOCK
        while triton.cdiv(n, block) > _NUMBER_BLOCKS:  # (each program sums the counts of every block)
            block *= 2
        blocks = triton.cdiv(n, block)
        counts = torch.empty(blocks, 3, dtype=torch.long, device=device)
        cache = ordered if slot_of_row is None else slot_of_row
        flags = dict(HAS_CACHE=slot_of_row is not None, BLOCK=block)
        # Two passes over the sorted lookups, a block a program: each block's
        # counts, then each block's writes at the offsets the blocks before it counted.
        _count_kernel[(blocks,)](ordered, cache, counts, facts, n, n_rows, stale_below, **flags)
        _number_kernel[(blocks,)](
            ordered,
            order,
            cache,
            counts,
            rows,
            need.view(torch.uint8),
            rank,
            stale.view(torch.uint8),
            inverse,
            missing,
            facts,
            n,
            n_rows,
            -1 if pad is None else pad,
            stale_below,
            blocks,
            HAS_PAD=pad is not None,
            COUNTS=triton.next_power_of_2(blocks),
            **flags,
        )
        return Lookups(rows, need, rank, stale, inverse, missing, facts)
    first = torch.ones(n, dtype=torch.bool, device=device)  # the first lookup of each row
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])
    position = torch.cumsum(first, 0) - 1
    # (rows out of the table are clamped here only: who takes `facts` checks the range)
    rows = torch.full((n,), n_rows, dtype=torch.long, device=device)
    rows.scatter_(0, position, ordered.clamp(0, n_rows - 1))
    need = torch.arange(n, device=device) <= position[-1:]
    stale = torch.zeros(n, dtype=torch.bool, device=device)
    if slot_of_row is not None:
        slot = slot_of_row.index_select(0, rows)
        need &= slot < 0
        stale = need & (slot <= stale_below)
    rank = torch.cumsum(need, 0) - 1
    missing = torch.full((n,), n_rows, dtype=torch.long, device=device)
    missing.scatter_(0, torch.where(need, rank, n - 1), torch.where(need, rows, missing[-1]))
    inverse = torch.empty_like(position).scatter_(0, order, position)
    # (every fact a tensor on the device: a Python number put into one would sync)
    pad_at = torch.full((), -1, dtype=torch.long, device=device)
    if pad is not None:
        at = torch.searchsorted(ordered, torch.full((1,), pad, device=device)).clamp_(max=n - 1)
        pad_at = torch.where(ordered[at] == pad, position[at], -1)[0]
    facts = torch.stack([ordered[0], ordered[-1], position[-1], need.sum(), pad_at, stale.sum()])
    return Lookups(rows, need, rank, stale, inverse, missing, facts)


def touch_hits(lookups: Lookups, u: int, slot_of_row: torch.Tensor, last_use: torch.Tensor, tick: int) -> None:
    """The slots of the first `u` rows of `lookups` that the cache holds take `tick` (their last use)."""
    if not u:
        return
    if uses_kernels(last_use):
        _touch_kernel[(triton.cdiv(u, _TOUCH_BLOCK),)](
            lookups.rows, lookups.need.view(torch.uint8), slot_of_row, last_use, u, tick, BLOCK=_TOUCH_BLOCK
        )
        return
    held = lookups.rows[:u][~lookups.need[:u]]
    last_use.index_fill_(0, slot_of_row.index_select(0, held).long(), tick)


class CacheMap(NamedTuple):
    """A row cache's bookkeeping and weight column (`RowCache`'s tensors)."""

    slot_of_row: torch.Tensor  # int32 [n_rows + 1]: a row's slot, -1 or a mark if none
    row_of_slot: torch.Tensor  # int64 [capacity]
    last_use: torch.Tensor  # int64 [capacity]
    dirty: torch.Tensor  # bool [capacity + 1]
    column: torch.Tensor  # [capacity + 1, dim]: the weight's rows


def place_rows(
    lookups: Lookups,
    u: int,
    values: torch.Tensor,
    by_rank: bool,
    cache: CacheMap,
    victims: torch.Tensor,
    tick: int,
    mark: int,
    take_out: bool,
):
    """The first `u` rows of `lookups` into a batch tensor [u, dim], each row
    the cache lacks put in the slot `victims[rank]` with its values (every
    such row has one: the caller made room for them all).

    Args:
        values: the lacking rows' values: `values[rank]` if `by_rank`, else
            `values[position]`.
        tick: the placed slots' last use.
        mark: what `slot_of_row` of a dirty victim's row becomes (-1, or a
            write-back's mark); a clean one's becomes -1.
        take_out: copy the victims' rows and weight values out first (the
            cache holds changed rows).

    Returns (the batch, each row's slot [u], and if `take_out` the victims'
    (rows, dirty flags, weight values) in victim order, else None).
    """
    dim, device = values.shape[1], values.device
    out = torch.empty(u, dim, dtype=cache.column.dtype, device=device)
    slots = torch.empty(u, dtype=torch.long, device=device)
    m = victims.numel()
    taken = (
        (
            torch.empty(m, dtype=torch.long, device=device),
            torch.empty(m, dtype=torch.bool, device=device),
            torch.empty(m, dim, dtype=cache.column.dtype, device=device),
        )
        if take_out
        else None
    )
    if not u:
        return out, slots, taken
    if uses_kernels(out):
        ev_rows, ev_keep, ev_values = taken if taken is not None else (slots, slots, out)  # (unused unless take_out)
        _place_kernel[(u,)](
            lookups.rows,
            lookups.need.view(torch.uint8),
            lookups.rank,
            values,
            victims,
            cache.slot_of_row,
            cache.row_of_slot,
            cache.last_use,
            cache.dirty.view(torch.uint8),
            cache.column,
            out,
            slots,
            ev_rows,
            ev_keep.view(torch.uint8),
            ev_values,
            tick,
            mark,
            dim,
            BY_RANK=by_rank,
            TAKE_OUT=take_out,
            BLOCK=triton.next_power_of_2(dim),
        )
        return out, slots, taken
    need = lookups.need[:u]
    slots.copy_(cache.slot_of_row.index_select(0, lookups.rows[:u]))
    at = need.nonzero().squeeze(1)  # (in rank order; a host sync on CUDA: without Triton)
    old = cache.row_of_slot.index_select(0, victims)
    if taken is not None:
        keep = cache.dirty.index_select(0, victims)
        taken[0].copy_(old), taken[1].copy_(keep), taken[2].copy_(cache.column.index_select(0, victims))
        gone = torch.where(keep, mark, -1).to(torch.int32)
        cache.slot_of_row.index_put_((old,), gone)
    else:
        cache.slot_of_row.index_fill_(0, old, -1)
    new = lookups.rows.index_select(0, at)
    cache.row_of_slot.index_copy_(0, victims, new)
    cache.slot_of_row.index_copy_(0, new, victims.to(torch.int32))
    cache.last_use.index_fill_(0, victims, tick)
    cache.dirty.index_fill_(0, victims, False)
    cache.column.index_copy_(0, victims, values.index_select(0, lookups.rank.index_select(0, at) if by_rank else at))
    slots.index_copy_(0, at, victims)
    torch.index_select(cache.column, 0, slots, out=out)
    return out, slots, taken


def patch_written(
    values: torch.Tensor,
    rows: torch.Tensor,
    written_rows: torch.Tensor,
    written: torch.Tensor,
    which: torch.Tensor | None = None,
) -> None:
    """Where `rows[i]` (and `which[i]`, if given) is among `written_rows`
    (sorted), `values[i]` becomes that row of `written` (a write-back's copy
    of the rows it takes to the host table): in place, no host sync."""
    n, w = rows.numel(), written_rows.numel()
    if not n or not w:
        return
    if uses_kernels(values):
        _patch_kernel[(n,)](
            values,
            rows,
            rows if which is None else which.view(torch.uint8),
            written_rows,
            written,
            w,
            values.shape[1],
            HAS_WHICH=which is not None,
            STEPS=w.bit_length(),
            BLOCK=triton.next_power_of_2(values.shape[1]),
        )
        return
    at = torch.searchsorted(written_rows, rows).clamp_(max=w - 1)
    found = written_rows.index_select(0, at) == rows
    if which is not None:
        found &= which
    values.copy_(torch.where(found[:, None], written.index_select(0, at), values))


def read_where(view: torch.Tensor, rows: torch.Tensor, need: torch.Tensor, out: torch.Tensor | None = None):
    """[len(rows), dim]: row `rows[i]` of `view` where `need[i]`, the others
    as `out` holds them (None: unread and undefined). On CUDA a kernel reads
    the rows where `need`, with no host sync and no bytes over the link for
    the others."""
    if out is None:
        out = torch.empty(rows.numel(), view.shape[1], dtype=view.dtype, device=rows.device)
    if uses_kernels(rows):
        n = rows.numel()
        if n:
            # A quarter of the SMs, each program reading _READ_ROWS rows at a
            # time: near the link's rate (measured: 44 of 48 GB/s from a 4 GB
            # table), and the other SMs left to compute, which the read ahead
            # runs beside. One program a row held every SM while the link
            # answered: on the H100 a step with 4096-wide layers took 0.5 ms
            # longer with a 4 GB table, 1.8 ms with a 40 GB one (RESULTS).
            programs = min(triton.cdiv(n, _READ_ROWS), max(8, _sm_count(rows.device) // 4))
            _read_where_kernel[(programs,)](
                view,
                rows,
                need.view(torch.uint8),
                out,
                n,
                view.shape[1],
                programs,
                ROWS=_READ_ROWS,
                BLOCK=triton.next_power_of_2(view.shape[1]),
            )
        return out
    at = need.nonzero().squeeze(1)  # (a host sync on CUDA: without Triton)
    out.index_copy_(0, at, view.index_select(0, rows.index_select(0, at)))
    return out


if triton is not None:

    @triton.jit
    def _flags(ordered, slot_of_row, j, n, n_rows, stale_below, HAS_CACHE: tl.constexpr):
        # For the sorted lookups `j`: (their values, which are their row's
        # first, which of those the cache lacks, which of those are stale,
        # the rows clamped to the table).
        inside = j < n
        value = tl.load(ordered + j, mask=inside, other=0)
        before = tl.load(ordered + j - 1, mask=inside & (j > 0), other=0)
        first = inside & ((j == 0) | (value != before))
        row = tl.minimum(tl.maximum(value, 0), n_rows - 1)
        if HAS_CACHE:
            slot = tl.load(slot_of_row + row, mask=first, other=0)
            lacks = first & (slot < 0)
            old = lacks & (slot <= stale_below)
        else:
            lacks = first
            old = first & (row < 0)
        return value, first, lacks, old, row

    @triton.jit(do_not_specialize=["n", "n_rows", "stale_below"])
    def _count_kernel(
        ordered, slot_of_row, counts, facts, n, n_rows, stale_below, HAS_CACHE: tl.constexpr, BLOCK: tl.constexpr
    ):
        # A block's unique rows, those the cache lacks, and those stale.
        b = tl.program_id(0).to(tl.int64)
        j = b * BLOCK + tl.arange(0, BLOCK)
        _value, first, lacks, old, _row = _flags(ordered, slot_of_row, j, n, n_rows, stale_below, HAS_CACHE)
        tl.store(counts + b * 3, tl.sum(first.to(tl.int64), 0))
        tl.store(counts + b * 3 + 1, tl.sum(lacks.to(tl.int64), 0))
        tl.store(counts + b * 3 + 2, tl.sum(old.to(tl.int64), 0))
        if b == 0:
            tl.store(facts + 4, tl.full([], -1, tl.int64))  # (the padding row's place, if any, comes next pass)

    @triton.jit(do_not_specialize=["n", "n_rows", "pad", "stale_below", "blocks"])
    def _number_kernel(
        ordered,
        order,
        slot_of_row,
        counts,
        rows,
        need,
        rank,
        stale,
        inverse,
        missing,
        facts,
        n,
        n_rows,
        pad,
        stale_below,
        blocks,
        HAS_CACHE: tl.constexpr,
        HAS_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        COUNTS: tl.constexpr,
    ):
        # A block's writes, numbered after the blocks before it (their counts summed here).
        b = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, COUNTS)
        before = k < b
        every = k < blocks
        n_first = tl.load(counts + k * 3, mask=every, other=0)
        n_lacks = tl.load(counts + k * 3 + 1, mask=every, other=0)
        n_old = tl.load(counts + k * 3 + 2, mask=every, other=0)
        unique = tl.sum(tl.where(before, n_first, 0), 0)
        lacking = tl.sum(tl.where(before, n_lacks, 0), 0)
        all_unique, all_lacking = tl.sum(n_first, 0), tl.sum(n_lacks, 0)
        j = b * BLOCK + tl.arange(0, BLOCK)
        inside = j < n
        value, first, lacks, old, row = _flags(ordered, slot_of_row, j, n, n_rows, stale_below, HAS_CACHE)
        position = unique + tl.cumsum(first.to(tl.int64), 0) - 1
        tl.store(inverse + tl.load(order + j, mask=inside, other=0), position, mask=inside)
        taken = lacking + tl.cumsum(lacks.to(tl.int64), 0) - 1
        tl.store(rows + position, row, mask=first)
        tl.store(need + position, lacks.to(tl.uint8), mask=first)
        tl.store(stale + position, old.to(tl.uint8), mask=first)
        tl.store(rank + position, taken, mask=lacks)
        tl.store(missing + taken, row, mask=lacks)
        if HAS_PAD:
            tl.atomic_max(facts + 4 + tl.zeros_like(j), position, mask=first & (value == pad))
        # Past the unique rows: the sentinel, not needed.
        tail = inside & (j >= all_unique)
        tl.store(rows + j, tl.zeros_like(j) + n_rows, mask=tail)
        tl.store(need + j, tl.zeros_like(j).to(tl.uint8), mask=tail)
        tl.store(stale + j, tl.zeros_like(j).to(tl.uint8), mask=tail)
        tl.store(missing + j, tl.zeros_like(j) + n_rows, mask=inside & (j >= all_lacking))
        if b == 0:
            tl.store(facts, tl.load(ordered))
            tl.store(facts + 1, tl.load(ordered + n - 1))
            tl.store(facts + 2, all_unique - 1)
            tl.store(facts + 3, all_lacking)
            tl.store(facts + 5, tl.sum(n_old, 0))

    @triton.jit(do_not_specialize=["u", "tick"])
    def _touch_kernel(rows, need, slot_of_row, last_use, u, tick, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        held = (i < u) & (tl.load(need + i, mask=i < u, other=1) == 0)
        slot = tl.load(slot_of_row + tl.load(rows + i, mask=held, other=0), mask=held, other=0)
        tl.store(last_use + slot, tl.zeros_like(i).to(tl.int64) + tick, mask=held)

    @triton.jit(do_not_specialize=["tick", "mark", "dim"])
    def _place_kernel(
        rows,
        need,
        rank,
        values,
        victims,
        slot_of_row,
        row_of_slot,
        last_use,
        dirty,
        column,
        out,
        slots,
        ev_rows,
        ev_keep,
        ev_values,
        tick,
        mark,
        dim,
        BY_RANK: tl.constexpr,
        TAKE_OUT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program a unique row. A victim's old row is none of the batch's
        # (victims hold no row this tick touched), so the programs' stores
        # into the map never meet.
        i = tl.program_id(0).to(tl.int64)
        row = tl.load(rows + i)
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        if tl.load(need + i) == 0:
            slot = tl.load(slot_of_row + row).to(tl.int64)
            tl.store(out + i * dim + cols, tl.load(column + slot * dim + cols, mask=inside), mask=inside)
            tl.store(slots + i, slot)
        else:
            k = tl.load(rank + i)
            victim = tl.load(victims + k)
            old = tl.load(row_of_slot + victim)
            gone = tl.full([], -1, tl.int32)
            if TAKE_OUT:
                changed = tl.load(dirty + victim)
                tl.store(ev_rows + k, old)
                tl.store(ev_keep + k, changed)
                tl.store(ev_values + k * dim + cols, tl.load(column + victim * dim + cols, mask=inside), mask=inside)
                gone = tl.where(changed != 0, mark, -1).to(tl.int32)
            tl.store(slot_of_row + old, gone)
            tl.store(row_of_slot + victim, row)
            tl.store(slot_of_row + row, victim.to(tl.int32))
            tl.store(last_use + victim, tick.to(tl.int64))
            tl.store(dirty + victim, tl.zeros([], tl.uint8))
            at = k if BY_RANK else i
            value = tl.load(values + at * dim + cols, mask=inside)
            tl.store(column + victim * dim + cols, value, mask=inside)
            tl.store(out + i * dim + cols, value, mask=inside)
            tl.store(slots + i, victim)

    @triton.jit(do_not_specialize=["w", "dim"])
    def _patch_kernel(
        values,
        rows,
        which,
        written_rows,
        written,
        w,
        dim,
        HAS_WHICH: tl.constexpr,
        STEPS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program a row: a binary search of the written rows (STEPS halvings find the first >= row).
        i = tl.program_id(0).to(tl.int64)
        wanted = tl.full([], 1, tl.int1)
        if HAS_WHICH:
            wanted = tl.load(which + i) != 0
        if wanted:
            row = tl.load(rows + i)
            low = tl.full([], 0, tl.int64)
            high = tl.full([], 0, tl.int64) + w
            for _ in tl.static_range(STEPS):
                mid = (low + high) // 2
                below = tl.load(written_rows + tl.minimum(mid, w - 1)) < row
                active = low < high
                low = tl.where(active & below, mid + 1, low)
                high = tl.where(active & ~below, mid, high)
            at = tl.minimum(low, w - 1)
            if tl.load(written_rows + at) == row:
                cols = tl.arange(0, BLOCK)
                inside = cols < dim
                tl.store(values + i * dim + cols, tl.load(written + at * dim + cols, mask=inside), mask=inside)

    @triton.jit(do_not_specialize=["n", "dim", "programs"])
    def _read_where_kernel(src, rows, need, out, n, dim, programs, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # Each program ROWS rows at a time, every `programs`-th group.
        cols = tl.arange(0, BLOCK)
        for start in range(tl.program_id(0) * ROWS, n, programs * ROWS):
            i = start + tl.arange(0, ROWS)
            wanted = (i < n) & (tl.load(need + i, mask=i < n, other=0) != 0)
            row = tl.load(rows + i, mask=wanted, other=0)  # (int64: offsets in a table past 2**31 elements)
            inside = wanted[:, None] & (cols[None, :] < dim)
            values = tl.load(src + row[:, None] * dim + cols[None, :], mask=inside)
            tl.store(out + i.to(tl.int64)[:, None] * dim + cols[None, :], values, mask=inside)
