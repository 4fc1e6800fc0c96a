"""Weights that are tensor subclasses wrapping other tensors (torchao's
quantized weights): paged by their inner tensors.

[Note: wrapper-subclass weights]
torchao's quantized weights (`Int8Tensor`, `Int4Tensor`, `Float8Tensor`)
are traceable wrapper subclasses: the Parameter is a wrapper with no storage
of its own, its bytes are in inner plain tensors (`qdata`, `scale`, ...) that
`__tensor_flatten__` names, and its own `__torch_function__` /
`__torch_dispatch__` run its kernels on them. pager pages such a weight by
its inner tensors: they are the segment's tensors, laid out in its page like
any ([Note: identity by storage resize] in base/block.py: each becomes, once,
a view of the device storage); the wrapper itself holds no bytes. A wrapper
is made on one device for life (`_make_wrapper_subclass(device=...)`), so at
wrap it is rebuilt around its inner views (`__tensor_unflatten__`, which
reports the device storage's device) and swapped into the user's object
with `torch.utils.swap_tensors`, PyTorch's own way to change a tensor's
implementation in place (`Module.to` does so for these subclasses): the
object, its class, its attributes and `isinstance(p, nn.Parameter)` stay
(`follow_inner`; where torch.compile's guards hold weak references to it,
which `swap_tensors` refuses, the same swap of implementations runs after
pager's own check that nothing else holds it). Unwrap does the same back
onto the original device.

While its block is not in use the wrapper, too, has a guard class (a
subclass of its own, made per class by `guards.guard_class`) whose
`__torch_function__` serves the access with the block's tensors given their
own classes, so the wrapper's own `__torch_function__` and kernels run as
they would unwrapped. Its inner tensors are guarded like any tensor.

What is refused at wrap, with the fix: a wrapper that is not traceable (a
`__torch_dispatch__` without `__tensor_flatten__`: its bytes cannot be
found), one nesting another wrapper, one that requires grad (its gradient
would be a wrapper too: train adapters beside it, or the unquantized
weight). Pages of quantized weights are never compressed again (`compress=`
leaves their inner tensors plain: they are quantized already).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, cast

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .block import align

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TensorWithFlatten


def is_wrapper(t: torch.Tensor) -> bool:
    """A traceable wrapper subclass: its bytes are in the inner tensors `__tensor_flatten__` names."""
    return is_traceable_wrapper_subclass(t)


def aligned_bytes(t: torch.Tensor) -> int:
    """Bytes `t` takes in a page (a quantized weight: its inner tensors, each aligned)."""
    if is_wrapper(t):
        return sum(aligned_bytes(inner) for _n, inner in inner_tensors(t))
    return align(t.numel() * t.element_size())


def own_dispatch(t: torch.Tensor) -> bool:
    """A subclass with its own `__torch_dispatch__` (its storage may not be its bytes)."""
    return getattr(type(t), "__torch_dispatch__", None) not in (None, torch._C._disabled_torch_dispatch_impl)


def refusal(name: str, t: torch.Tensor) -> str | None:
    """Why pager cannot page tensor `name` of the model (None: it can)."""
    cls = f"{type(t).__module__}.{type(t).__qualname__}"
    if not is_wrapper(t):
        if own_dispatch(t):
            return (
                f"pager: {name!r} is a {cls}, a tensor subclass with its own __torch_dispatch__ but no "
                f"__tensor_flatten__, so pager cannot find its bytes. Give the class __tensor_flatten__ and "
                f"__tensor_unflatten__ (a traceable wrapper subclass, as torchao's quantized tensors are), or "
                f"keep this module out of the blocks."
            )
        return None
    if t.requires_grad:
        return (
            f"pager: {name!r} is a {cls} (a tensor subclass wrapping other tensors, e.g. a quantized weight) "
            f"that requires grad; pager pages such weights frozen only. Freeze it "
            f"(`{name.rsplit('.', 1)[-1]}.requires_grad_(False)`) and train adapters beside it (LoRA), or "
            f"train the unquantized model."
        )
    if t._use_count() > 1:  # type: ignore[attr-defined]  # (a private method torch's stubs lack)
        return (
            f"pager: {name!r} is a {cls} (a quantized weight) that something besides the model holds "
            f"(an autograd graph of a forward not run backward yet?); pager moves such weights onto the "
            f"device in place. Run the backward, or drop the graph, before wrapping."
        )
    for inner_name, inner in inner_tensors(t):
        if is_wrapper(inner) or own_dispatch(inner) or inner.layout != torch.strided:
            return (
                f"pager: {name!r} is a {cls} whose inner tensor {inner_name!r} is a "
                f"{type(inner).__qualname__} (layout {inner.layout}); pager pages wrappers of plain dense "
                f"tensors only. Keep this module out of the blocks, or convert the weight."
            )
    return None


def inner_tensors(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(attribute name, inner tensor) of wrapper `t`, as `__tensor_flatten__` names them."""
    names, _ctx = cast("TensorWithFlatten", t).__tensor_flatten__()
    return [(n, getattr(t, n)) for n in names]


