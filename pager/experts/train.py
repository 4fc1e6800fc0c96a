"""Training the paged experts themselves: their gradients by expert, on the
host, and an update of the experts a step's tokens reached.

[Note: experts trained one by one]
A fused experts parameter (`gate_up_proj`, every expert along its first
dimension) stays on the host while wrapped ([Note: experts paged one by
one] in experts/table.py); a call brings its routed experts to the device.
Trained, three things change:

1. The forward reads a copy of the routed experts that autograd connects
   to the Parameter: for the call, the module's parameter entry holds
   `ExpertsIn`'s output (the routed experts, gathered from the cache in the
   order of their numbers) in place of the Parameter, as
   `torch.func.functional_call` swaps a module's tensors; the post-hook puts
   the Parameter back, the same object, its data the host tensor throughout.
   Saved views of that copy are recipes made again from the host for the
   backward, as for frozen experts ([Note: a backward through paged
   experts] in experts/saved.py): no expert is held on the device between
   the passes.
2. The backward of `ExpertsIn` receives the gradient of those experts only
   (the compact one, a row per routed expert) and gives the Parameter
   none through autograd: the piece goes to the host (page-locked, copied on
   the compute stream after the kernels that made it) and joins
   `param.grad`, an `ExpertGrad` of the parameter's shape that holds the
   pieces and which experts they cover. A second call or micro-batch adds
   pieces; the gradient is the pieces summed per expert in the order they
   came, as autograd sums a dense gradient (an expert a call did not reach
   adds zero there: the same values). Read by torch (anything but the
   operations below), it becomes that dense tensor on the host, and
   `param.grad` with it. `mul_` (a clip's or GradScaler's scaling) scales the
   pieces; `zero_()` empties them; `torch.linalg.vector_norm` (torch's
   clip) is the norm of the reached experts' rows (equal to the dense
   gradient's within rounding: the sum runs over fewer zeros).
3. `opt.step()` (pager's step pre-hook) updates, on the host, the experts
   the gradient covers and no other, with the user's own optimizer, on a
   view: a Parameter of those experts' rows, their gradient, and their
   rows of each state tensor of the parameter's shape (scalars such as
   Adam's `step` are the parameter's own). The rows are then written back
   to the host tensors, and the cache forgets the table's experts. An expert
   no token reached is neither copied for the backward nor stepped: for
   SGD without momentum or weight decay that is the dense update; for Adam,
   AdamW and the others it is the lazy variant (as `SparseAdam` is of Adam,
   and as `torch.optim` skips a `ModuleList` expert whose gradient is None):
   its weights and state rows are as they were. Where every expert is
   reached, it is the dense update bit for bit on the CPU device. The state
   lives on the host at the parameter's shape (zeros until an expert is
   first stepped), so `optimizer.state_dict()` saves it as it is.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..base.tensor_ops import METADATA


class ExpertsIn(torch.autograd.Function):
    """The routed experts of a call, gathered from the cache, as a tensor
    autograd connects to their Parameter (see [Note: experts trained one
    by one]): its backward gives the gradient of those experts to `sink`,
    and the Parameter none."""

    @staticmethod
    def forward(ctx, param, source, index, sink):
        ctx.sink = sink
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(grad)
        return None, None, None, None


def add_piece(param: nn.Parameter, experts: list, grad: torch.Tensor, counters) -> None:
    """Add the gradient `grad` of `experts` (its rows, in that order) to
    `param.grad` (see the Note); `counters`: the pager's `Counters`."""
    counters.expert_grad_d2h_bytes += grad.numel() * grad.element_size()
    event = None
    if grad.device.type == "cpu":
        piece = grad.detach().clone() if grad.requires_grad or grad._base is not None else grad.detach()
    else:
        piece = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        piece.copy_(grad, non_blocking=True)
        event = torch.cuda.Event()
        event.record()  # (the host reads the piece only once this copy, after the kernels that made it, is done)
    g = param.grad
    if g is None:
        param.grad = g = ExpertGrad(param)
    if isinstance(g, ExpertGrad) and g.made is None:
        g.pieces.append((experts, piece, event))
        return
    if event is not None:
        event.synchronize()
    with torch.no_grad():  # (a dense gradient: the user's, or one made when torch read it)
        g.index_add_(0, torch.tensor(experts, device=g.device), piece.to(g.device, g.dtype))


