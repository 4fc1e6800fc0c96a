"""Defaults that fit the model: what `wrap` does, unasked, when the tensors
outside every block (the remainder) keep the model from running in its budget.

[Note: a remainder too large for the budget]
The remainder (embeddings, heads, final norms) stays on the device for life.
When it, with the largest block beside it, does not fit the budget and the
user left `blocks=` and `rows=` to pager, its largest modules leave it, the
largest first, until the model runs: an embedding table read by lookups
only is paged by rows ([Note: row tables] in rows/table.py: only the rows a
batch uses come to the device); any other module (a head, an embedding tied
to a head) becomes a block of its own, fetched when it is called. Each
choice is logged at info level, with the option that asks for it. What
still does not fit is refused with every option that would make it run.
"""

from __future__ import annotations

import logging

import torch.nn as nn

from ..base.budget import format_bytes
from ..model import discover
from ..rows.table import row_table_problem

log = logging.getLogger("pager")

LEAST_MOVED_BYTES = 1 << 20  # a remainder module smaller than this stays (it would not make room)


def fit_remainder(model: nn.Module, budget_bytes: int, tables: list, *, rows_allowed: bool):
    """(row tables, blocks spec) with which the model runs in `budget_bytes`,
    taking modules out of the remainder as the Note says; (tables, None)
    when it runs as it is, or when no such choice makes it run (the caller
    refuses it then). `rows_allowed`: embedding tables may go by rows (else
    they become blocks)."""
    sizing = discover.size_up(model, None, [m for _n, m in tables])
    if sizing.min_budget <= budget_bytes:
        return tables, None
    base = [m for _n, m in sizing.named]
    extra, by_rows, said = [], [], []
    for name, module, nbytes in _remainder_modules(model, sizing):
        if rows_allowed and row_table_problem(model, module) is None:
            by_rows.append((name, module))
            said.append(
                (
                    "pager: the embedding table %r (%s) does not fit the budget beside the blocks; it is "
                    "paged by rows (as rows=[%r] asks; rows=[] keeps it whole).",
                    name,
                    format_bytes(nbytes),
                    name,
                )
            )
        else:
            extra.append(module)
            said.append(
                (
                    "pager: %r (a %s, %s) does not fit the budget beside the blocks as part of the resident "
                    "remainder; it is a block of its own (as blocks= naming it asks).",
                    name,
                    type(module).__name__,
                    format_bytes(nbytes),
                )
            )
        sizing = discover.size_up(model, base + extra, [m for _n, m in tables + by_rows])
        if sizing.min_budget <= budget_bytes:
            for args in said:
                log.info(*args)
            return tables + by_rows, (base + extra if extra else None)
    return tables, None


def _remainder_modules(model: nn.Module, sizing) -> list:
    """(name, module, bytes) of the modules whose own tensors are in the
    remainder, the largest first, those of LEAST_MOVED_BYTES or more."""
    remainder = {id(t) for _n, t, _p in sizing.owned.get(None, [])}
    out = []
    for name, m in model.named_modules():
        if m is model:
            continue
        own = [t for t in m._parameters.values() if t is not None and id(t) in remainder]
        nbytes = sum(discover.aligned_bytes(t) for t in own)
        if nbytes >= LEAST_MOVED_BYTES:
            out.append((name, m, nbytes))
    return sorted(out, key=lambda r: -r[2])


def too_large_message(budget, budget_bytes: int, sizing, model: nn.Module) -> str:
    """Why the model cannot run in the budget, and every option that would make it."""
    remainder, sizes = sizing.remainder, sizing.sizes
    largest = max(sizes, default=0)
    options = [
        f"raise the budget to {format_bytes(sizing.min_budget)} or more (with room for two of the largest "
        f"block, {format_bytes(remainder + 2 * largest)}, the next block comes while one computes)"
    ]
    tables, others = [], []
    for name, module, _b in _remainder_modules(model, sizing):
        (tables if row_table_problem(model, module) is None else others).append(name)
    if tables:
        options.append(f"page embedding tables by rows (rows={tables[:4]!r})")
    if others:
        options.append(f"make large modules of the remainder blocks (blocks= naming {others[:4]!r} beside the layers)")
    if largest:
        options.append("split the largest block (blocks= with smaller modules)")
    if remainder > budget_bytes:
        what = f"the tensors outside every block (the remainder: embeddings, heads, norms; {format_bytes(remainder)})"
    else:
        name = sizing.named[max(range(len(sizes)), key=sizes.__getitem__)][0]
        what = (
            f"block {name!r} ({format_bytes(largest)}) with the resident remainder beside it "
            f"({format_bytes(remainder)})"
        )
    return (
        f"pager: {what} does not fit budget={budget!r} ({format_bytes(budget_bytes)}). To run: "
        + "; or ".join(options)
        + "."
    )
