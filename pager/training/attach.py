"""How an optimizer is linked to a wrapped model: `attach` (by
`Pager.attach`, `wrap(optimizer=...)`, or at its first step through a
global step pre-hook, so the user's loop needs no change), and what it is
told then."""

from __future__ import annotations

import torch

from ..base.common import BudgetError
from ..base.optimizers import dense_on_rows
from . import masters
from .optim import OptimizerLink, raw_step_of


def _auto_attach(optimizer, args, kwargs) -> None:
    """Global step pre-hook: attach an optimizer that holds a wrapped model's
    parameters the first time it steps, so the user's loop needs no change."""
    from ..base.common import _PAGERS

    if getattr(optimizer, "_pager_shadow", False):
        return
    for pager in list(_PAGERS.values()):
        if any(link.optimizer is optimizer for link in pager.optimizers):
            continue
        if any(pager.managed(p) for g in optimizer.param_groups for p in g["params"]):
            attach(pager, optimizer, at_step=True)


_global_hook = None


def install_global_hook() -> None:
    global _global_hook
    if _global_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _global_hook = register_optimizer_step_pre_hook(_auto_attach)


def attach(pager, optimizer: torch.optim.Optimizer, at_step: bool = False) -> OptimizerLink:
    """Link `optimizer` to `pager` (a `Pager`); see `Pager.attach`.
    `at_step`: at its first step (between a backward and the update), where
    a budget its state breaks is refused before the update runs."""
    for link in pager.optimizers:
        if link.optimizer is optimizer:
            return link  # idempotent
    if not any(pager.managed(p) for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "pager: attach() got an optimizer that holds none of this model's parameters; build it "
            "from model.parameters()."
        )
    if pager.master_weights and raw_step_of(optimizer) is None:
        raise ValueError(
            f"pager: master_weights=True steps the optimizer on float32 masters through torch.optim's undecorated "
            f"step, which {type(optimizer).__name__} does not have (not a torch.optim.Optimizer, or its step is not "
            f"decorated by one). Use a torch.optim optimizer, or wrap without master_weights."
        )
    if pager.master_weights:
        masters.check_attached_state(optimizer, masters.param_names(pager))
    link = OptimizerLink(pager, optimizer)
    if pager.owners is not None:
        pager.owners.keep_own_state(optimizer)  # (loaded before it was attached: [Note: block owners])
    pager.optimizers.append(link)
    # (Under block owners the next forward asks instead: a rank's refusal here would leave the
    # others in the step's collectives.)
    if at_step and pager.activations is not None and pager.owners is None:
        try:  # (its state counts before its first step changes anything)
            pager.activations.step_attaches()
        except BudgetError:
            link.detach()  # (the next step attaches it again, and asks again)
            raise
    _warn_if_rows_lazy(pager, optimizer)
    return link


def _warn_if_rows_lazy(pager, optimizer) -> None:
    """A table wrap paged by rows unasked, updated by an optimizer whose
    update of the rows a batch does not touch is not the dense one
    ([Note: exact updates of touched rows] in rows/step.py): say so once."""
    if not pager.rows_unasked:
        return
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    lazy = [
        t.name
        for t in pager.row_tables
        if t.name in pager.rows_unasked and id(t.param) in groups and not dense_on_rows(optimizer, groups[id(t.param)])
    ]
    if lazy:
        pager.warn_once(
            "rows-lazy",
            "pager: %s paged by rows because it did not fit the budget beside the blocks; %s updates "
            "only the rows each batch touches (the lazy variant, as SparseAdam is of Adam: untouched rows keep "
            "their values and state), which differs from %s on the whole table. For the dense update, give a "
            "budget that holds the table beside a block, or an optimizer whose update of untouched rows is "
            "none (SparseAdam, Adagrad, SGD without momentum or weight decay).",
            ", ".join(map(repr, lazy)),
            type(optimizer).__name__,
            type(optimizer).__name__,
        )
