"""The optimizer's step on a row table: the user's optimizer runs on a
temporary Parameter of the rows the gradient touches, with their state rows,
and the new rows are written back ([Note: exact updates of touched rows] in
rows/table.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from .cache import WEIGHT
from .tensors import RowGrad


def step_rows(table, optimizer, group_index: int, run_step) -> None:
    """Update the rows the gradient touches with `optimizer` (its group
    `group_index` holds the table): see [Note: exact updates of touched rows] in rows/table.py."""
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
        if isinstance(value, torch.Tensor) and value.shape == (k, table.shape[1]):
            if key not in table.hosts:
                table.add_state_kind(key, value.dtype, state)
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
            table.add_state_kind(key, value.dtype, state)
        else:
            table.flush()  # (cached rows are forgotten below: their changes must land first)
        with torch.no_grad():
            table.hosts[key].copy_(value)
        state[key] = table.state_views[key]
        table.forget()
