"""Training the paged experts themselves: their gradients by expert, on the
host, and an update of the experts a step's tokens reached.

[Note: experts trained one by one]
A fused experts parameter (`gate_up_proj`, every expert along its first
dimension) stays on the host while wrapped ([Note: experts paged one by
one] in experts/table.py); a call brings its routed experts to the device.
Trained, three things change:

1. The forward reads a copy of the routed experts that autograd connects
   to the Parameter: for the call, the module's parameter entry holds
   `ExpertsIn`'s output (the routed experts in the order of their numbers,
   copied from the host straight into a tensor of the call's own: no slot
   of the cache, whose copies of them the step makes stale and which the
   backward would not read; so a group of tokens is bounded by the copies'
   share of the budget alone, and a training step's room may take the
   cache down to a token's experts at no cost to it) in place of the Parameter, as
   `torch.func.functional_call` swaps a module's tensors; the post-hook puts
   the Parameter back (and unwrap, whatever ended a call), the same object,
   its data the host tensor throughout. Saved views of that copy are
   recipes made again from the host for the backward, as for frozen experts
   ([Note: a backward through paged experts] in experts/saved.py): no expert
   is held on the device between the passes.
2. The backward of `ExpertsIn` receives the gradient of those experts only
   (the compact one, a row per routed expert) and gives the Parameter
   none through autograd (so hooks on the Parameter would see none: a call
   is refused while it has any; `torch.autograd.grad` of it and a double
   backward are not served). The piece goes to the host (page-locked,
   copied on the compute stream after the kernels that made it) and joins
   `param.grad`, an `ExpertGrad` of the parameter's shape. Pieces that have
   landed are summed as the next ones come, each expert's in the order they
   came (the first copied), into one host tensor of the parameter's shape,
   as autograd sums a dense gradient (an expert a call did not reach adds
   zero there: the same values): micro-batches and groups of tokens hold
   at most the dense gradient. Read by torch (anything but the operations
   below), it becomes that dense tensor on the host, and `param.grad` with
   it, which remembers the experts reached. `mul_` by a number (a clip's or
   GradScaler's scaling) scales it; `zero_()` (and `_foreach_zero_`) empties
   it; `torch.linalg.vector_norm` (torch's clip) is the norm of the reached
   experts' rows (equal to the dense gradient's within rounding: the sum
   runs over fewer zeros).
3. `opt.step()` (pager's step pre-hook) updates, on the host, the experts
   the gradient covers and no other, with the user's own optimizer, on a
   view: a Parameter of those experts' rows, their gradient, and their
   rows of each state tensor kept by expert (first dimension the experts;
   scalars such as Adam's `step` are the parameter's own); the rows are
   then written back to the host tensors. Where at least half the experts
   were reached, and at the first step (so that the optimizer makes its
   state for every expert, with its own initial values), it runs on the
   whole tensors instead and puts the unreached experts' weights and state
   rows back after. The cache then forgets the table's experts. An expert
   no token reached is neither copied for the backward nor stepped: for
   SGD without momentum or weight decay and for Adagrad that is the dense
   update; for Adam, AdamW and the others it is the lazy variant (as
   `SparseAdam` is of Adam, and as `torch.optim` skips a `ModuleList`
   expert whose gradient is None; pager says so once): its weights and
   state rows are as they were. Where every expert is reached, it is the
   dense update bit for bit on the CPU device. Under a CUDA device the
   update takes torch's fused CPU kernel where the optimizer's class has one
   (`fused_on_host`: Adam, AdamW, SGD, Adagrad; the same update within
   rounding, 3-8x the foreach one's speed on the host). The state lives on the host
   (state made on the device before is brought there at the first step),
   so `optimizer.state_dict()` saves it as it is; unwrap gives it back.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..base.tensor_ops import METADATA
from .saved import rows_of


class ExpertsIn(torch.autograd.Function):
    """The routed experts of a call, `make()` (their copy), as a tensor
    autograd connects to their Parameter (see [Note: experts trained one
    by one]): its backward gives the gradient of those experts to `sink`,
    and the Parameter none."""

    @staticmethod
    def forward(ctx, param, make, sink):
        ctx.sink = sink
        return make()

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(grad)
        return None, None, None


def copied_from_host(params: list, hosts: list, experts: list, device: torch.device, counters) -> list:
    """`experts` of each parameter copied from its host tensor into a
    tensor of the call's own on `device` (see the Note), a trained
    parameter's through `ExpertsIn`; counted as misses of the cache."""
    counters.expert_misses += len(experts)
    counters.expert_h2d_bytes += len(experts) * sum(h[0].numel() * h.element_size() for h in hosts)
    grad = torch.is_grad_enabled()
    return [
        ExpertsIn.apply(
            p, lambda h=host: rows_of(h, experts, device), lambda g, p=p: add_piece(p, experts, g, counters)
        )
        if grad and p.requires_grad
        else rows_of(host, experts, device)
        for p, host in zip(params, hosts)
    ]


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
        g.take_piece(experts, piece, event)
        return
    if event is not None:
        event.synchronize()
    with torch.no_grad():  # (a dense gradient: the user's, or one made when torch read it)
        g.index_add_(0, torch.tensor(experts, device=g.device), piece.to(g.device, g.dtype))
    known = made_rows(g)
    if known is not None:
        known.update(experts)