def expand(named: list) -> list:
    """`named` (name, tensor) pairs with each wrapper replaced by its inner
    tensors, named `<name>.<attribute>`: what a page holds."""
    out = []
    for name, t in named:
        if is_wrapper(t):
            out += [(f"{name}.{n}", inner) for n, inner in inner_tensors(t)]
        else:
            out.append((name, t))
    return out


def nbytes_of(t: torch.Tensor) -> int:
    """The bytes `t` holds: a wrapper's inner tensors', else its own."""
    if is_wrapper(t):
        return sum(nbytes_of(inner) for _n, inner in inner_tensors(t))
    return t.numel() * t.element_size()


def rebuilt(t: torch.Tensor, inner: dict, cls=None) -> torch.Tensor:
    """A new wrapper like `t` (of class `cls`, default `t`'s) around the
    tensors of `inner` ({attribute: tensor}): on their device."""
    _names, ctx = cast("TensorWithFlatten", t).__tensor_flatten__()
    wrapper_cls = cast("type[TensorWithFlatten]", cls or type(t))
    return wrapper_cls.__tensor_unflatten__(inner, ctx, t.size(), t.stride())


def follow_inner(t: torch.Tensor) -> None:
    """Make wrapper `t` (the same object, class and attributes) report the
    device its inner tensors are on now: see the Note. `t` must have no
    autograd history (a frozen parameter has none)."""
    new = rebuilt(t, dict(inner_tensors(t)))
    if new.device != t.device:
        _swap_impl(t, new)


def _swap_impl(t: torch.Tensor, new: torch.Tensor) -> None:
    """Give `t` the implementation (device, sizes) of `new`, keeping its class
    and attributes: `torch.utils.swap_tensors` but for its refusal of weak
    references, which torch.compile's guards hold on parameters and which
    must keep seeing this same object."""
    if t._use_count() > 1 or t.grad_fn is not None:  # type: ignore[attr-defined]  # (private, not in torch's stubs)
        raise RuntimeError(
            f"pager: cannot move the quantized {type(t).__qualname__} to {new.device}: another object holds its "
            f"implementation (an autograd graph?). Run the step to its end (backward) first."
        )
    attributes = dict(t.__dict__)
    if weakref.getweakrefcount(t) == 0:
        torch.utils.swap_tensors(t, new)
    else:
        torch._C._swap_tensor_impl(t, new)
    t.__dict__.clear()
    t.__dict__.update(attributes)


def copy_on(t: torch.Tensor, values: dict, device, cls) -> torch.Tensor:
    """A new wrapper like `t`, of class `cls`, holding copies of `values` ({attribute: tensor}) on `device`."""
    return rebuilt(t, {n: v.detach().to(device, copy=True) for n, v in values.items()}, cls)
