"""Which embedding modules of a model are row tables (`wrap(..., rows=)`),
and why one cannot be ([Note: row tables] in rows/table.py)."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn as nn

from ..base.wrappers import is_wrapper


def choose(model: nn.Module, spec, budget_bytes: int) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) of each table `wrap(..., rows=spec)` names.

    Args:
        spec: None (none), "auto" (every plain Embedding / EmbeddingBag whose
            weight is larger than a quarter of the budget), or a list of
            modules or qualified names.
    """
    if spec is None:
        return []
    named = list(model.named_modules())
    if spec == "auto":
        found = [
            (n, m)
            for n, m in named
            if _is_table(m)
            and not is_wrapper(m.weight)
            and m.weight.numel() * m.weight.element_size() > budget_bytes // 4
        ]
    elif isinstance(spec, (list, tuple)):
        by_name = dict(named)
        by_id = {id(m): n for n, m in named}
        found = []
        for item in spec:
            if isinstance(item, str):
                if item not in by_name:
                    raise ValueError(
                        f"pager: rows= names {item!r}, which is not a submodule of the model; give "
                        f"qualified names from model.named_modules() (or the modules themselves)."
                    )
                found.append((item, by_name[item]))
            elif isinstance(item, nn.Module) and id(item) in by_id:
                found.append((by_id[id(item)], item))
            else:
                raise ValueError(
                    f"pager: rows= holds {item!r}, which is not a submodule of the model; pass "
                    f"modules taken from the model or their qualified names."
                )
    else:
        raise ValueError(
            f'pager: rows={spec!r} must be None, "auto" or a list of nn.Embedding / '
            f"nn.EmbeddingBag modules (or their qualified names)."
        )
    for name, m in found:
        _check_table(model, name, m)
    return found


def _is_table(m: nn.Module) -> bool:
    return isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and type(m).forward in (
        nn.Embedding.forward,
        nn.EmbeddingBag.forward,
    )


def _check_table(model: nn.Module, name: str, m: nn.Module) -> None:
    problem = row_table_problem(model, m)
    if problem is not None:
        raise ValueError(f"pager: rows= names {name!r}, {problem}.")


def row_table_problem(model: nn.Module, m: nn.Module) -> str | None:
    """Why `m` cannot be paged by rows (None: it can)."""
    if not _is_table(m):
        return (
            f"a {type(m).__name__}; row paging takes nn.Embedding and nn.EmbeddingBag modules whose forward "
            f"is torch's own"
        )
    w = cast(torch.Tensor, m.weight)
    if is_wrapper(w):
        return (
            f"whose weight is a quantized {type(w).__qualname__}; row tables page plain matrices. Leave it "
            f"out of rows= (its blocks stream it whole)"
        )
    if w.dim() != 2 or not w.is_contiguous():
        return (
            f"whose weight of shape {tuple(w.shape)} is not a contiguous matrix; make it one "
            f"(weight.data = weight.data.contiguous())"
        )
    holders = [
        n for n, other in model.named_modules() if other is not m and any(t is w for t in other._parameters.values())
    ]
    if holders:
        return (
            f"which shares its weight with {holders[0]!r} (tied weights); a row table is read by lookups "
            f"only. Leave it out of rows="
        )
    return None


def find_row_table(tables: list, table):
    """The one of `tables` (`RowTable`s) that `table` names: its module, its weight or its qualified name."""
    for t in tables:
        if table is t.module or table is t.param or (isinstance(table, str) and table == t.name):
            return t
    names = [t.name for t in tables]
    what = repr(table) if isinstance(table, str) else f"a {type(table).__name__}"
    raise ValueError(
        f"pager: {what} is not a row table of this model (its row tables: {names}); pass the "
        f"module, its qualified name or its weight, of a table named by wrap(..., rows=...)."
    )
