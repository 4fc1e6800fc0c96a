"""What pager asks of a user's optimizer where it updates a view of a
parameter (a row table's rows, a table of experts' rows): the step on that
view alone, and whether the optimizer's update of rows with a zero gradient
is none (an update by rows is then the dense one)."""

from __future__ import annotations

import torch.nn as nn


def run_narrowed(param: nn.Parameter, optimizer, group_index: int, run_step) -> None:
    """`run_step(optimizer)` with its group `group_index` narrowed to `param`
    (the others to nothing), the groups given back however it ends."""
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    try:
        for i, g in enumerate(groups):
            g["params"] = [param] if i == group_index else []
        run_step(optimizer)
    finally:
        for g, params in zip(groups, saved):
            g["params"] = params


def dense_on_rows(optimizer, group) -> bool:
    """Whether `optimizer` leaves rows with a zero gradient unchanged (its
    row-by-row update is then the dense one)."""
    name, decay = type(optimizer).__name__, group.get("weight_decay", 0)
    if name == "SparseAdam":
        return True
    if name == "Adagrad":
        return not decay
    if name == "SGD":
        return not decay and not group.get("momentum", 0)
    return False