class ExpertGrad(torch.Tensor):
    """`param.grad` of a trained experts parameter: the pieces of its
    gradient, by expert, on the host (see [Note: experts trained one by one])."""

    pieces: list  # (experts, their gradient's rows on the host, the copy's event or None), in the order they came
    made: torch.Tensor | None  # the dense gradient, once torch read it
    param: weakref.ref  # its parameter (whose `.grad` this is: no cycle)

    @staticmethod
    def __new__(cls, param: nn.Parameter):
        t = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )
        t.pieces, t.made, t.param = [], None, weakref.ref(param)
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0] if args and isinstance(args[0], ExpertGrad) and args[0].made is None else None
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if me is not None and func in _KEEPS_SELF:
            return me
        if me is not None and func in _SCALES and len(args) == 2 and not kwargs:
            me.scale(args[1])
            return me
        if me is not None and func is torch.Tensor.zero_:
            me.pieces = []
            return me
        if me is not None and func is torch.linalg.vector_norm:
            return me.norm(*args[1:], **kwargs)
        if func is torch._foreach_zero_ and len(args) == 1 and not kwargs:  # (zero_grad(set_to_none=False))
            rest = [t for t in args[0] if not (isinstance(t, ExpertGrad) and t.made is None)]
            for t in args[0]:
                if isinstance(t, ExpertGrad) and t.made is None:
                    t.pieces = []
            args = (rest,)
        args, kwargs = _made((args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError(
            f"pager: {func} reached a trained experts parameter's gradient below Python (from C++); read it from "
            f"Python (param.grad), which gives the dense gradient."
        )

    def _landed(self) -> list:
        for _experts, _piece, event in self.pieces:
            if event is not None:
                event.synchronize()
        return self.pieces

    def scale(self, factor) -> None:
        factor = factor.cpu() if isinstance(factor, torch.Tensor) else factor
        for _experts, piece, _event in self._landed():
            piece.mul_(factor)

    def reached(self) -> list:
        """The experts the pieces cover, sorted."""
        return sorted({e for experts, _p, _e in self._landed() for e in experts})

    def summed(self, rows: list | None = None) -> torch.Tensor:
        """The gradient's rows for `rows` (the experts reached, sorted), or
        the dense gradient (`rows` None): each expert's pieces summed in the
        order they came (the first copied), on the host."""
        pieces = self._landed()
        if rows is not None and len(pieces) == 1 and pieces[0][0] == rows:
            return pieces[0][1]
        out = torch.zeros((len(rows) if rows is not None else self.shape[0], *self.shape[1:]), dtype=self.dtype)
        at = {e: i for i, e in enumerate(rows)} if rows is not None else None
        seen: set = set()
        for experts, piece, _event in pieces:
            for i, e in enumerate(experts):  # (an add per expert: torch's CPU index_add_ is slower on large rows)
                row = out[at[e] if at is not None else e]
                if e in seen:
                    row.add_(piece[i])
                else:
                    row.copy_(piece[i])
                    seen.add(e)
        return out

    def norm(self, ord=2, dim=None, keepdim=False, *, dtype=None) -> torch.Tensor:  # type: ignore[override]
        rows = self.reached()
        if dim is not None or keepdim or not rows:
            return torch.linalg.vector_norm(self.make_real(), ord, dim, keepdim, dtype=dtype)
        return torch.linalg.vector_norm(self.summed(rows), ord, dtype=dtype)

    def make_real(self) -> torch.Tensor:
        """The dense gradient on the host (made once); it becomes
        `param.grad` if this stand-in still is."""
        if self.made is None:
            made = self.summed()
            self.made, self.pieces = made, []
            param = self.param()
            if param is not None and param.grad is self:
                param.grad = made
        return self.made


_SCALES = {torch.Tensor.mul_, torch.Tensor.__imul__}
_KEEPS_SELF = {torch.Tensor.detach_, torch.Tensor.requires_grad_}


def _made(tree):
    if isinstance(tree, ExpertGrad):
        return tree.make_real()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_made(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _made(v) for k, v in tree.items()}
    return tree


def grad_rows(param: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The experts `param.grad` covers and their gradient, on the host: the
    rows of those experts, or, where they are at least half of them, the
    dense gradient (a dense gradient, the user's or made, covers every
    expert)."""
    g = param.grad
    if g is None:
        return None
    if isinstance(g, ExpertGrad) and g.made is None:
        rows = g.reached()
        if not rows:
            return None
        most = 2 * len(rows) >= param.shape[0]
        return torch.tensor(rows), g.summed(None if most else rows)
    dense = g.make_real() if isinstance(g, ExpertGrad) else g
    return torch.arange(dense.shape[0]), dense.to("cpu")


def step_experts(param: nn.Parameter, host: torch.Tensor, optimizer, group_index: int, run_step) -> torch.Tensor | None:
    """Update the experts `param.grad` covers with `optimizer` (its group
    `group_index` holds `param`), on the host; returns the experts stepped
    (see [Note: experts trained one by one])."""
    taken = grad_rows(param)
    if taken is None:
        return None
    rows, grad = taken
    if grad.shape[0] == host.shape[0]:  # (at least half the experts reached: the dense gradient)
        _step_whole(param, rows, grad, optimizer, group_index, run_step)
        return rows
    state = optimizer.state[param]
    view = nn.Parameter(host.index_select(0, rows))
    view.grad = grad.to(view.dtype)
    optimizer.state[view] = {k: (v.index_select(0, rows) if _full(v, host) else v) for k, v in state.items()}
    try:
        _run_on(view, optimizer, group_index, run_step)
    finally:
        new_state = optimizer.state.pop(view, {})
    for key, value in new_state.items():
        if isinstance(value, torch.Tensor) and value.shape == view.shape and value.dim():
            full = state.get(key)
            if full is None or not _full(full, host):
                full = state[key] = torch.zeros(host.shape, dtype=value.dtype)  # (rows never stepped: zero)
            full.index_copy_(0, rows, value.to(full.device))
        else:
            state[key] = value
    with torch.no_grad():
        host.index_copy_(0, rows, view.detach())
    return rows


def _step_whole(param: nn.Parameter, rows: torch.Tensor, grad: torch.Tensor, optimizer, group_index: int, run_step):
    """The update by expert where at least half the experts were reached
    (`grad` dense): the optimizer runs on the parameter's whole tensors (no
    rows gathered and written back), and the rows of the experts not
    reached (weights and state) are put back after it: the same values as
    on a view of the reached rows (torch.optim's updates are per element)."""
    host, experts = param.data, param.shape[0]
    reached = rows.numel() == experts
    if not reached:
        others = torch.ones(experts, dtype=torch.bool)
        others[rows] = False
        others = others.nonzero().flatten()
        kept = {key: v.index_select(0, others) for key, v in optimizer.state[param].items() if _full(v, host)}
        kept_weights = host.index_select(0, others)
    stand_in, param.grad = param.grad, grad.to(param.dtype)
    try:
        _run_on(param, optimizer, group_index, run_step)
    finally:
        param.grad = stand_in
    if not reached:
        with torch.no_grad():
            host.index_copy_(0, others, kept_weights)
            for key, value in optimizer.state[param].items():
                if _full(value, host):
                    # (state this step made: its rows for experts never stepped are zero, as by rows)
                    value.index_copy_(0, others, kept[key] if key in kept else value.new_zeros(kept_weights.shape))


def _run_on(param: nn.Parameter, optimizer, group_index: int, run_step) -> None:
    """`run_step(optimizer)` with its group `group_index` narrowed to `param` (the others to nothing)."""
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    try:
        for i, g in enumerate(groups):
            g["params"] = [param] if i == group_index else []
        run_step(optimizer)
    finally:
        for g, params in zip(groups, saved):
            g["params"] = params


def _full(value, host: torch.Tensor) -> bool:
    """Whether `value` is a state tensor of the parameter's shape (by expert)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == host.shape


@contextmanager
def training_given_back(param: nn.Parameter, device: torch.device, optimizers):
    """Around `param`'s data going back to `device` (unwrap): its gradient
    (dense) and `optimizers`' state of it of its shape go there too."""
    grad = param.grad.make_real() if isinstance(param.grad, ExpertGrad) else param.grad
    param.grad = None
    yield
    if grad is not None:
        param.grad = grad.to(device)
    for opt in optimizers:
        state = opt.state.get(param) or {}
        for key, value in state.items():
            if _full(value, param):
                state[key] = value.to(device)
