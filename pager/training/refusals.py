"""The refusals of a training step the budget does not hold, with the
least budget that does ([Note: activations, the automatic choice] in
training/activations.py): `plan_refusal` (the forward measured on fake
tensors) and `unmeasured_refusal` (a forward that could not be)."""

from __future__ import annotations

from collections.abc import Callable

from ..base.budget import format_bytes
from ..base.common import BudgetError
from .saved_bytes import OFFLOAD, RECOMPUTE


def least_budget(need: int, beside_bytes: Callable[..., int]) -> int:
    """The least budget that holds `need` (figured under the budget now),
    where `beside_bytes(budget)` (what a pass holds beside its activations)
    is a share of the budget and grows with it: the least is where the two
    meet."""
    rest, budget = need - beside_bytes(), need
    for _ in range(16):  # (a share of at most a half: each round halves the gap at least)
        budget = rest + beside_bytes(budget)
    return budget + 1 if rest + beside_bytes(budget) > budget else budget


def unmeasured_refusal(
    least: int, acts: int, budget: int, out: int, at_step: bool, least_bytes: int, said: str = ""
) -> BudgetError:
    """A step whose forward could not be measured: blocks need at least
    `least` beside the `acts` the last pass held, more than `budget` (of
    the budget as given, less `out` outside pager's room); `said`: what
    the least holds that the user can change (`step_needs.remainder_said`)."""
    return BudgetError(
        f"pager: a training step of this model holds at least {format_bytes(least + acts)} on the device: "
        f"blocks at least {format_bytes(least)} (the resident remainder and the largest block with their "
        f"gradients and optimizer state, and what pager keeps beside them{said}) + activations "
        f"{format_bytes(acts)} (what the last pass held, or an update of a block on the device at the step if more; "
        f"the forward could not be measured before it ran), "
        f"more than the budget of {format_bytes(budget + out)}"
        + (f" less {format_bytes(out)} outside pager's room" if out else "")
        + f". {_unchanged(at_step)}. Use a budget of at least {format_bytes(least_bytes, up=True)}.",
        least_budget_bytes=least_bytes,
    )


def plan_refusal(
    held: dict,
    mine: int,
    asked: str,
    least: int,
    budget: int,
    out: int,
    staging: int,
    at_step: bool,
    least_of,
    update: int = 0,
    said: str = "",
) -> BudgetError:
    """A step no policy holds: `held` what activations hold under each
    policy, `mine` under the one asked (`asked`), beside the `least` that
    blocks need, more than `budget` (the budget as given less `out` outside
    pager and `staging` for compressed pages); `least_of(need)`: the least
    budget that holds `need`; `update`: what an update of a block on the
    device holds beside them at the step, where activations hold nothing;
    `said`: what the least holds that the user can change
    (`step_needs.remainder_said`)."""
    holds = [p for p, n in held.items() if least + max(n, update) <= budget]
    outside = f" less the {format_bytes(out)} the process holds on the device outside pager" if out else ""
    outside += f" less the {format_bytes(staging)} of staging for compressed pages" if staging else ""
    out += staging
    fix = (
        f'activations="{holds[0]}", which holds this budget'
        if holds
        else f"a budget of at least {format_bytes(least_of(out + least + max(min(held.values()), update)), up=True)} "
        '(activations="auto" or '
        f'"{min(held, key=lambda p: held[p])}"), or a smaller batch'
    )
    inference = (
        ""
        if at_step
        else " If this forward is inference, run it under `torch.no_grad()` (or `torch.inference_mode()`): a "
        "forward with gradients enabled is planned as a training step, with what it saves for its backward."
    )
    step = (
        f"; at the step, an update of a block on the device holds {format_bytes(update)} beside the blocks "
        "instead (an unfused optimizer's temporaries)"
        if update > mine
        else ""
    )
    return BudgetError(
        f"pager: a training step of this model with these inputs holds at least "
        f"{format_bytes(least + max(mine, update))} "
        f"on the device: blocks at least {format_bytes(least)} (the resident remainder and the largest block "
        f"with their gradients and optimizer state, and what pager keeps beside them{said}) + activations "
        f"{format_bytes(mine)} (activations={asked!r}; offload holds {format_bytes(held[OFFLOAD])}, "
        f"recompute {format_bytes(held[RECOMPUTE])}){step}, more than the budget of {format_bytes(budget + out)}"
        f"{outside}. {_unchanged(at_step)}. Use {fix}. (The optimizer's state counts once it is attached: "
        f"`wrap(..., optimizer=opt)` counts it from the first forward; `pager.plan(model, budget, inputs=..., "
        f"optimizer=...)` gives these figures before wrap.){inference}",
        least_budget_bytes=least_of(out + least + max(mine, update)),
    )


def _unchanged(at_step: bool) -> str:
    """What a refusal left as it was."""
    if at_step:
        return "This step did not run: nothing was updated (its gradients are kept; step again once the budget holds)"
    return "This forward did not run"
