"""What a training forward saves for its backward, per block, measured on
fake tensors: shapes and dtypes flow through the model's own code, nothing is
computed and no memory is taken (for `plan`).

[Note: activations measured without running]
`torch.func.functional_call` runs the model with fake copies of its
parameters and buffers (the model is not changed) under a `FakeTensorMode`,
inside saved-tensor hooks that see each tensor autograd saves. A saved tensor
is attributed to the innermost block whose forward is running (temporary
forward hooks keep the stack), by storage (a view saved again counts once,
where it was first saved); storages of parameters and buffers are not
activations (they page with their block). What a block's forward is called
with is recorded too: `activations="recompute"` keeps exactly that. A forward
that cannot run on fake tensors (it reads values: `.item()`, data-dependent
shapes) is reported, not guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..training.activations import _nbytes


@dataclass
class SavedBytes:
    """Bytes a training forward saves for its backward.

    `saved[i]` (each storage once) and `inputs[i]` are per block, in the
    order of `names`; `outside` is what ops outside every block save
    (embeddings, heads)."""

    names: list[str]
    saved: list[int]
    inputs: list[int]
    outside: int
    order: list[str]  # blocks in the order their forwards ran (innermost)

    @property
    def total(self) -> int:
        return sum(self.saved) + self.outside


def measure_saved(model: torch.nn.Module, named_blocks, inputs) -> SavedBytes:
    """Run `model`'s forward on fake tensors shaped like `inputs` (a tensor, a
    tuple of positional arguments, or a dict of keyword arguments) and count
    what it saves for its backward, per block ([Note: activations measured
    without running]). Raises `ValueError` naming the cause if the forward
    cannot run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    args, kwargs = _as_call(inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # (tensors the model holds outside its state: made fake)
    names = [n for n, _m in named_blocks]
    index = {id(m): i for i, (_n, m) in enumerate(named_blocks)}
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    with mode:
        fakes, by_id = {}, {}
        for name, t in state.items():
            if id(t) not in by_id:  # a tied tensor: one fake for all its names
                by_id[id(t)] = mode.from_tensor(t.detach()).requires_grad_(t.requires_grad and t.is_floating_point())
            fakes[name] = by_id[id(t)]
        fake_args, fake_kwargs = tree_map(
            lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
        )
    own = {_key(t) for t in fakes.values()}
    saved, block_inputs, seen = [0] * len(names), [0] * len(names), set()
    stack: list[int] = []
    order: list[str] = []
    outside = [0]

    def pre(module, a, k):
        i = index[id(module)]
        stack.append(i)
        order.append(names[i])
        block_inputs[i] += sum(
            _nbytes(t) for t in tree_flatten((a, k))[0] if isinstance(t, torch.Tensor) and _key(t) not in own
        )

    def post(module, a, out):
        stack.pop()

    def pack(t):
        key = _key(t)
        if key not in own and key not in seen:
            seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            if stack:
                saved[stack[-1]] += nbytes
            else:
                outside[0] += nbytes
        return t

    handles = [
        h
        for _n, m in named_blocks
        for h in (m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, always_call=True))
    ]
    try:
        with mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            functional_call(model, fakes, fake_args, fake_kwargs, tie_weights=True, strict=False)
    except Exception as e:  # noqa: BLE001 - the model's own code: report what it raised
        raise ValueError(
            f"pager: the model's forward could not run on fake tensors to measure its activations "
            f"({type(e).__name__}: {str(e)[:200]}); a forward that reads tensor values (.item(), data-dependent "
            f"shapes) cannot be measured this way: leave `inputs` out of plan()."
        ) from e
    finally:
        for h in handles:
            h.remove()
    return SavedBytes(names, saved, block_inputs, outside[0], order)


def _as_call(inputs):
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _key(t) -> int:
    return t.untyped_storage()._cdata