# id(dense gradient made from an `ExpertGrad`, its `param.grad` now) -> (a weak reference to it, the
# experts it covers until the step). By id: a tensor's `==` is elementwise, so no weak-keyed dict.
_MADE_ROWS: dict = {}


def made_rows(t) -> set | None:
    """The experts `t` covers, if it is a dense gradient made from an `ExpertGrad`."""
    entry = _MADE_ROWS.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def _remember_rows(t: torch.Tensor, rows: set) -> None:
    key = id(t)
    _MADE_ROWS[key] = (weakref.ref(t, lambda _ref: _MADE_ROWS.pop(key, None)), rows)


class ExpertGrad(torch.Tensor):
    """`param.grad` of a trained experts parameter: its gradient by expert,
    on the host (see [Note: experts trained one by one])."""

    pending: list  # (experts, their gradient's rows on the host, the copy's event or None), not yet summed
    summed_host: torch.Tensor | None  # the parameter's shape: the rows of `seen` summed so far
    seen: set  # the experts summed into it
    made: torch.Tensor | None  # the dense gradient, once torch read it
    param: weakref.ref  # its parameter (whose `.grad` this is: no cycle)

    @staticmethod
    def __new__(cls, param: nn.Parameter):
        t = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )
        t.pending, t.summed_host, t.seen, t.made, t.param = [], None, set(), None, weakref.ref(param)
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
        if me is not None and func in _SCALES and len(args) == 2 and not kwargs and _a_number(args[1]):
            me.scale(args[1])
            return me
        if me is not None and func is torch.Tensor.zero_:
            me.clear()
            return me
        if me is not None and func is torch.linalg.vector_norm:
            return me.vector_norm(*args[1:], **kwargs)
        if func is torch._foreach_zero_ and len(args) == 1 and not kwargs:  # (zero_grad(set_to_none=False))
            return _foreach_zero(func, args[0])
        args, kwargs = _made((args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        # Reached below Python (an operation pager's own guards served, over a
        # list with paged-out tensors): as above, on the dense gradient.
        if func is torch.ops.aten._foreach_zero_.default and len(args) == 1:
            return _foreach_zero(func, args[0])
        args, kwargs = _made((args, kwargs or {}))
        return func(*args, **kwargs)

    def take_piece(self, experts: list, piece: torch.Tensor, event) -> None:
        """A backward's piece; those landed before it are summed now."""
        self.pending.append((experts, piece, event))
        if len(self.pending) > 1:
            self._sum(wait=False)

    def _sum(self, wait: bool) -> None:
        """Sum the pieces that have landed (all, waiting: `wait`) into
        `summed_host`, in the order they came (see the Note)."""
        while self.pending:
            experts, piece, event = self.pending[0]
            if event is not None:
                if not wait and not event.query():
                    return
                event.synchronize()
            self.pending.pop(0)
            if self.summed_host is None:
                self.summed_host = torch.zeros(self.shape, dtype=self.dtype)
            for i, e in enumerate(experts):  # (an add per expert: torch's CPU index_add_ is slower on large rows)
                row = self.summed_host[e]
                if e in self.seen:
                    row.add_(piece[i])
                else:
                    row.copy_(piece[i])
                    self.seen.add(e)

    def clear(self) -> None:
        self.pending, self.summed_host, self.seen = [], None, set()

    def scale(self, factor) -> None:
        factor = factor.cpu() if isinstance(factor, torch.Tensor) else factor
        self._sum(wait=True)
        if self.summed_host is not None:
            self.summed_host.mul_(factor)

    def reached(self) -> list:
        """The experts it covers, sorted."""
        return sorted(self.seen.union(*(experts for experts, _p, _e in self.pending)))

    def summed(self, rows: list | None = None) -> torch.Tensor:
        """The gradient's rows for `rows` (the experts reached, sorted), or
        the dense gradient (`rows` None), on the host."""
        if rows is not None and self.summed_host is None and len(self.pending) == 1 and self.pending[0][0] == rows:
            experts, piece, event = self.pending[0]
            if event is not None:
                event.synchronize()
            return piece  # (one call's piece, its rows those reached: as it came)
        self._sum(wait=True)
        dense = self.summed_host if self.summed_host is not None else torch.zeros(self.shape, dtype=self.dtype)
        return dense if rows is None else dense.index_select(0, torch.tensor(rows, dtype=torch.long))

    def vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None) -> torch.Tensor:
        rows = self.reached()
        if dim is not None or keepdim or not rows:
            return torch.linalg.vector_norm(self.make_real(), ord, dim, keepdim, dtype=dtype)
        return torch.linalg.vector_norm(self.summed(rows), ord, dtype=dtype)

    def make_real(self) -> torch.Tensor:
        """The dense gradient on the host (made once); it becomes
        `param.grad` if this stand-in still is, and remembers the experts
        reached (`made_rows`)."""
        if self.made is None:
            reached = set(self.reached())
            made = self.summed()
            self.made = made
            self.clear()
            _remember_rows(made, reached)
            param = self.param()
            if param is not None and param.grad is self:
                param.grad = made
        return self.made


_SCALES = {torch.Tensor.mul_, torch.Tensor.__imul__}
_KEEPS_SELF = {torch.Tensor.detach_, torch.Tensor.requires_grad_}


def _a_number(factor) -> bool:
    return not isinstance(factor, torch.Tensor) or factor.numel() == 1


def _foreach_zero(func, tensors):
    """`_foreach_zero_` of a list of gradients: an `ExpertGrad` emptied, the others zeroed."""
    rest = []
    for t in tensors:
        if isinstance(t, ExpertGrad) and t.made is None:
            t.clear()
        else:
            rest.append(t.made if isinstance(t, ExpertGrad) else t)
    if rest:
        with torch._C.DisableTorchFunctionSubclass():
            func(rest)


def _made(tree):
    if isinstance(tree, ExpertGrad):
        return tree.make_real()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_made(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _made(v) for k, v in tree.items()}
    return tree


def reached_rows(g, experts: int) -> list:
    """The experts gradient `g` (a parameter's `.grad`) covers, sorted: an
    `ExpertGrad`'s, a dense one made from it, or (the user's own) every one."""
    if isinstance(g, ExpertGrad) and g.made is None:
        return g.reached()
    known = made_rows(g.made if isinstance(g, ExpertGrad) else g)
    return sorted(known) if known is not None else list(range(experts))


def gradient_of(g, rows: list | None) -> torch.Tensor:
    """Gradient `g`'s rows `rows` (None: dense), on the host."""
    if isinstance(g, ExpertGrad) and g.made is None:
        return g.summed(rows)
    dense = (g.make_real() if isinstance(g, ExpertGrad) else g).to("cpu")
    return dense if rows is None else dense.index_select(0, torch.tensor(rows, dtype=torch.long))


def check_trainable(table) -> None:
    """Refuse, before a call with gradients for `table`'s (an `ExpertTable`)
    own parameters changes anything, what training them one by one cannot
    serve (see the Note)."""
    trained = [n for n, p in zip(table.names, table.params) if p.requires_grad] if torch.is_grad_enabled() else []
    if trained and table.pager.master_weights:
        raise RuntimeError(
            f"pager: the experts of {table.name!r} page one by one (experts='auto') and train on the host, "
            "without float32 master weights: under master_weights=True freeze them "
            "(`module.requires_grad_(False)`), or wrap with experts=None to train them with their layers."
        )
    hooked = [n for n, p in zip(table.names, table.params) if n in trained and p._backward_hooks]
    if hooked:  # (their gradients reach `.grad` by expert, not through autograd: a hook would see none)
        raise RuntimeError(
            f"pager: {table.name}.{hooked[0]} has a gradient hook (`register_hook`), and its experts page one "
            "by one: their gradients go to `.grad` by expert, not through autograd, so the hook would see none. "
            "Remove the hook, freeze the experts, or wrap with experts=None to train them with their layers."
        )
