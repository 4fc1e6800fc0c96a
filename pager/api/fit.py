"""Defaults that fit the model: which modules outside the layer stacks
`wrap` pages, unasked, and how, when the user leaves `blocks=` to pager.

[Note: nothing resident by force]
Default discovery finds the layer stacks ([Note: splitting large blocks] and
the rest in model/discover.py); what it leaves outside them (embeddings,
heads, final norms) is the remainder, which stays on the device for life.
For a decoder that is two vocabulary matrices: 2 x 262 MB for a 1B Llama,
x4 in training with their gradients and AdamW state, a fixed 2.1 GB the
budget could never give to anything else. So every module whose own tensors
in the remainder reach LEAST_MOVED_BYTES leaves it, unasked, and becomes a
block of its own, fetched when it is called: the embedding, the head (a
head tied to the embedding is a block that needs the embedding's beside it),
a CNN's classifier. The scheduler then keeps them or streams them like any
layer, by what a pass needs. Blocks keep every semantic of the unpaged
model: dense gradients, the user's optimizer as it is.

What is smaller (norms, a rotary table, a ViT's position embedding on the
root) stays: a use of a block costs the host more than the link needs for
a megabyte, so paging it would cost more than the bytes it frees.

When even then the model does not run (a block with what it needs beside it
larger than the budget: a recommender's table several times the budget),
an embedding table read by lookups only is paged by rows instead ([Note: row
tables] in rows/table.py: only the rows a batch uses come to the device),
the largest first, until it runs (unless the user named tables by `rows=`:
then those alone); that changes what the optimizer sees (a sparse
gradient, lazy updates: `optim.py` says so when it steps), so it is never
chosen where a block runs. Each choice is logged at info level with
the option that asks for it; what still does not run is refused with every
option that would make it.
"""

from __future__ import annotations

import logging

import torch.nn as nn

from ..base.budget import format_bytes
from ..base.common import LEAST_MOVED_BYTES
from ..experts.find import choose as choose_experts
from ..model import discover
from ..rows.find import choose as choose_row_tables
from ..rows.find import row_table_problem
from .pipeline import Needs

log = logging.getLogger("pager")


def default_blocks(model: nn.Module, budget_bytes: int, tables: list, *, rows_allowed: bool, say: bool = True):
    """(row tables, blocks spec) for the model under default discovery, as
    the Note says: the layers, and the remainder's large modules as blocks;
    lookup-only tables by rows where the model does not run otherwise.
    `tables`: those the user named (rows=), outside every block.
    `rows_allowed`: other tables may go by rows (else they stay blocks, and
    a model that does not run is left to the caller to refuse). `say`: log
    each choice (wrap does; a question asked before it does not)."""
    sizing = discover.size_up(model, None, [m for _n, m in tables])
    moved = _remainder_modules(model, sizing)
    if not moved:
        return tables, None
    spec = [m for _n, m in sizing.named] + [m for _n, m, _b in moved]
    by_rows = _rows_that_run(model, budget_bytes, tables, spec, moved) if rows_allowed else []
    if say:
        _say(moved, by_rows)
    rows = {id(m) for _n, m in by_rows}
    return tables + by_rows, [m for m in spec if id(m) not in rows]


def _rows_that_run(model: nn.Module, budget_bytes: int, tables: list, spec: list, moved: list) -> list:
    """The moved lookup-only tables to page by rows, the largest first, until
    the model runs in `budget_bytes`; none where it runs with them as blocks,
    or where it runs either way not."""
    if discover.size_up(model, spec, [m for _n, m in tables]).min_budget <= budget_bytes:
        return []
    by_rows: list = []
    for name, module, _b in moved:
        if row_table_problem(model, module) is None:
            by_rows.append((name, module))
            rest = [m for m in spec if all(m is not t for _n, t in by_rows)]
            if discover.size_up(model, rest, [m for _n, m in tables + by_rows]).min_budget <= budget_bytes:
                return by_rows
    return []


def _say(moved: list, by_rows: list) -> None:
    """Each module that left the remainder, and how, at info level."""
    rows = {id(m) for _n, m in by_rows}
    said: set = set()  # (a weight tied into two modules, T5's `shared` and `encoder.embed_tokens`: said once)
    for name, module, nbytes in moved:
        own = {id(t) for t in module._parameters.values() if t is not None}
        if own and own <= said:
            continue
        said |= own
        if id(module) in rows:
            log.info(
                "pager: the embedding table %r (%s) does not fit the budget as a block; it is paged by rows "
                "(as rows=[%r] asks).",
                name,
                format_bytes(nbytes),
                name,
            )
        else:
            log.info(
                "pager: %r (a %s, %s) pages as a block of its own instead of staying on the device "
                "(blocks= naming the layers alone keeps it there).",
                name,
                type(module).__name__,
                format_bytes(nbytes),
            )


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
        f"raise the budget to {format_bytes(sizing.min_budget, up=True)} or more (with room for two of the largest "
        f"block, {format_bytes(remainder + 2 * largest)}, the next block comes while one computes)"
    ]
    tables: list[str] = []
    others: list[str] = []
    for name, module, _b in _remainder_modules(model, sizing):
        (tables if row_table_problem(model, module) is None else others).append(name)
    tables += [name for name, m in sizing.named if row_table_problem(model, m) is None]  # (tables paged as blocks)
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


def sized(model, budget_bytes, blocks, tables, expert_modules, *, defaults, rows_allowed, say=True):
    """(row tables, sizing, adapter bytes) of `model`: its blocks as `blocks`
    names them, or else, with `defaults`, as [Note: nothing resident by force]
    in api/fit.py chooses them (`rows_allowed`: tables by rows where it does
    not run otherwise; `say`: log each choice). Nothing is changed."""
    spec = blocks
    if blocks is None and defaults:
        tables, spec = default_blocks(model, budget_bytes, tables + expert_modules, rows_allowed=rows_allowed, say=say)
        tables = [t for t in tables if all(t[1] is not m for _n, m in expert_modules)]
    paged_apart = [m for _n, m in tables + expert_modules]
    sizing, adapter_bytes = discover.adapters_resident(discover.size_up(model, spec, paged_apart), budget_bytes)
    return tables, sizing, adapter_bytes


def needs(model: nn.Module, budget_bytes: int) -> Needs:
    """What `model` wrapped with wrap's defaults into a pool of `budget_bytes`
    needs on the device (a pipeline's components, asked before any is
    wrapped). Pages read from files (`pager.load`) place each tensor at its
    file offset's alignment: a few KiB more a model than this says."""
    tables = choose_row_tables(model, None, budget_bytes)
    expert_modules = choose_experts(model, "auto", training_group=False)
    _t, sizing, _a = sized(
        model, budget_bytes, None, tables, expert_modules, defaults=True, rows_allowed=False, say=False
    )
    sizes = sizing.sizes
    largest = max(range(len(sizes)), key=sizes.__getitem__, default=None)
    return Needs(sizing.fixed, sizing.min_budget, None if largest is None else sizing.named[largest][0])
