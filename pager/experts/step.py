"""The update of trained experts on the host: `step_table` (the experts a
step's tokens reached, and no other), `fused_on_host`, and their gradient
and state given back at unwrap (see [Note: experts trained one by one] in
experts/train.py)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn

from ..base.optimizers import dense_on_rows, run_narrowed
from .train import ExpertGrad, gradient_of, made_rows, reached_rows


def step_table(table, index: int, optimizer, group_index: int, run_step) -> None:
    """Update the experts the gradient of `table`'s (an `ExpertTable`)
    parameter `index` covers (see the Note)."""
    cuda = table.pager.transport.is_cuda
    if cuda:
        # The host tensors are about to be written: every copy that reads
        # them (into the cache, ahead, or for a backward) must be done first.
        torch.cuda.synchronize(table.cache.device)
    if not dense_on_rows(optimizer, optimizer.param_groups[group_index]):
        table.pager.warn_once(
            "experts-lazy",
            "pager: the experts train one by one: %s updates only the experts a step's tokens reached (the "
            "lazy variant, as SparseAdam is of Adam: the others keep their weights and state), which differs "
            "from %s on the whole tensors. For the dense update use SGD without momentum or weight decay, or "
            "Adagrad, or wrap with experts=None.",
            type(optimizer).__name__,
            type(optimizer).__name__,
        )
    with fused_on_host(optimizer, group_index) if cuda else nullcontext():
        stepped = step_experts(table.params[index], table.hosts[index], optimizer, group_index, run_step)
    if stepped is not None:
        table.cache.forget(table.base, table.num_experts)  # (their cached copies are stale)
        if index == 0:  # (counted by the module's first parameter: gate_up_proj)
            table.pager.counters.experts_stepped += len(stepped)


def step_experts(param: nn.Parameter, host: torch.Tensor, optimizer, group_index: int, run_step) -> list | None:
    """Update the experts `param.grad` covers with `optimizer` (its group
    `group_index` holds `param`), on the host; returns the experts stepped
    (see [Note: experts trained one by one])."""
    g = param.grad
    if g is None:
        return None
    experts = host.shape[0]
    rows = reached_rows(g, experts)
    if not rows:
        return None
    state = optimizer.state[param]
    _adopt(state, param)
    if not state or 2 * len(rows) >= experts:
        _step_whole(param, rows, gradient_of(g, None), optimizer, group_index, run_step)
    else:
        _step_rows(param, host, rows, gradient_of(g, rows), optimizer, group_index, run_step)
    known = made_rows(g.made if isinstance(g, ExpertGrad) else g)
    if known is not None:
        known.clear()  # (the next backward's experts only)
    return rows


def _adopt(state: dict, param: nn.Parameter) -> None:
    """State made elsewhere (before wrap, or loaded on the device) comes to
    the host, where the update runs; state not kept by expert is refused
    before anything changes."""
    experts = param.shape[0]
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() and value.shape[0] != experts:
            raise ValueError(
                f"pager: the optimizer keeps state {key!r} of shape {tuple(value.shape)} for a trained experts "
                f"parameter of shape {tuple(param.shape)}, not by expert (its first dimension): pager updates "
                "experts one by one. Use an optimizer whose state follows the parameter's shape (Adam, AdamW, "
                "SGD, Adagrad, ...), or wrap with experts=None to train the experts with their layers."
            )
        if value.device.type != "cpu":
            state[key] = value.to("cpu")


def _step_rows(param, host, rows: list, grad, optimizer, group_index: int, run_step) -> None:
    """The update on a view of the reached experts' rows (see the Note)."""
    state = optimizer.state[param]
    index = torch.tensor(rows, dtype=torch.long)
    view = nn.Parameter(host.index_select(0, index))
    view.grad = grad.to(view.dtype)
    optimizer.state[view] = {k: (v.index_select(0, index) if _by_expert(v, host) else v) for k, v in state.items()}
    try:
        run_narrowed(view, optimizer, group_index, run_step)
    finally:
        new_state = optimizer.state.pop(view, {})
    for key, value in new_state.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == len(rows):
            full = state.get(key)
            if full is None or not _by_expert(full, host):
                # (a state the optimizer made only now, as momentum turned on: zero for the other experts)
                full = state[key] = torch.zeros((host.shape[0], *value.shape[1:]), dtype=value.dtype)
            full.index_copy_(0, index, value.to(full.device))
        else:
            state[key] = value
    with torch.no_grad():
        host.index_copy_(0, index, view.detach())


def _step_whole(param: nn.Parameter, rows: list, grad: torch.Tensor, optimizer, group_index: int, run_step):
    """The update on the parameter's whole tensors (`grad` dense), where at
    least half the experts were reached or at the first step: the rows of
    the experts not reached (weights, and the state they had) are put back
    after it: the same values as on a view of the reached rows (torch.optim's
    updates are per element). State the optimizer made at this step keeps
    its own values for them (its initial ones, after a zero gradient)."""
    host, experts = param.data, param.shape[0]
    others = None
    if len(rows) < experts:
        mask = torch.ones(experts, dtype=torch.bool)
        mask[torch.tensor(rows, dtype=torch.long)] = False
        others = mask.nonzero().flatten()
        kept = {key: v.index_select(0, others) for key, v in optimizer.state[param].items() if _by_expert(v, host)}
        kept_weights = host.index_select(0, others)
    stand_in, param.grad = param.grad, grad.to(param.dtype)
    try:
        run_narrowed(param, optimizer, group_index, run_step)
    finally:
        param.grad = stand_in
    if others is not None:
        with torch.no_grad():
            host.index_copy_(0, others, kept_weights)
            for key, value in optimizer.state[param].items():
                if key in kept and _by_expert(value, host):
                    value.index_copy_(0, others, kept[key])


def _by_expert(value, host: torch.Tensor) -> bool:
    """Whether `value` is a state tensor kept by expert (its first dimension the experts)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == host.shape[0]


# torch.optim classes with a fused kernel on the CPU (the same update as their foreach one, within rounding)
FUSED_ON_HOST = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


@contextmanager
def fused_on_host(optimizer, group_index: int):
    """Around an update of experts on the host under a CUDA device: the
    group runs torch's fused CPU kernel where its class has one (the
    optimizer as the user made it picks its kernels for the device: foreach
    on the host is 3-8x slower, measured on bf16 and float32), its options
    given back after. Not on the CPU device, where the update is the
    unpaged model's bit for bit."""
    group = optimizer.param_groups[group_index]
    if (
        type(optimizer) not in FUSED_ON_HOST
        or group.get("fused")
        or group.get("capturable")
        or group.get("differentiable")
    ):
        yield
        return
    saved = group.get("foreach"), group.get("fused")
    group["foreach"], group["fused"] = False, True
    try:
        yield
    finally:
        group["foreach"], group["fused"] = saved


@contextmanager
def training_given_back(param: nn.Parameter, device: torch.device, optimizers):
    """Around `param`'s data going back to `device` (unwrap): its gradient
    (dense) and `optimizers`' state of it go there too (scalars only where
    the optimizer keeps them on the parameter's device: fused, capturable)."""
    grad = param.grad.make_real() if isinstance(param.grad, ExpertGrad) else param.grad
    param.grad = None
    yield
    if grad is not None:
        param.grad = grad.to(device)
    for opt in optimizers:
        state = opt.state.get(param) or {}
        group: dict = next((g for g in opt.param_groups if any(p is param for p in g["params"])), {})
        on_device = group.get("fused") or group.get("capturable")
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and (value.dim() or on_device):
                state[key] = value.to(device)
