"""The optimizer's step on a row table: the user's optimizer runs on a
temporary Parameter of the rows the gradient touches, with their state rows,
and the new rows are written back.

[Note: exact updates of touched rows]
`opt.step()` (through the pager's step pre-hook, `training/optim.py`) updates a row
table with the user's own optimizer, on a view of the rows the gradient
touches: a temporary Parameter holding those rows (from the cache or the host
table), the gradient renumbered to them, and the state rows of each state
tensor of the table's shape, gathered the same way (scalars such as Adam's
`step` are the table's own). The optimizer's step runs on that view alone,
with the group's options as they are, and the rows (and state rows) are then
the table's (see [Note: write-back of cached rows] in rows/writes.py for where they go).
torch.optim's updates are per element, so for every row the gradient
touches the result is the optimizer's on the whole table; rows it does not
touch are not updated. That is the dense result for SGD without
momentum or weight decay, Adagrad and `SparseAdam` (whose updates leave such
rows unchanged); for SGD with momentum, Adam, AdamW, RMSprop and the others it
is the lazy variant (as `SparseAdam` is of Adam): untouched rows keep their
values and their state rows, which start at zero.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..base.optimizers import run_narrowed
from .cache import WEIGHT
from .tensors import RowGrad, RowStateTensor, host_view
from .writer import host_alias


def step_rows(table, optimizer, group_index: int, run_step) -> None:
    """Update the rows the gradient touches with `optimizer` (its group
    `group_index` holds the table): see [Note: exact updates of touched rows]."""
    table._check_current()
    g, held, table._rows_held = table.param.grad, table._rows_held, None
    placed, table._placed = table._placed, None
    taken = take_grad(table)
    if taken is None:
        return
    rows, grad = taken
    state = optimizer.state[table.param]
    adopt_state(table, state)
    row_kinds = tuple(k for k in table.hosts if k != WEIGHT)
    cache, slots = table.cache, None
    if placed is not None and rows is placed.rows and placed.epoch == cache.epoch:
        # The gradient is the last lookup's, over its rows, which are
        # where it put them and as it gave them (its batch tensor): any
        # write to the table since would have moved the cache's epoch
        # (`_check_current` forgets the cache for writes from outside).
        slots = placed.slots
        gathered = {WEIGHT: placed.batch.detach(), **{k: cache.columns[k].index_select(0, slots) for k in row_kinds}}
        uncached = slots[:0]
    else:
        # The gradient's rows are among those looked up since the last step:
        # if the cache held them all then and holds the same rows now, every
        # one is a hit, and no host sync counts the misses.
        all_held = (
            held is not None and held is not False and held == cache.epoch and isinstance(g, RowGrad) and g.made is None
        )
        gathered, uncached = table.gather(rows, (WEIGHT,) + row_kinds, n_miss=0 if all_held else None)
    epoch = cache.epoch
    view = nn.Parameter(gathered[WEIGHT])
    view.grad = grad
    optimizer.state[view] = {k: (gathered[k] if k in row_kinds else v) for k, v in state.items()}
    try:
        run_narrowed(view, optimizer, group_index, run_step)
    finally:
        new_state = optimizer.state.pop(view, {})
    k = rows.numel()
    values = {WEIGHT: view.detach()}
    for key, value in new_state.items():
        if isinstance(value, torch.Tensor) and value.shape == (k, table.shape[1]):
            if key not in table.hosts:
                add_state_kind(table, key, value.dtype, state)
                uncached = torch.arange(k, device=table.device)  # (the cache was emptied for the new column)
            values[key] = value.to_dense() if value.is_sparse else value
        else:
            state[key] = value
    table.write(rows, values, uncached, slots if cache.epoch == epoch else None)


def take_grad(table):
    """(rows, gradient of those rows on the device) for the update, or None."""
    g = table.param.grad
    if g is None:
        return None
    sparse = bool(table.module.sparse)
    if isinstance(g, RowGrad) and g.made is None:
        return g.rows_and_grad()
    if isinstance(g, RowGrad):
        g = g.made
    if not g.is_sparse:
        raise ValueError(
            f"pager: the gradient of row table {table.name!r} is a dense {tuple(g.shape)} tensor; a row table "
            f"takes a sparse COO gradient (as autograd gives it): assign one, e.g. dense.to_sparse()."
        )
    g = g.coalesce()
    rows = g._indices()[0].to(table.device)
    values = g._values().to(table.device)
    if not sparse:
        return rows, values
    k = rows.numel()
    slots = torch.arange(k, device=table.device)[None]
    return rows, torch.sparse_coo_tensor(slots, values, (k, table.shape[1]), is_coalesced=True)


def adopt_state(table, state: dict) -> None:
    """Take state tensors of the table's shape into host tables: ones the
    optimizer made at construction (Adagrad's sum), or put there by
    `load_state_dict`."""
    for key, value in list(state.items()):
        if not isinstance(value, torch.Tensor) or value.shape != table.shape or table.state_views.get(key) is value:
            continue
        if key not in table.hosts:
            add_state_kind(table, key, value.dtype, state)
        else:
            table.flush()  # (cached rows are forgotten below: their changes must land first)
        with torch.no_grad():
            table.hosts[key].copy_(value)
        state[key] = table.state_views[key]
        table.forget()


def add_state_kind(table, key: str, dtype: torch.dtype, state: dict) -> None:
    """A host table (and a cache column) of `table` for optimizer state
    `key`, which `state` then holds."""
    table.flush()  # (the cache is emptied to make room for the new column)
    zeros = torch.zeros((), dtype=dtype).expand(table.shape)
    # (a copy, in the arena)
    host, _registered = table.pager.arena.host_table(zeros, False, f"row table {table.name!r}")
    table.hosts[key] = host
    table.host_aliases[key] = host_alias(host)
    table.views[key] = host_view(host, table.device)
    table.readers[key] = table.reader_of(host, table.views[key])
    table.state_views[key] = state[key] = RowStateTensor.of(host, table)
    table.cache.shape_columns(tuple(table.hosts))
